"""The engine: one private training run's moving parts (sampler, row source, pipeline, optimizer,
accountant) with one private ``state_dict`` (``core``: ``DPEngine``); which aggregate computes a
step's sums (``aggregate``: the fast path, per-parameter sums or rows); its refusals (``checks``); whether a
step's batch is the one the private loader drew (``drawn``, every integration's check); the
saved states of earlier versions brought to the current format (``migrate``); and the one sample-and-step loop everything trains with (``loop``: ``run_steps``). Several processes:
``clipbias.distributed``."""

from .aggregate import AUTO_ROWS_BYTES
from .accounting import SEEDED_CAVEAT
from .core import DPEngine, PrivacySettings
from .loop import run_steps

__all__ = ["AUTO_ROWS_BYTES", "DPEngine", "PrivacySettings", "SEEDED_CAVEAT", "run_steps"]
