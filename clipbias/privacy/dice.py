"""Privacy accounting for DiceSGD (Zhang, Bu, Wu, Hong), three bases. See docs/privacy.md.

Units (resolved explicitly; the paper mixes them): C1 clips each per-example gradient; C2 clips the
feedback buffer e, which lives on the scale of the *average* gradient (v = (1/B) sum clip(g_i, C1)
+ clip(e, C2)). Expressed in per-example units the feedback bound is ``Cbar2 = B * C2``, and with an
explicit outer clip G_max on every per-example gradient ``Cbar2 = min(B C2, G')``, G' = G_max - C1.
The noise added to v is ``N(0, sigma1^2 I)`` with ``sigma1 = z * C1 / B``: z is the multiplier
relative to one example's clipped contribution, exactly as in DPSGD-GC.

* ``certified``: the paper's own proof (Thm 3.8, App. A.2 eq. (25) and the sum after it):
  per-step RDP ``16 q^2 alpha (C1^2 + 2 Cbar2^2) / (B^2 sigma1^2) = 16 alpha q^2 (1 + 2 (Cbar2/C1)^2)
  / z^2``, valid only where Lemma A.11 (Mironov, Talwar, Zhang 2019, Thm 11) applies: q <= 1/5, noise
  >= 4 times the sensitivity 2 C1 / B the proof uses (i.e. z >= 8), and alpha in the lemma's range.
  Converted to (epsilon, delta) with the Canonne-Kamath-Steinke conversion, alpha optimised inside
  the valid range.
* ``conservative``: a bound we prove without the paper's subsampling step (docs/privacy.md, "A bound
  without amplification"): couple the sampling, use joint quasi-convexity of Renyi divergence over
  the sampling pattern, and compose T adaptive Gaussians whose means differ by at most
  ``C1/B + 2 C2`` -> per-step RDP ``alpha (1 + 2 r)^2 / (2 z^2)`` with ``r = B C2 / C1``.
* ``authors``: the protocol used to reproduce the paper's experiments, NOT a proof:
  ``z_dice = z_DPSGD(eps, delta, q, T) * sqrt(1 + 2 r)``. Always ``certified = False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, PrivacyAccountingError
from . import gaussian
from .report import (PrivacyReport, check_delta, check_epsilon, check_positive, check_rate,
                     check_steps)

DICE_ACCOUNTING = ("certified", "conservative", "authors")
_ALPHAS = 1.0 + np.geomspace(1e-3, 1e4, 6000)


@dataclass(frozen=True)
class DiceParams:
    """The quantities DiceSGD's accounting depends on (units: see the module docstring)."""

    sample_rate: float
    steps: int
    clip: float                  # C1
    ef_clip: float               # C2, on the average-gradient scale
    batch_size: float            # B = q N, the expected batch size
    grad_bound: float | None = None  # G_max: explicit outer clip of every per-example gradient

    def __post_init__(self) -> None:
        check_rate(self.sample_rate)
        check_steps(self.steps)
        check_positive(self.clip, "--clip")
        check_positive(self.ef_clip, "--ef-clip")
        check_positive(self.batch_size, "--batch-size")
        if self.grad_bound is not None:
            check_positive(self.grad_bound, "--grad-bound")

    @property
    def g_prime(self) -> float | None:
        """G' = max(0, G_max - C1): bound on ||g_i - clip(g_i, C1)|| (paper: G + sigma - C1)."""
        return None if self.grad_bound is None else max(0.0, self.grad_bound - self.clip)

    @property
    def feedback_bound(self) -> float:
        """Cbar2 = min(B C2, G'): the feedback bound in per-example units."""
        cb = self.batch_size * self.ef_clip
        return cb if self.g_prime is None else min(cb, self.g_prime)

    @property
    def ratio(self) -> float:
        """r = B C2 / C1, the feedback threshold relative to C1 in per-example units."""
        return self.batch_size * self.ef_clip / self.clip


