"""Privacy accounting: what every algorithm's guarantee rests on.

``AccountingSpec`` is the description an algorithm produces (mechanism, rate, noise multiplier,
sensitivity); ``account`` turns it into a ``PrivacyReport`` after T steps, and ``calibrate`` finds
the noise multiplier for a target epsilon without overshooting.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys
import threading
import time
from dataclasses import asdict, replace

from ..errors import ClipbiasError
from . import cache, dice, gaussian

# the accountants: each module registers itself (``accountants.ACCOUNTANTS``). The modules are discovered
# (``_modules``): ``_FIRST`` in its order (the registry's), then every other module of the package by name (a
# new accountant needs no line here). ``_LAZY`` register nothing and are imported by their users when needed
# (banded noise's sensitivities, the tuning's accounting), not by the package.
_FIRST = ("pld", "rdp")
_LAZY = ("toeplitz", "tuning")


def _modules(found: list[str]) -> list[str]:
    """The order in which the package imports its modules ``found`` (their names)."""
    rest = sorted(set(found) - set(_FIRST) - set(_LAZY))
    return [*_FIRST, *(n for n in rest if not n.startswith("_"))]


def _load() -> None:
    for name in _modules([m.name for m in pkgutil.iter_modules(__path__)]):
        importlib.import_module(f"{__name__}.{name}")


_load()
from .dice import DEFAULT_DICE_ACCOUNTING, DICE_ACCOUNTING, DiceBasis, DiceParams  # noqa: E402
from .accountants import ACCOUNTANTS  # noqa: E402
from .mechanisms import (MECHANISMS, AccountingSpec, Banded, BLTStrategy, Cyclic, ErrorFeedback,  # noqa: E402
                         Independent, Mechanism, NonPrivate, Poisson, SubsampledGaussian, mechanism)
from .report import (PrivacyReport, check_accountant, check_delta, check_epsilon, check_rate,  # noqa: E402, F401
                     check_steps, delta_warning)

__all__ = ["AccountingSpec", "PrivacyReport", "DiceParams", "DiceBasis", "account", "calibrate", "ACCOUNTANTS",
           "DICE_ACCOUNTING", "DEFAULT_DICE_ACCOUNTING", "delta_warning", "dice", "gaussian", "MECHANISMS",
           "Mechanism", "SubsampledGaussian", "ErrorFeedback", "NonPrivate", "mechanism", "Poisson", "Cyclic",
           "Independent", "Banded", "BLTStrategy"]


def account(spec: AccountingSpec, steps: int, delta: float, accountant: str = "pld",
            dice_accounting: str | DiceBasis = DEFAULT_DICE_ACCOUNTING) -> PrivacyReport:
    """The (epsilon, delta) statement after ``steps`` steps.

    Args:
        spec: How the algorithm's releases are accounted (``Algorithm.spec``, ``DPEngine.spec``).
        steps: The steps taken (0: epsilon 0).
        delta: Delta, in (0, 1).
        accountant: A registered accountant: ``"pld"`` (default) or ``"rdp"``.
        dice_accounting: The basis of DiceSGD's error feedback (kind ``dice``): ``"sound"`` (default),
            ``"conservative"``, ``"paper"`` or ``"authors"`` (or the ``DiceBasis`` itself, ``dice.BASES``).

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
    return _report(spec.accounted_as(dice_accounting), spec, steps, delta, accountant)


def _report(mechanism: Mechanism, spec: AccountingSpec, steps: int, delta: float, accountant: str) -> PrivacyReport:
    if steps == 0 and mechanism.private:
        return PrivacyReport(0.0, delta, accountant, "no step taken", True, spec.noise_multiplier)
    return mechanism.report(spec, steps, delta, accountant)


def calibrate(spec: AccountingSpec, epsilon: float, delta: float, steps: int, accountant: str = "pld",
              dice_accounting: str | DiceBasis = DEFAULT_DICE_ACCOUNTING) -> float:
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
            ``"conservative"``, ``"paper"`` or ``"authors"`` (or the ``DiceBasis`` itself, ``dice.BASES``).

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
    mechanism = spec.mechanism.with_basis(dice_accounting)
    mechanism.check_calibration(spec)
    key = {"kind": spec.kind, "q": spec.sample_rate, "bands": spec.bands, **({"blt": spec.blt} if spec.blt else {}),
           "dice": None if spec.dice is None else asdict(spec.dice), "epsilon": epsilon, "delta": delta,
           "steps": steps, "accountant": accountant, "basis": mechanism.basis_name}

    def verify(z: float) -> bool:
        try:
            return _report(mechanism, replace(spec, noise_multiplier=z), steps, delta, accountant).epsilon <= epsilon
        except ClipbiasError:  # e.g. the paper's bound outside its conditions: recompute
            return False
    what = f"epsilon {epsilon:g} (delta {delta:g}, {steps} steps at q = {spec.sample_rate:.4g}, {accountant})"
    with _progress(what):
        return cache.cached(key, lambda: _calibrate(spec, epsilon, delta, steps, accountant, mechanism), verify)


def _calibrate(spec: AccountingSpec, epsilon: float, delta: float, steps: int, accountant: str,
               mechanism: Mechanism) -> float:
    """The calibration itself, by ``mechanism`` (``calibrate`` checked every input and reads the cache first)."""
    return mechanism.calibrate(spec, epsilon, delta, steps, accountant)


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
