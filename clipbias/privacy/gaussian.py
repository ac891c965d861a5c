"""Poisson-subsampled Gaussian mechanism composed T times, via Google's ``dp-accounting``.

This is the accounting of DPSGD-GC and of every method whose released update is
``sum of per-example vectors of norm <= S`` plus ``N(0, (z S)^2 I)`` on a Poisson sample with
rate q: the noise multiplier z is noise std divided by the add/remove-one L2 sensitivity S.
PLD (default) is the tightest numerically certified accountant; RDP is the classic alternative.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import dp_accounting
from absl import logging as absl_logging
from dp_accounting import dp_event, pld, rdp

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm

from ..errors import ConfigError
from . import fast_pld, search
from .report import (PrivacyReport, check_accountant, check_delta, check_epsilon, check_rate,
                     check_steps)

# dp-accounting's RDP accountant logs one warning per Renyi order it excludes (the epsilon stays a valid
# upper bound without them): dozens of lines per call that users read as errors.
absl_logging.set_verbosity(absl_logging.ERROR)

BASIS = {
    "pld": "Poisson-subsampled Gaussian, T-fold composition, privacy loss distribution "
           "(dp-accounting PLDAccountant; Koskela et al. 2020, Doroshenko et al. 2022)",
    "exact": "full-batch Gaussian, T-fold composition, exact: mu-GDP with mu = sqrt(T)/z "
             "(Balle & Wang 2018; Dong, Roth & Su 2019)",
    "rdp": "Poisson-subsampled Gaussian, T-fold composition, Renyi DP (dp-accounting RdpAccountant; "
           "Mironov et al. 2019) with the Canonne-Kamath-Steinke 2020 conversion",
}


@dataclass(frozen=True)
class SampledGaussian:
    """One step: Gaussian noise with multiplier z on a Poisson sample of rate q (q = 1: full batch)."""

    noise_multiplier: float
    sample_rate: float

    def event(self, steps: int = 1) -> dp_event.DpEvent:
        if self.noise_multiplier == 0:
            return dp_event.NonPrivateDpEvent()
        step: dp_event.DpEvent = dp_event.GaussianDpEvent(self.noise_multiplier)
        if self.sample_rate < 1:
            step = dp_event.PoissonSampledDpEvent(self.sample_rate, step)
        return dp_event.SelfComposedDpEvent(step, steps) if steps != 1 else step


def make_accountant(name: str) -> dp_accounting.PrivacyAccountant:
    check_accountant(name)
    if name == "pld":
        return pld.PLDAccountant()
    return rdp.RdpAccountant()


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
            accountant: str = "pld") -> float:
    """Epsilon of T steps of the Poisson-subsampled Gaussian; inf when z = 0."""
    check_rate(sample_rate)
    check_delta(delta)
    if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
        raise ConfigError(f"--noise-multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if steps == 0:
        return 0.0
    check_steps(steps)
    if noise_multiplier == 0:
        return math.inf
    if sample_rate == 1 and accountant == "pld":
        return gaussian_exact_epsilon(noise_multiplier, steps, delta)
    if accountant == "pld":
        check_pld_noise(noise_multiplier)
    try:
        if accountant == "pld":
            return pld_epsilon(float(noise_multiplier), float(sample_rate), steps, delta, PLD_DISCRETIZATION)
        acc = make_accountant(accountant)
        acc.compose(SampledGaussian(noise_multiplier, sample_rate).event(steps))
        return float(acc.get_epsilon(delta))
    except MemoryError as e:  # the PLD grid of an extreme (z, q) pair does not fit in memory
        raise ConfigError(
            f"the {accountant} accountant cannot represent noise multiplier {noise_multiplier:g} at sample "
            f"rate {sample_rate:g} ({steps} steps): its privacy-loss grid does not fit in memory. Use a larger "
            f"--noise-multiplier (this one gives no meaningful epsilon) or --accountant rdp") from e
    except ValueError as e:  # dp-accounting: "Maximum allowed size exceeded" for an extreme grid
        raise ConfigError(f"the {accountant} accountant cannot represent noise multiplier {noise_multiplier:g} at "
                          f"sample rate {sample_rate:g} ({steps} steps): {e}. Use a larger --noise-multiplier "
                          f"or --accountant rdp") from e


PLD_MIN_NOISE = 0.1
PLD_DISCRETIZATION = 1e-4  # dp-accounting's PLDAccountant default


@functools.lru_cache(maxsize=4)
def one_step_pld(kind: str, z: float, shifts: tuple, probs: tuple, discretization: float):
    """The privacy loss distribution of one step, kept per process: building it is most of an
    accountant call (0.57 s of 0.65 s for q = 256/60000, z = 1), composing it T times is not, so
    per-epoch progress reports and repeated queries at the same noise cost 0.03-0.2 s each. ``kind``
    gaussian: the Poisson-subsampled Gaussian (``probs = (q,)``); mixture: dp-accounting's mixture of
    Gaussians (both adjacency directions), as ``PLDAccountant`` builds them; its T-fold
    ``self_compose`` equals the accountant's epsilon to ~1e-13 relative (test)."""
    PLD = pld.privacy_loss_distribution
    if kind == "gaussian":  # dp-accounting's from_gaussian_mechanism, vectorised (bit-identical, 8x faster)
        return fast_pld.gaussian_pld(z, probs[0], discretization)
    return PLD.from_mixture_gaussian_mechanism(standard_deviation=z, sensitivities=list(shifts),
                                               sampling_probs=list(probs),
                                               value_discretization_interval=discretization)


