"""The pieces of a training run, in the order a run uses them:

``config`` (``TrainConfig``: every setting, validated before any work) -> ``splits`` (the data,
loaded once) -> ``build`` (``build_run``: model and ``DPEngine``) -> the steps
(``clipbias.engine.run_steps``) -> ``checkpoint`` (PRIVATE state, resume, export) -> ``report``
(header, ``results.json``, summaries). ``clipbias.train.train`` strings them together.
"""

from .build import Run, build_run, evaluate
from .config import TrainConfig, default_out
from .splits import Splits, prepare_splits

__all__ = ["Run", "Splits", "TrainConfig", "build_run", "default_out", "evaluate", "prepare_splits"]
