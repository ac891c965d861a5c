"""Poisson-subsampled Gaussian mechanism composed T times, by any registered accountant.

This is the accounting of DPSGD-GC and of every method whose released update is
``sum of per-example vectors of norm <= S`` plus ``N(0, (z S)^2 I)`` on a Poisson sample with
rate q: the noise multiplier z is noise std divided by the add/remove-one L2 sensitivity S.
``epsilon``, ``report`` and ``calibrate`` validate their inputs and ask the accountant registered
under the given name (``accountants.ACCOUNTANTS``: ``pld``, the default and tightest numerically
certified one, and ``rdp``, the classic alternative).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

from ..errors import ConfigError
from . import search
from .accountants import ACCOUNTANTS, NoiseTooSmallError, SampledGaussian, get
from .report import PrivacyReport, check_delta, check_epsilon, check_rate, check_steps

__all__ = ["NoiseTooSmallError", "SampledGaussian", "calibrate", "epsilon", "floor_note", "report",
           "smallest_noise"]


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
            accountant: str = "pld") -> float:
    """Epsilon of T steps of the Poisson-subsampled Gaussian; inf when z = 0."""
    get(accountant)
    check_rate(sample_rate)
    check_delta(delta)
    check_noise(noise_multiplier)
    if steps != 0:
        check_steps(steps)
    return _epsilon(noise_multiplier, sample_rate, steps, delta, accountant)


def check_noise(noise_multiplier: float) -> float:
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ConfigError(f"`noise_multiplier` must be a finite number >= 0, got {noise_multiplier!r}")
    return noise_multiplier


def _epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str) -> float:
    """``epsilon`` for inputs already validated (``epsilon``, ``calibrate``, ``privacy.account``)."""
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return get(accountant).epsilon(noise_multiplier, sample_rate, steps, delta)


def report(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
           accountant: str = "pld", sensitivity_note: str = "") -> PrivacyReport:
    """The statement after ``steps`` steps, for inputs ``privacy.account`` has validated."""
    eps = _epsilon(noise_multiplier, sample_rate, steps, delta, accountant)
    basis = get(accountant).basis_for(sample_rate) if noise_multiplier > 0 else \
        "non-private (no noise): no DP guarantee"
    if sensitivity_note:
        basis = f"{basis}; {sensitivity_note}"
    return PrivacyReport(epsilon=eps, delta=delta, accountant=accountant if noise_multiplier > 0 else "none",
                         basis=basis, certified=noise_multiplier > 0, noise_multiplier=noise_multiplier)


def calibrate(target_epsilon: float, delta: float, sample_rate: float, steps: int,
              accountant: str = "pld") -> float:
    """Smallest noise multiplier (to 0.1% relative tolerance) whose epsilon is <= the target.

    ``search.calibrate_levels``: the accountant's cheaper stand-ins (``Accountant.aims``; for the PLD:
    RDP, milliseconds per evaluation, and then the PLD on a 10x coarser grid) bring a secant near the
    answer; the accountant itself (``epsilon``, what every report uses) then evaluates the answer and
    a z 0.1% below it that fails, typically two evaluations. Never overshoots: the returned z was
    evaluated by that accountant at <= target, never below its floor. A pure function of its
    arguments, cached in-process (the seeds of a comparison share one calibration).
    """
    check_epsilon(target_epsilon)
    check_delta(delta)
    check_rate(sample_rate)
    check_steps(steps)
    get(accountant)
    return _calibrate(target_epsilon, delta, sample_rate, steps, accountant)


@functools.lru_cache(maxsize=256)
def _calibrate(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """``calibrate`` for inputs already validated, cached in-process."""
    acc, q = get(accountant), sample_rate

    def guarded(fn: Callable[[float], float]) -> Callable[[float], float]:
        def eps(z: float) -> float:
            try:
                return fn(z)
            except ConfigError:  # below the floor, or a grid too large: certainly too little noise
                return math.inf
        return eps

    final = guarded(lambda z: _epsilon(z, q, steps, delta, accountant))
    levels = [(guarded(fn), tol) for fn, tol in acc.aims(q, steps, delta)] or [(final, 1e-2)]
    z = search.calibrate_levels(target_epsilon, levels, final, floor=acc.floor, ceiling=1e6)
    if math.isinf(z):
        raise ConfigError(f"`epsilon={target_epsilon:g}` is unreachable with q={sample_rate:g}, "
                          f"T={steps}, delta={delta:g} (noise multiplier would exceed 1e6)")
    return z


def floor_note(target: float | None, achieved: float, z: float, accountant: str) -> str | None:
    """Why a calibrated epsilon sits far below its target (under half of it), said on the spot: the
    noise multiplier is at the accountant's floor (``Accountant.floor``), so less noise, and with it
    an epsilon nearer the target, is not certified here."""
    if target is None or not math.isfinite(achieved) or achieved >= 0.5 * target:
        return None
    acc, free = get(accountant), [name for name, a in ACCOUNTANTS.items() if not a.floor]
    if acc.floor and z <= acc.floor * 1.01:
        why = (f"the noise multiplier is at the {acc.name.upper()} accountant's floor ({acc.floor:g}; "
               f"{acc.floor_reason})")
    else:
        why = f"no smaller noise multiplier than {z:g} was found to meet it"
    return (f"note: epsilon {achieved:.4g} is far below the target {target:g}: {why}. The target does not bind; "
            f"ask for `epsilon={achieved:.4g}` (the same noise), or take more steps or a larger batch to use the "
            f"budget" + (f", or `accountant='{free[0]}'` (no floor)" if acc.floor and free else ""))


calibrate.cache_clear = _calibrate.cache_clear  # type: ignore[attr-defined]
smallest_noise = search.smallest_noise  # the plain bisection (a reference for the secant searches)
