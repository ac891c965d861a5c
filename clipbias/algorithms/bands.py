"""Banded correlated noise (banded matrix factorisation; Choquette-Choo, Ganesh, McKenna, McMahan,
Rush, Thakurta, Xu, NeurIPS 2023), a noise stage for the Gaussian-accounted algorithms.

With b bands the mechanism releases, at step t, ``y_t = sum_{k < b} c_k v_{t-k} + std Z_t`` (v: the
clipped sum divided by B, as the plain noise stage receives it; Z_t i.i.d. standard normal, rounded
onto the grid like every release) and hands the optimizer

    g_t = (y_t - sum_{1 <= k < b} c_k g_{t-k}) / c_0  =  v_t + w_t,   w = C^{-1} std Z,

where C is the lower-triangular banded Toeplitz matrix of ``c``: post-processing of the releases.
The noise an update receives is then negatively correlated with the noise of the b - 1 updates before
it, so that the sums of updates the optimizer accumulates (its momentum and the iterate) carry less
noise than independent draws of the same scale would.

Privacy (docs/privacy.md, "Banded noise"): with ``sum c_k^2 = 1`` and cyclic Poisson participation
(``PoissonSampler(bands=b)``: an example joins only steps of one class mod b, each with probability
b q), one participation reaches b consecutive releases, those of different participations are
disjoint, and each such block is one Gaussian release of sensitivity C / B at the step's rate: the
subsampled Gaussian at rate b q composed ceil(T / b) times (``AccountingSpec.bands``). b = 1 is the
plain noise stage.

Coefficients (``bands_strategy``): ``taylor``, the first b Taylor coefficients of ``((1 - x)(1 - beta
x))^(-1/2)`` (the square root of the workload of SGD with momentum beta, the run's momentum), scaled to
unit norm; or ``optimized``, the unit-norm coefficients that minimise the expected total squared error
of the T iterates, ``||A C^{-1}||_F^2`` (``band_strategy``). Either is private with the same proof.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from .. import distributed
from ..errors import ConfigError
from ..privacy import AccountingSpec
from ..randomness import SecretKey, snapped_gaussian
from ..transforms import GaussianNoise, Pipeline, Stage
from .band_taylor import coefficients  # noqa: F401  (bands.coefficients: the API since banded noise came)

# the algorithms whose rows are a function of one example and one step (no state across steps in the
# rows or the sums, no second release, one bounding stage): a block of b releases then holds one
# participation's contribution and nothing else of that example
BANDABLE = ("dpsgd", "normalized", "disk", "dpsgd+disk", "normalized+disk", "perturb", "self-aug", "perturb+disk",
            "self-aug+disk")


def check_bandable(algorithm: str, bands: int) -> None:
    """Refuse ``bands`` > 1 for an algorithm the banded accounting does not cover."""
    if bands != 1 and algorithm not in BANDABLE:
        raise ConfigError(f"`bands={bands}` is not available for {algorithm}: banded noise is accounted for algorithms "
                          f"whose rows depend on one example at one step and that release only the noisy update "
                          f"({', '.join(BANDABLE)}); error feedback, adaptive clipping, per-example momentum and "
                          f"inner-outer momentum carry an example's gradient across steps or release more "
                          f"(docs/privacy.md, \"Banded noise\")")


def check_strategy(strategy: str) -> None:
    """Refuse a ``bands_strategy`` that is not one of ``band_strategy.STRATEGIES``."""
    from .band_strategy import STRATEGIES
    if strategy not in STRATEGIES:
        raise ConfigError(f"`bands_strategy` must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def band_coefficients(bands: int, momentum: float = 0.0, strategy: str = "taylor",
                      steps: float | None = None) -> tuple[float, ...]:
    """The coefficients of ``strategy`` (``taylor`` or ``optimized``, which needs the run's finite number of
    ``steps``); with torchrun, rank 0's (every rank then bands with the same bits)."""
    from .band_strategy import optimized
    check_strategy(strategy)
    if strategy == "taylor" or bands == 1:
        return coefficients(bands, momentum)
    coefficients(bands, momentum)  # refuses a momentum outside [0, 1)
    if not (isinstance(steps, int) and steps >= 1):
        raise ConfigError(f"bands_strategy='optimized' shapes the noise for the run's length: give epochs or steps "
                          f"(got steps={steps!r})")
    return distributed.from_rank0(lambda: optimized(bands, steps, momentum))


