"""Sampling, the first stage of a private step: Poisson batches drawn under the run's secret key
(``poisson``: ``PoissonSampler``), and the loop that fetches them from any map-style ``Dataset``
through a ``DataLoader`` (``loader``: ``PoissonLoader``; in-memory tensors as ``TensorData``)."""

from .loader import PoissonLoader, TensorData
from .poisson import PoissonSampler, epoch_steps

__all__ = ["PoissonLoader", "PoissonSampler", "TensorData"]
