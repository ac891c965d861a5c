"""A run's plan, made before its first step and apart from stepping: who participates (n, the sampling rate,
the steps), the mechanism (the algorithm, its settings, the noise's band coefficients or BLT strategy), the
calibrated noise multiplier and the accounting. Nothing in it depends on the data or the model; ``make_plan``
checks the settings once, where they enter, calibrates the noise and optimises the noise strategy, and the
engine (``DPEngine``) executes the frozen result. ``StepPlan.to_dict`` is its JSON form."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

from .. import algorithms, privacy
from ..algorithms.bands import NoiseStrategy, noise_strategy
from ..config import AlgoConfig
from ..errors import ConfigError
from ..sampling.poisson import check_bands
from .accounting import noise_multiplier_for
from .checks import canon


@dataclass(frozen=True)
class PrivacySettings:
    """The privacy-relevant settings of a run: a resumed run must match them exactly."""

    algorithm: str
    n: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    delta: float
    accountant: str
    dice_accounting: str
    clip: float
    ef_clip: float | None
    grad_bound: float | None
    gamma: float
    target_epsilon: float | None
    extra: tuple = ()  # method settings (p, k, K0, ...): they change the sensitivity or the algorithm
    bands: int = 1     # banded noise: participation classes and noise correlation (algorithms.bands)


@dataclass(frozen=True)
class PathChoice:
    """The gradient path the step's sums take, and why, as data (``StepPlan.path``; chosen from the model by
    ``engine.aggregate.choose_aggregate``, changed by ``grad_path="auto"``'s fall-back at the first step).

    Attributes:
        path: ``"fast"`` (per-layer norms and book-keeping sums, no rows), ``"sums"`` (per-example rows summed
            per parameter) or ``"rows"`` (rows through the algorithm's stages).
        requested: ``grad_path`` as given: ``"auto"``, ``"fast"`` or ``"rows"``.
        why_not_fast: Why the fast path does not apply, where ``auto`` chose another path for that reason.
        checked: The fast path's per-example proof: ``"structure"`` (rows per example by the model's structure,
            checked every step) or ``"runtime"`` (run-time checks of the model).
        two_point: DiSK: per-example gradients at two points.
        sharded: How a fully_shard model's sums and update are laid out (None: not sharded).
        fallback: ``auto``'s change at the first step: the path that refused the model, and why.
        sum_precision: The fast path's ghost-layer sums: ``"float64"`` or ``"float32"``.
    """

    path: str
    requested: str
    why_not_fast: str | None = None
    checked: str | None = None
    two_point: bool = False
    sharded: str | None = None
    fallback: str | None = None
    sum_precision: str = "float64"

    @property
    def note(self) -> str:
        """What the run's header says of it."""
        why = f"; the fast path does not apply: {self.why_not_fast}" if self.why_not_fast else ""
        if self.path == "fast":
            note = ("fast (DiSK: at two points; " if self.two_point else "fast (") + \
                "per-layer norms and book-keeping sums, no rows; " + (
                    "rows per example by the model's structure, checked every step; a loss_fn returning per-example "
                    "losses is probed" if self.checked == "structure"
                    else "per-example sensitivity rests on run-time checks of the model") + ", docs/results.md)"
        else:
            grads = "DiSK: per-example gradients at two points" if self.two_point else "per-example gradients"
            note = f"rows ({grads}, torch.func, summed per parameter{why})" if self.path == "sums" else \
                f"rows ({grads}, torch.func){why}"
        if self.sharded:
            note += f"; fully_shard: {self.sharded}"
        if self.fallback:
            note += f"; grad_path='auto' took it at the first step, where the {self.fallback}"
        if self.sum_precision == "float32":
            note += "; ghost-layer sums in float32 (sensitivity C (1 + 2^-10), the noise scaled to it)"
        return note


