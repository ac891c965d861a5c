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
            one = one_step_pld("gaussian", float(noise_multiplier), (1.0,), (float(sample_rate),), PLD_DISCRETIZATION)
            return float(one.self_compose(steps).get_epsilon_for_delta(delta))
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
    if kind == "gaussian":
        return PLD.from_gaussian_mechanism(standard_deviation=z, value_discretization_interval=discretization,
                                           sampling_prob=probs[0])
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


@functools.lru_cache(maxsize=256)
def calibrate(target_epsilon: float, delta: float, sample_rate: float, steps: int,
              accountant: str = "pld") -> float:
    """Smallest noise multiplier (to 0.1% relative tolerance) whose epsilon is <= the target.

    Never overshoots: the returned z is re-checked and raised until epsilon(z) <= target. A pure
    function of its arguments, cached in-process (the seeds of a comparison share one calibration).
    """
    check_epsilon(target_epsilon)
    check_delta(delta)
    check_rate(sample_rate)
    check_steps(steps)

    def eps_of(z: float) -> float:
        try:
            return epsilon(z, sample_rate, steps, delta, accountant)
        except NoiseTooSmallError:  # below the PLD floor: epsilon is huge, certainly above the target
            return math.inf

    if accountant == "pld" and eps_of(PLD_MIN_NOISE) <= target_epsilon:
        return PLD_MIN_NOISE  # the floor already meets the target (a bisection there costs minutes)
    lo, hi = 0.0, 1.0
    while eps_of(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ConfigError(f"--epsilon {target_epsilon:g} is unreachable with q={sample_rate:g}, "
                              f"T={steps}, delta={delta:g} (noise multiplier would exceed 1e6)")
    return smallest_noise(lambda z: eps_of(z) <= target_epsilon, lo, hi)


def smallest_noise(ok: Callable[[float], bool], lo: float, hi: float, rel_tol: float = 1e-3) -> float:
    """The smallest z in (lo, hi] with ``ok(z)`` (a monotone predicate: more noise is never worse),
    to ``rel_tol`` relative tolerance. Returns the upper end of the bracket, so the answer always
    satisfies ``ok``: a calibration never overshoots its epsilon. When ``ok(hi)`` fails (a
    discretised bound can sit a hair above its analytic bracket) the bracket first moves up 1% at a
    time. The one bisection of every calibrator (Gaussian and DiceSGD)."""
    while not ok(hi):
        lo, hi = hi, hi * 1.01
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi
