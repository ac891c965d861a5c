"""Privacy accounting: what every algorithm's guarantee rests on.

``AccountingSpec`` is the description an algorithm produces (mechanism, rate, noise multiplier,
sensitivity); ``account`` turns it into a ``PrivacyReport`` after T steps, and ``calibrate`` finds
the noise multiplier for a target epsilon without overshooting.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

from dp_accounting import dp_event

from ..errors import ClipbiasError, ConfigError
from . import cache, dice, gaussian
from . import pld, rdp  # noqa: F401  the accountants: each registers itself (accountants.ACCOUNTANTS)
from .dice import DEFAULT_DICE_ACCOUNTING, DICE_ACCOUNTING, DiceParams
from .accountants import ACCOUNTANTS
from .report import (PrivacyReport, check_accountant, check_delta, check_epsilon, check_rate,
                     check_steps, delta_warning)

__all__ = ["AccountingSpec", "PrivacyReport", "DiceParams", "account", "calibrate", "ACCOUNTANTS",
           "DICE_ACCOUNTING", "DEFAULT_DICE_ACCOUNTING", "delta_warning", "dice", "gaussian"]


@dataclass(frozen=True)
class AccountingSpec:
    """How an algorithm's releases are accounted.

    kind ``gaussian``: Poisson-subsampled Gaussian with multiplier z relative to ``sensitivity`` (the
    per-example L2 bound of the summed rows; ``note`` says in words why it holds);
    kind ``dice``: DiceSGD error feedback (``dice`` holds C1, C2, B, G_max; steps filled in by
    ``account``), accounted by one of ``DICE_ACCOUNTING`` (default ``sound``);
    kind ``none``: non-private, epsilon = inf.
    ``heuristic`` marks specs whose guarantee is not proven (labelled in every output).
    ``bands`` = b > 1 (kind ``gaussian`` only): cyclic Poisson participation (classes mod b) with b-banded noise
    (``clipbias.algorithms.bands``), accounted as the subsampled Gaussian at rate b q for ceil(T / b)
    steps (docs/privacy.md, "Banded noise").
    ``blt`` = (c_0, omegas..., thetas...) (kind ``gaussian``, ``bands`` = k classes): BLT noise
    (``clipbias.algorithms.blt``), accounted as one Gaussian mechanism at multiplier z / Delta(T), Delta the
    strategy's sensitivity over T steps in k classes, with no amplification (docs/privacy.md, "BLT noise").
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

    def blt_sensitivity(self, steps: int) -> float:
        """BLT noise: Delta(steps) in units of the per-example sensitivity (1.0 without BLT noise)."""
        if not self.blt:
            return 1.0
        from .toeplitz import blt_sensitivity
        d = (len(self.blt) - 1) // 2
        return blt_sensitivity(self.blt[0], self.blt[1:1 + d], self.blt[1 + d:], self.bands, steps)

    def multiplier(self, steps: int) -> float:
        """The noise multiplier the accountant sees after ``steps`` steps: z, or with BLT noise z / Delta."""
        return self.noise_multiplier / self.blt_sensitivity(steps)

    def rate_and_steps(self, steps: int) -> tuple[float, int]:
        """(sampling rate, number of compositions) of the subsampled Gaussian that ``steps`` steps
        amount to: (q, T), or with b bands (b q, ceil(T / b)): each example can join one step in b,
        and the b rows its contribution reaches are one Gaussian release (docs/privacy.md)."""
        if self.blt:
            return 1.0, 1  # no amplification: the whole run is one Gaussian mechanism
        if self.bands == 1:
            return self.sample_rate, steps
        from ..sampling.poisson import band_rate  # the sampler's own float
        return band_rate(self.bands, self.sample_rate), -(-steps // self.bands)

    def dp_event(self, steps: int, dice_accounting: str = DEFAULT_DICE_ACCOUNTING) -> dp_event.DpEvent:
        """The dp-accounting event of T steps.

        DiceSGD: the sound bound's mixture-of-Gaussians event (units of C1/B); the other bases are
        algorithm-specific formulas with no event (``UnsupportedDpEvent``).
        """
        if self.kind == "none" or self.noise_multiplier == 0:
            return dp_event.NonPrivateDpEvent()
        if self.kind == "gaussian":
            q, t = self.rate_and_steps(steps)
            return gaussian.SampledGaussian(self.multiplier(steps), q).event(t)
        if self.kind == "dice" and dice.check_basis(dice_accounting) == "sound":
            return dice.sound_event(replace(self.dice, steps=steps), self.noise_multiplier)
        return dp_event.UnsupportedDpEvent()

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("dice")
        if self.dice is not None:
            d["dice"] = {k: v for k, v in asdict(self.dice).items() if k != "steps"}
        return d


def account(spec: AccountingSpec, steps: int, delta: float, accountant: str = "pld",
            dice_accounting: str = DEFAULT_DICE_ACCOUNTING) -> PrivacyReport:
    """The (epsilon, delta) statement after ``steps`` steps.

    Args:
        spec: How the algorithm's releases are accounted (``Algorithm.spec``, ``DPEngine.spec``).
        steps: The steps taken (0: epsilon 0).
        delta: Delta, in (0, 1).
        accountant: A registered accountant: ``"pld"`` (default) or ``"rdp"``.
        dice_accounting: The basis of DiceSGD's error feedback (kind ``dice``): ``"sound"`` (default),
            ``"conservative"``, ``"paper"`` or ``"authors"``.

    Returns:
        The ``PrivacyReport``; for a non-private spec (kind ``none`` or no noise) epsilon ``math.inf``,
            uncertified.

    Raises:
        ConfigError: an invalid ``delta``, ``accountant``, ``steps``, sampling rate, noise multiplier or
            ``dice_accounting``, or an unknown kind.
        PrivacyAccountingError: ``dice_accounting="paper"`` for an algorithm the paper's bound does not
            claim.
    """
    check_delta(delta)
    check_accountant(accountant)
    if spec.kind == "none" or spec.noise_multiplier == 0:
        return PrivacyReport(math.inf, delta, "none", "non-private (no noise): no DP guarantee", False,
                             spec.noise_multiplier)
    if steps == 0:
        return PrivacyReport(0.0, delta, accountant, "no step taken", True, spec.noise_multiplier)
    if spec.kind == "gaussian":  # validated here, once: gaussian.report takes them as they are
        check_steps(steps)
        q, t = spec.rate_and_steps(steps)
        check_rate(q)
        gaussian.check_noise(spec.noise_multiplier)
        check_steps(t)
        if spec.blt:
            sens = spec.blt_sensitivity(steps)
            rep = gaussian.report(spec.multiplier(steps), q, t, delta, accountant)
            how = ("exact: mu-GDP with mu = Delta / z (Balle & Wang 2018; Dong, Roth & Su 2019)" if accountant == "pld"
                   else rep.basis)
            basis = (f"the {steps} steps as one Gaussian mechanism at noise multiplier z / Delta = "
                     f"{spec.multiplier(steps):.6g} (Delta({steps}) = {sens:.6g}), {how}; {spec.note}")
            return replace(rep, noise_multiplier=spec.noise_multiplier, basis=basis)
        return gaussian.report(spec.noise_multiplier, q, t, delta, accountant, spec.note)
    if spec.kind == "dice":
        _check_dice_method(spec, dice_accounting)
        return dice.report(replace(spec.dice, steps=steps), spec.noise_multiplier, delta,
                           dice_accounting, accountant)
    raise ConfigError(f"unknown accounting kind {spec.kind!r}")


def calibrate(spec: AccountingSpec, epsilon: float, delta: float, steps: int, accountant: str = "pld",
              dice_accounting: str = DEFAULT_DICE_ACCOUNTING) -> float:
    """The noise multiplier for ``spec`` reaching at most ``epsilon`` after ``steps`` steps, never above.

    Cached on disk by every input, and re-checked against ``epsilon`` when read back (``privacy.cache``); a
    calibration that runs longer than a second says so on stderr.

    Args:
        spec: How the algorithm's releases are accounted (its ``noise_multiplier`` is ignored).
        epsilon: The target epsilon (positive, finite).
        delta: Delta, in (0, 1).
        steps: The planned steps (>= 1).
        accountant: A registered accountant: ``"pld"`` (default) or ``"rdp"``.
        dice_accounting: The basis of DiceSGD's error feedback (kind ``dice``): ``"sound"`` (default),
            ``"conservative"``, ``"paper"`` or ``"authors"``.

    Returns:
        The noise multiplier z: ``account`` with it gives at most ``epsilon``.

    Raises:
        ConfigError: invalid inputs; a non-private spec (no noise to calibrate); banded noise on a kind other
            than ``gaussian``.
        PrivacyAccountingError: ``dice_accounting="paper"`` for an algorithm the paper's bound does not
            claim.
    """
    check_epsilon(epsilon)
    check_delta(delta)
    check_steps(steps)
    if spec.kind not in ("gaussian", "dice"):
        raise ConfigError("a non-private algorithm has no noise to calibrate; pick a private `algorithm`")
    if spec.kind == "dice":
        _check_dice_method(spec, dice_accounting)
    if spec.bands != 1 and spec.kind != "gaussian":
        raise ConfigError(f"banded noise is accounted for the subsampled Gaussian only, not {spec.kind!r}")
    key = {"kind": spec.kind, "q": spec.sample_rate, "bands": spec.bands, **({"blt": spec.blt} if spec.blt else {}),
           "dice": None if spec.dice is None else asdict(spec.dice), "epsilon": epsilon, "delta": delta,
           "steps": steps, "accountant": accountant,
           "basis": dice_accounting if spec.kind == "dice" else None}

    def verify(z: float) -> bool:
        try:
            return account(replace(spec, noise_multiplier=z), steps, delta, accountant,
                           dice_accounting).epsilon <= epsilon
        except ClipbiasError:  # e.g. the paper's bound outside its conditions: recompute
            return False
    what = f"epsilon {epsilon:g} (delta {delta:g}, {steps} steps at q = {spec.sample_rate:.4g}, {accountant})"
    with _progress(what):
        return cache.cached(key, lambda: _calibrate(spec, epsilon, delta, steps, accountant, dice_accounting),
                            verify)


PROGRESS_AFTER_S = 1.0  # a calibration still running after this long says so on stderr


@contextlib.contextmanager
def _progress(what: str):
    """One line on stderr when the calibration inside takes longer than ``PROGRESS_AFTER_S``, and one
    with its time when it ends; nothing for a quick one (a cached value, a cheap accountant)."""
    lock, state, t0 = threading.Lock(), {"done": False, "said": False}, time.monotonic()

    def say() -> None:
        with lock:
            if not state["done"]:
                print(f"clipbias: calibrating the noise multiplier to {what} ...", file=sys.stderr, flush=True)
                state["said"] = True
    timer = threading.Timer(PROGRESS_AFTER_S, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            state["done"] = True
        timer.cancel()
        if state["said"]:
            print(f"clipbias: calibrated in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)


def _calibrate(spec: AccountingSpec, epsilon: float, delta: float, steps: int, accountant: str,
               dice_accounting: str) -> float:
    if spec.kind == "gaussian":  # epsilon, delta and steps were validated by calibrate
        q, t = spec.rate_and_steps(steps)
        z = gaussian._calibrate(epsilon, delta, check_rate(q), check_steps(t), check_accountant(accountant))
        if not spec.blt:
            return z
        sens = spec.blt_sensitivity(steps)
        scaled = z * sens
        while scaled / sens < z:  # never below the Gaussian mechanism's multiplier after the division
            scaled = math.nextafter(scaled, math.inf)
        return scaled
    if spec.kind == "dice":
        _check_dice_method(spec, dice_accounting)
        return dice.calibrate(epsilon, delta, replace(spec.dice, steps=steps), dice_accounting, accountant)
    raise ConfigError("a non-private algorithm has no noise to calibrate; pick a private `algorithm`")


def _check_dice_method(spec: AccountingSpec, method: str) -> None:
    dice.check_basis(method)
    if method == "paper" and not spec.certifiable:
        from ..errors import PrivacyAccountingError
        raise PrivacyAccountingError(f"the paper's DiceSGD bound does not even claim this algorithm: "
                                     f"{spec.why_not_certifiable}. Use `dice_accounting='sound'` (the default).")