@dataclass(frozen=True)
class StepPlan:
    """What a run does at every step, fixed before the first (``make_plan``; frozen: a resumed BLT run replaces
    its strategy, ``dataclasses.replace``).

    Attributes:
        algorithm: The registered algorithm's name (``algo``: the ``Algorithm``).
        config: The algorithm's settings, with its defaults for this batch size.
        n: The training examples.
        expected_batch_size: B, the Poisson batch's expected size.
        sample_rate: q (B / n unless given).
        steps_per_epoch: max(1, round(n / B)) (or round(1 / q)): the sampler's epoch and band classes.
        total_steps: The planned steps (``math.inf``: an open-ended run, accounted as steps are taken).
        delta: The run's delta.
        accountant: The registered accountant's name.
        mechanism: What accounts the releases (``privacy.Mechanism``: the subsampled Gaussian, error feedback with
            its basis, or none), from the algorithm's accounting kind and ``basis``.
        basis: Error feedback's accounting basis as given (``privacy.dice.BASES``; recorded in the settings of
            every run, used by error feedback's mechanism).
        bands: Participation classes of banded or BLT noise (1: independent noise).
        strategy: The noise's strategy across steps (``algorithms.bands.NoiseStrategy``: taylor, optimized, blt).
        noise_shape: The noise's band coefficients, or the BLT strategy.
        noise_multiplier: z, given or calibrated to ``target_epsilon`` for ``total_steps``.
        target_epsilon: The epsilon the noise was calibrated to, or None.
        spec: The accounting spec (the mechanism's sensitivity and event, ``privacy.AccountingSpec``).
        path: The gradient path chosen from the model (``PathChoice``; None until the engine has chosen it; not
            compared: plans of the same settings are equal whatever the model).
    """

    algorithm: str
    config: AlgoConfig
    n: int
    expected_batch_size: float
    sample_rate: float
    steps_per_epoch: int
    total_steps: float
    delta: float
    accountant: str
    mechanism: privacy.Mechanism
    basis: privacy.DiceBasis
    bands: int
    strategy: NoiseStrategy
    noise_shape: Any
    noise_multiplier: float = 0.0
    target_epsilon: float | None = None
    spec: Any = None
    path: PathChoice | None = dataclasses.field(default=None, compare=False)  # (from the model: ``with_path``)

    @property
    def algo(self) -> algorithms.Algorithm:
        return algorithms.get(self.algorithm)

    @property
    def dice_accounting(self) -> str:
        """The spelling of ``basis`` (the ``dice_accounting`` setting)."""
        return self.basis.name

    @property
    def bands_strategy(self) -> str:
        """The spelling of ``strategy`` (the ``bands_strategy`` setting)."""
        return self.strategy.name

    @property
    def settings(self) -> PrivacySettings:
        """What a resumed run must match."""
        c = self.config
        return PrivacySettings(self.algorithm, self.n, self.sample_rate, self.total_steps, self.noise_multiplier,
                               self.delta, self.accountant, self.dice_accounting, c.clip, c.ef_clip, c.grad_bound,
                               c.gamma, self.target_epsilon, tuple(sorted((k, canon(v)) for k, v in c.extra.items())),
                               self.bands)

    def with_path(self, path: PathChoice) -> "StepPlan":
        """The plan with the gradient path chosen from the model (or changed at the first step)."""
        return dataclasses.replace(self, path=path)

    def with_strategy(self, noise_shape: Any) -> "StepPlan":
        """The plan with another noise strategy (a resumed BLT run's saved one), accounted with it."""
        return dataclasses.replace(self, noise_shape=noise_shape, spec=self.algo.spec(
            self.config, self.sample_rate, self.noise_multiplier, self.expected_batch_size, self.bands, noise_shape))

    def to_dict(self) -> dict:
        """The plan as JSON-ready values (the noise strategy by its coefficients or its class)."""
        shape = self.noise_shape
        return {"algorithm": self.algorithm, "n": self.n, "expected_batch_size": self.expected_batch_size,
                "sample_rate": self.sample_rate, "steps_per_epoch": self.steps_per_epoch,
                "total_steps": "inf" if self.total_steps == math.inf else int(self.total_steps),
                "delta": self.delta, "accountant": self.accountant, "dice_accounting": self.dice_accounting,
                "bands": self.bands, "bands_strategy": self.bands_strategy,
                "noise_shape": [float(c) for c in shape] if isinstance(shape, (tuple, list)) else type(shape).__name__,
                "noise_multiplier": self.noise_multiplier, "target_epsilon": self.target_epsilon,
                "config": dataclasses.asdict(self.config) if dataclasses.is_dataclass(self.config) else str(self.config)}


def make_plan(algorithm: str, config: AlgoConfig, *, n: int, batch_size: float, epochs: int | None,
              steps: int | None, epsilon: float | None, delta: float, noise_multiplier: float | None,
              accountant: str, dice_accounting: str | privacy.DiceBasis, bands: int,
              sample_rate: float | None, bands_strategy: str | NoiseStrategy) -> StepPlan:
    """The run's ``StepPlan`` from ``DPEngine``'s settings (``n`` and ``config`` already checked against the
    model): every setting checked (the spellings ``dice_accounting`` and ``bands_strategy`` turned into their
    typed objects, which pass as they are), the band coefficients (or BLT strategy) chosen for the planned steps,
    then the noise multiplier given or calibrated to ``epsilon``."""
    algo = algorithms.get(algorithm)
    config = algo.with_defaults(config, batch_size)
    if epsilon is not None and noise_multiplier is not None:
        raise ConfigError("give either epsilon (the noise is calibrated to it) or noise_multiplier, not both")
    privacy.check_delta(delta)
    privacy.check_accountant(accountant)
    B = float(batch_size)
    q = B / n if sample_rate is None else check_rate(sample_rate)
    check_bands(bands, q)
    algo.check_bands(bands)
    basis, strategy = privacy.dice.basis(dice_accounting), noise_strategy(bands_strategy)
    steps_per_epoch = max(1, round(n / B) if sample_rate is None else round(1 / sample_rate))
    total = planned_steps(epochs, steps, steps_per_epoch, open_ended=noise_multiplier is not None)
    # the noise's coefficients (or BLT strategy: the accounting reads it), before the noise is calibrated
    shape = strategy.shape(bands, algo.workload_momentum(config), total)
    if why := strategy.warning(bands, q):
        warnings.warn(why, stacklevel=3)
    plan = StepPlan(algo.name, config, n, B, q, steps_per_epoch, total, delta, accountant,
                    privacy.mechanism(algo.accounting, basis), basis, bands, strategy, shape, target_epsilon=epsilon)
    z = noise_multiplier_for(plan, epsilon, noise_multiplier)
    return dataclasses.replace(plan, noise_multiplier=z, spec=algo.spec(config, q, z, B, bands, shape))


def planned_steps(epochs: int | None, steps: int | None, steps_per_epoch: int, open_ended: bool) -> float:
    """The run's planned steps: ``steps``, else ``epochs`` epochs, else (with a given noise multiplier) an
    open-ended run (Opacus's habit: ``math.inf``, accounted as the steps are taken)."""
    if steps is None and epochs is None and open_ended:
        return math.inf
    if steps is None:
        if epochs is None or epochs < 1:
            raise ConfigError(f"give `epochs` >= 1 or `steps` >= 1 (got epochs={epochs!r})")
        steps = epochs * steps_per_epoch
    return steps if steps == math.inf else privacy.check_steps(steps)


def check_rate(sample_rate: float) -> float:
    """A given sampling rate: a float in (0, 1]."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
        raise ConfigError(f"sample_rate must be a number in (0, 1], got {sample_rate!r}")
    return float(sample_rate)
