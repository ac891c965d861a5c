"""What a run's releases are accounted as, in typed objects: who participates (``Poisson``, ``Cyclic``), how the
noise is correlated across steps (``Independent``, ``Banded``, ``BLTStrategy``: each with its sensitivity and the
participation it needs) and the mechanism (``SubsampledGaussian``, ``ErrorFeedback`` with its ``dice.DiceBasis``,
``NonPrivate``: each with its dp-accounting event, its report and its calibration), and ``AccountingSpec``, the
description an algorithm produces, which converts its ``kind`` and noise fields into these objects once.

The user-facing spellings (``kind``, ``dice_accounting``) are looked up in the registries ``MECHANISMS`` and
``dice.BASES`` where they enter; past that the accounting dispatches on the objects."""

from __future__ import annotations

import abc
import math
from dataclasses import asdict, dataclass, field, replace

from dp_accounting import dp_event

from ..errors import ConfigError
from ..registry import Registry
from . import dice, gaussian
from .dice import DEFAULT_DICE_ACCOUNTING, DiceBasis, DiceParams
from .report import PrivacyReport, check_accountant, check_rate, check_steps


# ---------------------------------------------------------------- participation
@dataclass(frozen=True)
class Poisson:
    """Each example joins each step independently at the sampling rate q."""

    classes = 1

    def amplified(self, q: float, steps: int) -> tuple[float, int]:
        """(rate, compositions) of the subsampled Gaussian that ``steps`` steps amount to."""
        return q, steps