def check_pld_noise(noise_multiplier: float) -> None:
    """Refuse noise multipliers below 0.1 for the PLD accountant: their epsilon is in the tens or more
    (no meaningful privacy) and the privacy-loss grid grows until it takes minutes or fails."""
    if noise_multiplier < PLD_MIN_NOISE:
        raise NoiseTooSmallError(
            f"noise multiplier {noise_multiplier:g} < {PLD_MIN_NOISE:g}: one inclusion shifts the update by over 10 "
            f"noise standard deviations, so epsilon is in the tens or more, and the PLD accountant's grid "
            f"explodes (minutes, or out of memory). "
            f"Use a larger --noise-multiplier, or --accountant rdp to get a number anyway")


class NoiseTooSmallError(ConfigError):
    """A noise multiplier too small for any meaningful guarantee (and for the PLD accountant)."""


def gaussian_exact_epsilon(noise_multiplier: float, steps: int, delta: float) -> float:
    """Exact epsilon of T composed Gaussians (no sampling): a mu-GDP mechanism, mu = sqrt(T)/z.

    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), solved for eps (log-space).
    """
    mu = math.sqrt(steps) / noise_multiplier

    def excess(e: float) -> float:
        with np.errstate(over="ignore"):  # e^eps Phi(.) -> inf only where the excess is -inf anyway
            return float(norm.cdf(-e / mu + mu / 2) - np.exp(e + norm.logcdf(-e / mu - mu / 2)) - delta)

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
    return float(brentq(excess, 0.0, hi, xtol=1e-12, rtol=1e-12))


def report(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
           accountant: str = "pld", sensitivity_note: str = "") -> PrivacyReport:
    eps = epsilon(noise_multiplier, sample_rate, steps, delta, accountant)
    key = "exact" if sample_rate == 1 and accountant == "pld" else accountant
    basis = BASIS[key] if noise_multiplier > 0 else "non-private (no noise): no DP guarantee"
    if sensitivity_note:
        basis = f"{basis}; {sensitivity_note}"
    return PrivacyReport(epsilon=eps, delta=delta, accountant=accountant if noise_multiplier > 0 else "none",
                         basis=basis, certified=noise_multiplier > 0, noise_multiplier=noise_multiplier)


