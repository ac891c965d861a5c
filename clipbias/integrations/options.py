"""The differential-privacy settings shared by the Hugging Face and Lightning integrations, and the one
way both turn them into a ``DPEngine`` over the user's model and optimizer.

Both integrations hand the engine the user's own optimizer (``DPEngine(optimizer=...)``), so learning-rate
schedulers, weight-decay groups and the optimizer's checkpoint stay the framework's; the engine draws the
batches (its secret Poisson sampler), computes and clips the per-example gradients, adds the noise and
accounts every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .. import algorithms, privacy
from ..engine import DPEngine
from ..errors import ConfigError
from ..grads.precision import check_autocast
from .opacus import ACCOUNTANTS, _base_kind, engine_config


@dataclass
class DPOptions:
    """How private the training is. Give ``target_epsilon`` (the noise multiplier is calibrated so that the
    planned steps end at it or just below) or ``noise_multiplier`` (accounted as the steps are taken).

    ``target_delta``: default ``min(1e-5, 1 / (10 n))`` for ``n`` training examples. ``max_grad_norm``: the
    per-example clipping norm C. ``algorithm``: ``dpsgd`` (default), ``dice``, ``adaptive``, ... (clipbias's
    algorithms with per-example rows). ``grad_path``: ``auto``, ``rows`` (torch.func) or ``fast``
    (book-keeping, no rows). ``accountant``: ``pld`` (default; ``prv`` is the same), ``rdp``. ``bands``,
    ``bands_strategy``: banded correlated noise and its coefficients, or ``"blt"``: BLT noise (``DPEngine``'s).
    ``noise_seed``: reproducible batches and noise for tests; the run is then reported uncertified.
    ``autocast``: ``"bfloat16"`` / ``"float16"`` (or the torch dtypes) runs each step's forward and backward
    under ``torch.autocast`` with norms, clip factors and sums in float32 (``DPEngine(autocast=...)``);
    ``loss_scale``: its float16 loss scale, a power of two (default 256)."""

    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    target_delta: float | None = None
    max_grad_norm: float = 1.0
    algorithm: str = "dpsgd"
    grad_path: str = "auto"
    accountant: str = "pld"
    dice_accounting: str = privacy.DEFAULT_DICE_ACCOUNTING
    bands: int = 1
    bands_strategy: str = "taylor"
    settings: dict = field(default_factory=dict)
    ef_clip: float | None = None
    noise_seed: int | None = None
    autocast: str | torch.dtype | None = None
    loss_scale: float | None = None

    def check(self) -> None:
        """Refuse settings that cannot make a private run, before anything is built."""
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ConfigError("give exactly one of target_epsilon (the noise is calibrated to it) and "
                              f"noise_multiplier; got target_epsilon={self.target_epsilon!r}, "
                              f"noise_multiplier={self.noise_multiplier!r}")
        for name in ("target_epsilon", "noise_multiplier", "max_grad_norm"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.target_delta is not None:
            privacy.check_delta(self.target_delta, "target_delta")
        if self.accountant not in ACCOUNTANTS:
            raise ConfigError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        if self.algorithm not in algorithms.ALGORITHMS:
            raise ConfigError(f"algorithm {self.algorithm!r} is not a clipbias algorithm; choose one of "
                              f"{', '.join(algorithms.ALGORITHMS)}")
        algo = algorithms.get(self.algorithm)
        if not algo.private:
            raise ConfigError(f"algorithm {self.algorithm!r} is not private (no noise): use dpsgd, dice, ...")
        if algo.needs_public:
            raise ConfigError(f"algorithm {self.algorithm!r} needs public features beside the private data; it "
                              f"runs from `TrainConfig` (`public_size`) or the clipbias CLI")
        if self.grad_path not in ("auto", "rows", "fast"):
            raise ConfigError(f"grad_path must be auto, rows or fast, got {self.grad_path!r}")
        check_autocast(self.autocast, self.loss_scale)

    def delta(self, n: int) -> float:
        return self.target_delta if self.target_delta is not None else min(1e-5, 1.0 / (10 * n))

    def engine(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, n: int, batch_size: float,
               steps: int | None, loss_fn: Callable, max_physical_batch: int,
               stepped: torch.optim.Optimizer | None = None) -> DPEngine:
        """A ``DPEngine`` over ``model`` stepping ``optimizer`` (which must hold exactly the trainable
        parameters): expected batch ``batch_size`` of ``n`` examples; ``steps`` planned (needed with
        ``target_epsilon``; with ``noise_multiplier`` the run is open-ended). ``stepped``: what the engine
        steps in place of ``optimizer`` (a view of it that leaves the update for the framework to apply)."""
        self.check()
        if self.target_epsilon is not None and not steps:
            raise ConfigError("target_epsilon needs the number of steps in advance (epochs or max_steps)")
        _base_kind(optimizer)  # refuses anything but a torch optimizer, naming it
        config = engine_config(optimizer, self.max_grad_norm, self.ef_clip, self.settings)
        return DPEngine(model, self.algorithm, n=n, batch_size=batch_size,
                        steps=steps if self.target_epsilon is not None else None,
                        epsilon=self.target_epsilon, noise_multiplier=self.noise_multiplier, delta=self.delta(n),
                        accountant=ACCOUNTANTS[self.accountant], dice_accounting=self.dice_accounting,
                        config=config, loss_fn=loss_fn, optimizer=stepped or optimizer, grad_path=self.grad_path,
                        bands=self.bands, bands_strategy=self.bands_strategy, max_physical_batch=max_physical_batch,
                        noise_seed=self.noise_seed,
                        autocast=self.autocast, loss_scale=self.loss_scale)


class EpsilonLog:
    """Epsilon after the steps taken so far, computed once per step count (an accountant call costs
    ~0.2 s)."""

    def __init__(self) -> None:
        self._at: tuple[int, float] | None = None

    def __call__(self, engine: DPEngine) -> float:
        if self._at is None or self._at[0] != engine.steps_taken:
            self._at = (engine.steps_taken, engine.privacy().epsilon)
        return self._at[1]


def check_trainable(model: nn.Module) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("the model has no trainable parameter (requires_grad=True): nothing to train")