@dataclass(frozen=True)
class Cyclic:
    """Cyclic Poisson participation: an example joins only the steps of its class mod ``classes``, each with
    probability ``classes`` q (``PoissonSampler(bands=classes)``)."""

    classes: int

    def amplified(self, q: float, steps: int) -> tuple[float, int]:
        """One participation is one Gaussian release over ``classes`` steps: rate b q, ceil(T / b) of them."""
        from ..sampling.poisson import band_rate  # the sampler's own float
        return band_rate(self.classes, q), -(-steps // self.classes)


# ---------------------------------------------------------------- the noise's correlation across steps
class _Amplified:
    """A strategy whose releases are the subsampled Gaussian amplified by its ``participation``, at sensitivity 1."""

    def sensitivity(self, steps: int) -> float:
        """Delta(steps) in units of the per-example sensitivity."""
        return 1.0

    def rate_and_steps(self, q: float, steps: int) -> tuple[float, int]:
        return self.participation.amplified(q, steps)


@dataclass(frozen=True)
class Independent(_Amplified):
    """Independent Gaussian noise at every step (the identity strategy): sensitivity 1, Poisson participation."""

    participation = Poisson()
    bands = 1


@dataclass(frozen=True)
class Banded(_Amplified):
    """b-banded noise with unit-norm coefficients (``clipbias.algorithms.bands``): under cyclic participation in b
    classes each participation reaches b releases, those of different participations are disjoint, so it is the
    subsampled Gaussian at rate b q for ceil(T / b) steps (docs/privacy.md, "Banded noise")."""

    bands: int

    @property
    def participation(self) -> Cyclic:
        return Cyclic(self.bands)


@dataclass(frozen=True)
class BLTStrategy:
    """BLT noise (``clipbias.algorithms.blt``) in ``bands`` classes: ``params`` = (c_0, omegas..., thetas...). The
    whole run is one Gaussian mechanism at sensitivity Delta(T), the strategy's over the class's steps, with no
    amplification by sampling (docs/privacy.md, "BLT noise")."""

    params: tuple[float, ...]
    bands: int

    @property
    def participation(self) -> Cyclic:
        return Cyclic(self.bands)

    def sensitivity(self, steps: int) -> float:
        from .toeplitz import blt_sensitivity
        d = (len(self.params) - 1) // 2
        return blt_sensitivity(self.params[0], self.params[1:1 + d], self.params[1 + d:], self.bands, steps)

    def rate_and_steps(self, q: float, steps: int) -> tuple[float, int]:
        return 1.0, 1  # no amplification: the whole run is one Gaussian mechanism


# ---------------------------------------------------------------- the mechanisms
class Mechanism(abc.ABC):
    """How one kind of release is accounted (``MECHANISMS``, by ``AccountingSpec.kind``). ``event``, ``report`` and
    ``calibrate`` take validated inputs (``privacy.account`` and ``privacy.calibrate`` check them once)."""

    name = ""
    private = True
    takes_basis = False  # accounted by one of error feedback's bases (``dice_accounting``)

    def with_basis(self, basis: str | DiceBasis) -> Mechanism:
        """The mechanism accounted with error feedback's ``basis`` (a ``dice_accounting`` spelling or a
        ``DiceBasis``; itself, and the basis not looked at, where it has no error feedback)."""
        return self

    @property
    def basis_name(self) -> str | None:
        """The name of its error-feedback basis (None without error feedback): part of the calibration's key."""
        return None

    def check(self, spec: AccountingSpec) -> None:
        """Refuse a spec this mechanism cannot account."""

    def check_calibration(self, spec: AccountingSpec) -> None:
        """Refuse a spec whose noise this mechanism cannot calibrate."""
        self.check(spec)

    @abc.abstractmethod
    def event(self, spec: AccountingSpec, steps: int) -> dp_event.DpEvent:
        """The dp-accounting event of ``steps`` releases."""

    @abc.abstractmethod
    def report(self, spec: AccountingSpec, steps: int, delta: float, accountant: str) -> PrivacyReport:
        """The privacy statement after ``steps`` releases."""

    @abc.abstractmethod
    def calibrate(self, spec: AccountingSpec, epsilon: float, delta: float, steps: int, accountant: str) -> float:
        """The smallest noise multiplier whose ``steps`` releases end at ``epsilon`` or below."""


class NonPrivate(Mechanism):
    """No noise: epsilon = inf, uncertified."""

    name, private = "none", False

    def check_calibration(self, spec):
        raise ConfigError("a non-private algorithm has no noise to calibrate; pick a private `algorithm`")

    def event(self, spec, steps):
        return dp_event.NonPrivateDpEvent()

    def report(self, spec, steps, delta, accountant):
        return PrivacyReport(math.inf, delta, "none", "non-private (no noise): no DP guarantee", False,
                             spec.noise_multiplier)

    def calibrate(self, spec, epsilon, delta, steps, accountant):
        self.check_calibration(spec)  # (refuses: no noise to calibrate)


class SubsampledGaussian(Mechanism):
    """The Poisson-subsampled Gaussian at multiplier z relative to the per-example sensitivity, its rate and
    compositions and its sensitivity those of the spec's noise strategy."""

    name = "gaussian"

    def event(self, spec, steps):
        q, t = spec.rate_and_steps(steps)
        return gaussian.SampledGaussian(spec.multiplier(steps), q).event(t)

    def report(self, spec, steps, delta, accountant):
        check_steps(steps)
        q, t = spec.rate_and_steps(steps)
        check_rate(q)
        gaussian.check_noise(spec.noise_multiplier)
        check_steps(t)
        if not isinstance(spec.noise, BLTStrategy):
            return gaussian.report(spec.noise_multiplier, q, t, delta, accountant, spec.note)
        sens = spec.blt_sensitivity(steps)
        rep = gaussian.report(spec.multiplier(steps), q, t, delta, accountant)
        how = ("exact: mu-GDP with mu = Delta / z (Balle & Wang 2018; Dong, Roth & Su 2019)" if accountant == "pld"
               else rep.basis)
        basis = (f"the {steps} steps as one Gaussian mechanism at noise multiplier z / Delta = "
                 f"{spec.multiplier(steps):.6g} (Delta({steps}) = {sens:.6g}), {how}; {spec.note}")
        return replace(rep, noise_multiplier=spec.noise_multiplier, basis=basis)

    def calibrate(self, spec, epsilon, delta, steps, accountant):
        q, t = spec.rate_and_steps(steps)
        z = gaussian._calibrate(epsilon, delta, check_rate(q), check_steps(t), check_accountant(accountant))
        if not isinstance(spec.noise, BLTStrategy):
            return z
        sens = spec.blt_sensitivity(steps)
        scaled = z * sens
        while scaled / sens < z:  # never below the Gaussian mechanism's multiplier after the division
            scaled = math.nextafter(scaled, math.inf)
        return scaled


@dataclass(frozen=True)
class ErrorFeedback(Mechanism):
    """DiceSGD's error feedback (``spec.dice``: C1, C2, B, G_max), accounted by ``basis``: the sound bound (the
    default), the conservative one, or the paper's refuted Theorem 3.8 and the authors' protocol, both labelled
    ``certified: false``."""

    basis: DiceBasis = dice.SOUND
    name, takes_basis = "dice", True

    def with_basis(self, basis):
        return replace(self, basis=dice.basis(basis))

    @property
    def basis_name(self):
        return self.basis.name

    def check(self, spec):
        self.basis.check_claims(spec.certifiable, spec.why_not_certifiable)

    def event(self, spec, steps):
        return self.basis.event(replace(spec.dice, steps=steps), spec.noise_multiplier)

    def report(self, spec, steps, delta, accountant):
        self.check(spec)
        return self.basis.report(replace(spec.dice, steps=steps), spec.noise_multiplier, delta, accountant)

    def check_calibration(self, spec):
        self.check(spec)
        if spec.bands != 1:
            raise ConfigError(f"banded noise is accounted for the subsampled Gaussian only, not {self.name!r}")

    def calibrate(self, spec, epsilon, delta, steps, accountant):
        return dice.calibrate(epsilon, delta, replace(spec.dice, steps=steps), self.basis, accountant)


MECHANISMS: Registry[Mechanism] = Registry("an accounting kind", "kind")
SUBSAMPLED_GAUSSIAN = MECHANISMS.register(SubsampledGaussian())
ERROR_FEEDBACK = MECHANISMS.register(ErrorFeedback())
NON_PRIVATE = MECHANISMS.register(NonPrivate())


def mechanism(kind: str, basis: str | DiceBasis = DEFAULT_DICE_ACCOUNTING) -> Mechanism:
    """The mechanism of accounting ``kind`` (``"gaussian"``, ``"dice"``, ``"none"``) with error feedback's ``basis``
    (a spelling or a ``DiceBasis``): each checked, else a ConfigError in the caller's words."""
    return MECHANISMS.lookup(kind).with_basis(basis)


# ---------------------------------------------------------------- the spec
@dataclass(frozen=True)
class AccountingSpec:
    """How an algorithm's releases are accounted.

    kind ``gaussian``: Poisson-subsampled Gaussian with multiplier z relative to ``sensitivity`` (the
    per-example L2 bound of the summed rows; ``note`` says in words why it holds);
    kind ``dice``: DiceSGD error feedback (``dice`` holds C1, C2, B, G_max; steps filled in by
    ``account``), accounted by one of ``DICE_ACCOUNTING`` (default ``sound``);
    kind ``none``: non-private, epsilon = inf.
    ``bands`` = b > 1 (kind ``gaussian`` only): cyclic Poisson participation (classes mod b) with b-banded noise
    (``clipbias.algorithms.bands``), accounted as the subsampled Gaussian at rate b q for ceil(T / b)
    steps (docs/privacy.md, "Banded noise").
    ``blt`` = (c_0, omegas..., thetas...) (kind ``gaussian``, ``bands`` = k classes): BLT noise
    (``clipbias.algorithms.blt``), accounted as one Gaussian mechanism at multiplier z / Delta(T), Delta the
    strategy's sensitivity over T steps in k classes, with no amplification (docs/privacy.md, "BLT noise").

    The fields are converted once, when the spec is made: ``mechanism`` (``MECHANISMS[kind]``) and ``noise``
    (``Independent``, ``Banded`` or ``BLTStrategy``).
    """

    kind: str
    sample_rate: float
    noise_multiplier: float = 0.0
    note: str = ""
    dice: DiceParams | None = None
    certifiable: bool = True  # False: even the paper's (refuted) DiceSGD proof does not apply
    why_not_certifiable: str = ""
    sensitivity: float | None = None  # None: non-private, or a spec written by hand (clipbias account)
    bands: int = 1
    blt: tuple[float, ...] = ()
    mechanism: Mechanism = field(init=False, repr=False, compare=False)
    noise: Independent | Banded | BLTStrategy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mechanism", MECHANISMS.lookup(self.kind))
        noise = BLTStrategy(tuple(self.blt), self.bands) if self.blt else \
            Independent() if self.bands == 1 else Banded(self.bands)
        object.__setattr__(self, "noise", noise)

    def blt_sensitivity(self, steps: int) -> float:
        """BLT noise: Delta(steps) in units of the per-example sensitivity (1.0 without BLT noise)."""
        return self.noise.sensitivity(steps)

    def multiplier(self, steps: int) -> float:
        """The noise multiplier the accountant sees after ``steps`` steps: z, or with BLT noise z / Delta."""
        return self.noise_multiplier / self.blt_sensitivity(steps)

    def rate_and_steps(self, steps: int) -> tuple[float, int]:
        """(sampling rate, number of compositions) of the subsampled Gaussian that ``steps`` steps
        amount to: (q, T), or with b bands (b q, ceil(T / b)): each example can join one step in b,
        and the b rows its contribution reaches are one Gaussian release (docs/privacy.md)."""
        return self.noise.rate_and_steps(self.sample_rate, steps)

    def accounted_as(self, basis: str | DiceBasis = DEFAULT_DICE_ACCOUNTING) -> Mechanism:
        """The mechanism that accounts the spec's releases: its kind's, with error feedback's ``basis``, and
        ``NonPrivate`` where no noise is added."""
        if self.noise_multiplier == 0:
            return NON_PRIVATE
        return self.mechanism.with_basis(basis)

    def dp_event(self, steps: int, dice_accounting: str | DiceBasis = DEFAULT_DICE_ACCOUNTING
                 ) -> dp_event.DpEvent:
        """The dp-accounting event of T steps.

        DiceSGD: the sound bound's mixture-of-Gaussians event (units of C1/B); the other bases are
        algorithm-specific formulas with no event (``UnsupportedDpEvent``).
        """
        return self.accounted_as(dice_accounting).event(self, steps)

    def to_dict(self) -> dict:
        d = {f: getattr(self, f) for f in ("kind", "sample_rate", "noise_multiplier", "note", "certifiable",
                                             "why_not_certifiable", "sensitivity", "bands", "blt")}
        if self.dice is not None:
            d["dice"] = {k: v for k, v in asdict(self.dice).items() if k != "steps"}
        return d