def pld_epsilon(z: float, q: float, steps: int, delta: float, discretization: float) -> float:
    """PLD epsilon of T steps at a given grid: the one-step PLD is kept per process at the accountant's
    grid (``one_step_pld``), built afresh at the calibration's coarser grids."""
    if discretization == PLD_DISCRETIZATION:
        one = one_step_pld("gaussian", z, (1.0,), (q,), discretization)
    else:
        one = fast_pld.gaussian_pld(z, q, discretization)
    return float(one.self_compose(steps).get_epsilon_for_delta(delta))


PLD_COARSE = 1e-3  # the grid of the calibration's search; its epsilon is within ~0.1% of the final grid's


@functools.lru_cache(maxsize=256)
def calibrate(target_epsilon: float, delta: float, sample_rate: float, steps: int,
              accountant: str = "pld") -> float:
    """Smallest noise multiplier (to 0.1% relative tolerance) whose epsilon is <= the target.

    ``search.calibrate_levels``: RDP (milliseconds per evaluation) and then PLD on a 10x coarser grid
    bring a secant near the answer; the accountant itself (``epsilon``, what every report uses) then
    evaluates the answer and a z 0.1% below it that fails, typically two evaluations. Never overshoots:
    the returned z was evaluated by that accountant at <= target. A pure function of its arguments,
    cached in-process (the seeds of a comparison share one calibration).
    """
    check_epsilon(target_epsilon)
    check_delta(delta)
    check_rate(sample_rate)
    check_steps(steps)
    q, pld_floor = sample_rate, (PLD_MIN_NOISE if accountant == "pld" else 0.0)

    def guarded(fn: Callable[[float], float]) -> Callable[[float], float]:
        def eps(z: float) -> float:
            try:
                return fn(z)
            except ConfigError:  # below the PLD floor, or a grid too large: certainly too little noise
                return math.inf
        return eps

    final = guarded(lambda z: epsilon(z, q, steps, delta, accountant))
    if accountant == "rdp" or q == 1:  # one accountant, milliseconds per evaluation
        levels = [(final, 1e-2)]
    else:
        levels = [(guarded(lambda z: epsilon(z, q, steps, delta, "rdp")), 1e-2),
                  (guarded(lambda z: pld_epsilon(z, q, steps, delta, PLD_COARSE)), search.REL_TOL / 4)]
    z = search.calibrate_levels(target_epsilon, levels, final, floor=pld_floor, ceiling=1e6)
    if math.isinf(z):
        raise ConfigError(f"--epsilon {target_epsilon:g} is unreachable with q={sample_rate:g}, "
                          f"T={steps}, delta={delta:g} (noise multiplier would exceed 1e6)")
    return z


def floor_note(target: float | None, achieved: float, z: float, accountant: str) -> str | None:
    """Why a calibrated epsilon sits far below its target (under half of it), said on the spot: the
    noise multiplier is at the PLD accountant's floor (``PLD_MIN_NOISE``), so less noise,
    and with it an epsilon nearer the target, is not certified here."""
    if target is None or not math.isfinite(achieved) or achieved >= 0.5 * target:
        return None
    if accountant == "pld" and z <= PLD_MIN_NOISE * 1.01:
        why = (f"the noise multiplier is at the PLD accountant's floor ({PLD_MIN_NOISE:g}; below it the "
               f"privacy-loss grid is unmanageable and epsilon meaningless)")
    else:
        why = f"no smaller noise multiplier than {z:g} was found to meet it"
    return (f"note: epsilon {achieved:.4g} is far below the target {target:g}: {why}. The target does not bind; "
            f"ask for --epsilon {achieved:.4g} (the same noise), or take more steps or a larger batch to use the "
            f"budget" + (", or --accountant rdp (no floor)" if accountant == "pld" else ""))


smallest_noise = search.smallest_noise  # the plain bisection (a reference for the secant searches)