class BandedNoise(Stage):
    """The noise stage of b-banded noise: releases ``y_t`` (rounded onto the grid of ``std``, like
    ``GaussianNoise``), returns ``g_t`` (module docstring).

    State: the draw counter, the last b - 1 inputs ``v`` (PRIVATE: clipped sums without noise, saved
    only in the engine's private ``state_dict``) and the last b - 1 outputs ``g``, all float64."""

    def __init__(self, std: float, key: SecretKey, coefs: tuple[float, ...], strategy: str = "taylor") -> None:
        if not std > 0:
            raise ConfigError(f"banded noise needs a noise std > 0, got {std!r}")
        if not coefs or coefs[0] <= 0 or not math.isclose(sum(c * c for c in coefs), 1.0, rel_tol=1e-12):
            raise ConfigError(f"banded noise coefficients must have c_0 > 0 and unit norm, got {coefs!r}")
        if not isinstance(key, SecretKey):
            raise ConfigError(f"BandedNoise needs a clipbias.randomness.SecretKey, got {type(key).__name__}")
        self.std, self.key, self.coefs = float(std), key, tuple(float(c) for c in coefs)
        self.strategy = strategy  # the name of the coefficients' strategy (band_strategy.STRATEGIES)
        self.draws = 0
        self.inputs: list[Tensor] = []   # v_{t-1}, v_{t-2}, ... (at most b - 1)
        self.outputs: list[Tensor] = []  # g_{t-1}, g_{t-2}, ...
        self._pending: tuple[int, list[Tensor], list[Tensor]] | None = None

    @property
    def bands(self) -> int:
        return len(self.coefs)

    def __call__(self, v: Tensor) -> Tensor:
        c, keep = self.coefs, self.bands - 1
        v64 = v.to(torch.float64, copy=True)  # kept: never an alias of the caller's tensor
        mixed = c[0] * v64
        for ck, past in zip(c[1:], self.inputs):
            mixed += ck * past
        y = snapped_gaussian(mixed, self.std, self.key, self.draws)  # the release (float64 grid values)
        for ck, past in zip(c[1:], self.outputs):
            y -= ck * past
        g = y.div_(c[0])
        self._pending = (self.draws + 1, ([v64] + self.inputs)[:keep], ([g] + self.outputs)[:keep])
        return g.to(v.dtype, copy=True)  # g is kept: the caller gets its own copy

    def commit(self) -> None:
        if self._pending is not None:
            self.draws, self.inputs, self.outputs = self._pending
            self._pending = None

    def rollback(self) -> None:
        self._pending = None

    def state_dict(self) -> dict:
        return {"draws": self.draws, "coefs": list(self.coefs), "strategy": self.strategy,
                "inputs": [t.clone() for t in self.inputs], "outputs": [t.clone() for t in self.outputs]}

    def load_state_dict(self, state: dict) -> None:
        saved, strategy = tuple(float(c) for c in state["coefs"]), state["strategy"]
        # A run keeps one c from its first step to its last: a c changed mid-run would give the columns of
        # C that straddle the change a norm above 1 (docs/privacy.md, "Banded noise"). So a resumed run goes
        # on with the saved c: taylor's must equal this run's (the same --bands and momentum); optimised ones
        # are kept as they are (recomputed elsewhere they may differ in the last bits; an extended run's
        # steps would give others)
        valid = len(saved) == self.bands and saved[0] > 0 and \
            math.isclose(sum(c * c for c in saved), 1.0, rel_tol=1e-12)
        if strategy != self.strategy or not valid or strategy == "taylor" and saved != self.coefs:
            raise ConfigError(f"banded noise state has {strategy} coefficients {state['coefs']}, this run "
                              f"{self.strategy} {list(self.coefs)}: resume with the same `bands`, "
                              f"`bands_strategy` and momentum")
        self.coefs = saved
        self.draws = int(state["draws"])
        self.inputs = [t.to(torch.float64) for t in state["inputs"]]
        self.outputs = [t.to(torch.float64) for t in state["outputs"]]
        self._pending = None


def band_pipeline(pipeline: Pipeline, algorithm: str, bands: int, momentum: float, key: SecretKey,
                  strategy: str = "taylor", steps: float | None = None) -> Pipeline:
    """``pipeline`` with its noise stage replaced by ``BandedNoise`` of ``bands`` bands (the same std) and
    the coefficients of ``strategy`` for ``steps`` steps (``band_coefficients``); refuses algorithms whose
    rows or releases the banded accounting does not cover."""
    if bands == 1:
        return pipeline
    check_bandable(algorithm, bands)
    if not isinstance(pipeline.noise, GaussianNoise) or pipeline.noise_per_bound is not None:
        raise ConfigError(f"`bands={bands}`: {algorithm} has no fixed Gaussian noise stage to band")
    pipeline.noise = BandedNoise(pipeline.noise.std, key, band_coefficients(bands, momentum, strategy, steps), strategy)
    return pipeline


def banded_spec(spec: AccountingSpec, bands: int) -> AccountingSpec:
    """``spec`` with ``bands`` bands, its note saying what the accounting then rests on."""
    if bands == 1:
        return spec
    note = (f"{spec.note}; {bands}-banded noise with cyclic Poisson participation in {bands} classes: each "
            f"participation is one Gaussian release over {bands} steps, accounted at rate {bands} q for "
            f"ceil(T / {bands}) steps (Choquette-Choo et al. 2023; docs/privacy.md, \"Banded noise\")")
    return replace(spec, bands=bands, note=note)
