"""A training run, in the order it happens: ``config`` (``TrainConfig``: every setting, validated
before any work) -> ``splits`` (the data, loaded once) -> ``build`` (``build_run``: model and
``DPEngine``) -> the steps (``clipbias.engine.run_steps``) -> ``checkpoint`` (PRIVATE state, resume,
export) -> ``report`` (header, ``results.json``, summaries, ``plots``). ``train`` strings them together
(``training``: ``train(config)``, ``run_many``).
"""

from .build import Run, build_run, evaluate
from .checkpoint import export_weights, load_checkpoint
from .config import TrainConfig, default_out
from .splits import Splits, prepare_splits
from .training import run_many, train

__all__ = ["Run", "Splits", "TrainConfig", "build_run", "default_out", "evaluate", "export_weights",
           "load_checkpoint", "prepare_splits", "run_many", "train"]