def rdp_to_dp(alpha: np.ndarray, rdp: np.ndarray, delta: float) -> np.ndarray:
    """(alpha, rdp)-RDP -> epsilon at delta (Canonne, Kamath, Steinke 2020, Prop. 12).

    Valid for every alpha > 1 and never larger than Mironov's Prop. 3 (the paper's Lemma A.6)
    ``rdp + log(1/delta) / (alpha - 1)``.
    """
    alpha = np.asarray(alpha, dtype=float)
    eps = rdp + np.log1p(-1.0 / alpha) - (math.log(delta) + np.log(alpha)) / (alpha - 1)
    return np.maximum(eps, 0.0)


def lemma_a11_valid(q: float, sigma: float, alpha: np.ndarray) -> np.ndarray:
    """Where Mironov-Talwar-Zhang 2019 Thm 11 (the paper's Lemma A.11) holds.

    Conditions: q <= 1/5, sigma >= 4 (sigma: noise std / sensitivity), 1 < alpha <=
    sigma^2 L / 2 - 2 ln sigma and alpha (L + ln(q alpha) + 1/(2 sigma^2)) <= sigma^2 L^2 / 2
    - ln 5 - 2 ln sigma, with L = ln(1 + 1/(q (alpha - 1))). Then the subsampled Gaussian is
    (alpha, 2 q^2 alpha / sigma^2)-RDP.
    """
    alpha = np.asarray(alpha, dtype=float)
    if q > 0.2 or sigma < 4:
        return np.zeros_like(alpha, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.log1p(1.0 / (q * (alpha - 1)))
        c1 = alpha <= 0.5 * sigma**2 * L - 2 * math.log(sigma)
        c2 = alpha * (L + np.log(q * alpha) + 1 / (2 * sigma**2)) <= (
            0.5 * sigma**2 * L**2 - math.log(5) - 2 * math.log(sigma))
    return (alpha > 1) & c1 & c2


def certified_rdp(p: DiceParams, z: float, alpha: np.ndarray) -> np.ndarray:
    """Eq. (25) summed over T steps: 16 alpha T q^2 (1 + 2 (Cbar2 / C1)^2) / z^2."""
    k = (p.feedback_bound / p.clip) ** 2
    return 16.0 * np.asarray(alpha) * p.steps * p.sample_rate**2 * (1 + 2 * k) / z**2


def certified_conditions(p: DiceParams, z: float) -> tuple[np.ndarray, list[str]]:
    """The alpha grid points where every Lemma A.11 application of the proof holds, and why not."""
    why: list[str] = []
    q = p.sample_rate
    if q > 0.2:
        why.append(f"sample rate q={q:g} > 1/5 (Lemma A.11 needs q <= 1/5)")
    sigma_grad = z / 2  # noise relative to the 2 C1 / B sensitivity of the gradient term
    if sigma_grad < 4:
        why.append(f"noise multiplier z={z:g} gives z/2={sigma_grad:g} < 4 relative to the proof's "
                   f"sensitivity 2 C1 / B (Lemma A.11 needs >= 4, i.e. z >= 8)")
    valid = lemma_a11_valid(q, sigma_grad, _ALPHAS)
    cb = p.feedback_bound
    if cb > 0:  # Lemma A.7 step (e): the feedback term, sensitivity 2 Cbar2 / B (the bound eq. (25) uses)
        sigma_fb = z * p.clip / (2 * cb)
        if sigma_fb < 4:
            what = "B C2" if p.g_prime is None else "min(B C2, G_max - C1)"
            why.append(f"noise relative to the feedback sensitivity 2 Cbar2/B is z C1/(2 Cbar2) = {sigma_fb:g} "
                       f"< 4 (Cbar2 = {what} = {cb:g}, r = B C2/C1 = {p.ratio:g}); Lemma A.11 needs >= 4, "
                       f"i.e. z >= 8 Cbar2/C1")
        valid &= lemma_a11_valid(q, sigma_fb, _ALPHAS)
    if not why and not valid.any():
        why.append("no Renyi order alpha satisfies Lemma A.11's range conditions")
    return valid, why


def certified_epsilon(p: DiceParams, z: float, delta: float) -> tuple[float, float]:
    """(epsilon, best alpha) under the paper's proof; raises PrivacyAccountingError outside it."""
    check_delta(delta)
    check_positive(z, "--noise-multiplier")
    valid, why = certified_conditions(p, z)
    if why:
        raise PrivacyAccountingError("cannot certify DiceSGD: " + "; ".join(why)
                                     + ". Raise the noise, lower q, or use --dice-accounting conservative.")
    alphas = _ALPHAS[valid]
    eps = rdp_to_dp(alphas, certified_rdp(p, z, alphas), delta)
    i = int(np.argmin(eps))
    return float(eps[i]), float(alphas[i])


def conservative_epsilon(p: DiceParams, z: float, delta: float) -> float:
    """Our amplification-free bound: T adaptive Gaussians, mean shift <= (1 + 2 r) C1 / B."""
    check_delta(delta)
    check_positive(z, "--noise-multiplier")
    z_eff = z / (1 + 2 * p.ratio)
    return gaussian.epsilon(z_eff, 1.0, p.steps, delta, "pld")


def authors_factor(p: DiceParams) -> float:
    """sqrt(1 + 2 r): the authors' noise inflation of DPSGD's multiplier (not a proof)."""
    return math.sqrt(1 + 2 * p.ratio)


def authors_epsilon(p: DiceParams, z: float, delta: float, accountant: str = "pld") -> float:
    return gaussian.epsilon(z / authors_factor(p), p.sample_rate, p.steps, delta, accountant)


BASIS = {
    "certified": "DiceSGD Thm 3.8 (Zhang et al.), App. A.2 eq. (25): per-step RDP 16 alpha q^2 "
                 "(1 + 2 (Cbar2/C1)^2) / z^2, Lemma A.11 conditions checked, alpha={alpha:.3g}, "
                 "Canonne-Kamath-Steinke RDP->DP conversion",
    "conservative": "DiceSGD amplification-free bound (clipbias docs/privacy.md): T adaptive "
                    "Gaussians with sensitivity (1 + 2 r) C1/B, r = B C2 / C1, PLD",
    "authors": "DiceSGD authors' protocol (heuristic, NOT a proof): z_DPSGD * sqrt(1 + 2 r), "
               "r = B C2 / C1, accounted as DPSGD with {accountant}",
}


def report(p: DiceParams, z: float, delta: float, method: str = "certified",
           accountant: str = "pld") -> PrivacyReport:
    if method not in DICE_ACCOUNTING:
        raise ConfigError(f"--dice-accounting must be one of {', '.join(DICE_ACCOUNTING)}, got {method!r}")
    if method == "certified":
        eps, alpha = certified_epsilon(p, z, delta)
        return PrivacyReport(eps, delta, "dice-certified-rdp", BASIS["certified"].format(alpha=alpha),
                             True, z)
    if method == "conservative":
        return PrivacyReport(conservative_epsilon(p, z, delta), delta, "pld", BASIS["conservative"],
                             True, z)
    return PrivacyReport(authors_epsilon(p, z, delta, accountant), delta, accountant,
                         BASIS["authors"].format(accountant=accountant), False, z)


def calibrate(target_epsilon: float, delta: float, p: DiceParams, method: str = "certified",
              accountant: str = "pld") -> float:
    """Smallest z (0.1% tolerance) whose DiceSGD epsilon under ``method`` is <= the target."""
    check_epsilon(target_epsilon)
    check_delta(delta)
    if method == "authors":
        return gaussian.calibrate(target_epsilon, delta, p.sample_rate, p.steps, accountant) * authors_factor(p)
    if method == "conservative":
        return gaussian.calibrate(target_epsilon, delta, 1.0, p.steps, "pld") * (1 + 2 * p.ratio)
    if method != "certified":
        raise ConfigError(f"--dice-accounting must be one of {', '.join(DICE_ACCOUNTING)}, got {method!r}")
    if p.sample_rate > 0.2:
        raise PrivacyAccountingError(f"cannot certify DiceSGD: sample rate q={p.sample_rate:g} > 1/5 "
                                     "(Lemma A.11). Lower the batch size or use --dice-accounting conservative.")

    def ok(z: float) -> bool:
        try:
            return certified_epsilon(p, z, delta)[0] <= target_epsilon
        except PrivacyAccountingError:
            return False

    lo, hi = 0.0, 8.0
    while not ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e8:
            raise PrivacyAccountingError(f"cannot certify epsilon={target_epsilon:g} for DiceSGD with "
                                         f"these settings (noise multiplier would exceed 1e8)")
    while hi - lo > 1e-3 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi
