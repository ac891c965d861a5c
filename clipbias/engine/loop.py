"""``run_steps``: the one sample-and-step loop of every training (the CLI's, the toy problems', the
diagnostics recorder's, the one-run audit's), over in-memory tensors, a structured batch, any
map-style ``Dataset`` or a ``PoissonLoader``."""

from __future__ import annotations

from typing import Callable, Protocol

from torch import Tensor
from torch.utils.data import Dataset

from ..data.batch import Batch
from ..errors import ConfigError
from ..sampling.loader import PoissonLoader, TensorData



class Engine(Protocol):
    """What the loop asks of an engine (``clipbias.engine.DPEngine`` is one): its planned and taken
    steps, one step on a batch, and the step's global (loss sum, example count)."""

    total_steps: float
    steps_taken: int
    last_loss: tuple[float, int]

    def step(self, x: Batch, y: Batch, indices: Tensor | None = None) -> Tensor: ...


StepHook = Callable[[Engine, Tensor], None]


def run_steps(engine: Engine, x: "Batch | Dataset | PoissonLoader", y: Batch | None = None,
              steps: int | None = None, *, before: Callable[[Engine], None] | None = None,
              after: StepHook | None = None, **loader_options) -> tuple[float, int]:
    """The sample-and-step loop: up to ``steps`` Poisson steps (default: all remaining), stopping at
    ``engine.total_steps`` (an engine that has taken all its planned steps refuses: ConfigError); returns
    (sum of the example losses, number of examples). The data are
    in-memory ``(x, y)`` (tensors or structured batches, on the CPU or the GPU), a map-style Dataset
    ``x`` (``y`` None; ``loader_options`` go to ``clipbias.sampling.PoissonLoader``: ``collate_fn``,
    ``num_workers``, ...) or a ``PoissonLoader``: one loop for all (``PoissonLoader.epoch``).
    ``before(engine)`` runs before each step, ``after(engine, losses)`` after it: progress bars,
    diagnostics, iterate traces. Used by training, the toy problems and the diagnostics recorder
    alike. In a process group every rank draws the same global sample and steps on its share
    (``engine.local_share``); ``after`` gets this rank's losses, the sums are global.
    """
    check_steps_left(engine)
    if isinstance(x, PoissonLoader):
        if x.engine is not engine:  # its batches come from that engine's sampler, at that engine's q and n
            raise ConfigError("this PoissonLoader was built for another engine: its batches are that engine's "
                              "Poisson samples (its sampling rate, its secret sampler), not this engine's, so "
                              "this engine's accounting would not describe them; build "
                              "PoissonLoader(engine, dataset) for this engine")
        if loader_options or y is not None:
            raise ConfigError(f"a PoissonLoader carries its own data and options; got also "
                              f"{'labels' if y is not None else ', '.join(loader_options)}: pass them when "
                              f"building the PoissonLoader")
        loader = x
    else:
        loader = PoissonLoader(engine, x if y is None else TensorData(x, y), **loader_options)
    total, count = 0.0, 0
    for xb, yb, idx in loader.epoch(engine.total_steps - engine.steps_taken if steps is None else steps):
        if before is not None:
            before(engine)
        losses = engine.step(xb, yb, idx)
        total, count = total + engine.last_loss[0], count + engine.last_loss[1]  # global sums
        if after is not None:
            after(engine, losses)
    return total, count


def check_steps_left(engine: Engine) -> None:
    """Refuse to run on once every planned step is taken: the loader would yield nothing and the epoch
    would silently do nothing."""
    if engine.steps_taken >= engine.total_steps:
        raise ConfigError(f"all {engine.total_steps} planned steps of this DPEngine are taken (the noise and the "
                          f"privacy accounting cover exactly them): there is nothing left to train. To train "
                          f"longer, build a new DPEngine whose epochs (or steps) cover the whole run, so that its "
                          f"noise is calibrated to it")
