"""Statistics of privacy audits: epsilon lower bounds that hold at a stated confidence.

* ``epsilon_lower_bound``: two worlds sampled many times (the canary audit). For a threshold test
  with rejection region E, (eps, delta)-DP requires P_D'(E) <= e^eps P_D(E) + delta in both
  directions, so eps >= ln((P_D'(E) - delta) / P_D(E)); one-sided Clopper-Pearson bounds replace the
  two probabilities, Bonferroni-corrected for every bound used.
* ``gdp_epsilon_lower_bound``: the same tests read through the Gaussian trade-off curve (Nasr et al.
  2023, "Tight auditing of differentially private machine learning"): a mu-GDP mechanism has
  TPR <= Phi(Phi^-1(FPR) + mu) for every test, so each threshold's Clopper-Pearson bounds give
  mu >= Phi^-1(TPR_lo) - Phi^-1(FPR_hi), and epsilon at delta follows from mu. A lower bound on the
  epsilon of mechanisms whose trade-off curve is Gaussian (full-batch DPSGD; approximately, many
  subsampled steps); it extrapolates the tails that a distribution-free bound cannot see.
* ``one_run_epsilon_lower_bound``: Steinke, Nasr & Jagielski (2023), "Privacy auditing with one (1)
  training run", Theorem 5.2: m canaries, each included independently with probability 1/2; an
  auditor that makes r guesses is right v times. Under (eps, delta)-DP,
  P[v' >= v] <= P[Binomial(r, p) >= v] + 2 m delta max_{1 <= i <= v} P[v - i <= Binomial(r, p) < v] / i,
  p = e^eps / (1 + e^eps); the lower bound is the largest eps whose p-value is still below
  1 - confidence.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import beta, binom

THRESHOLDS = np.linspace(-5.0, 15.0, 201)  # in units of the null's standard deviation, fixed a priori


def _cp_upper(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    return np.where(k >= n, 1.0, beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)))


def _cp_lower(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    return np.where(k <= 0, 0.0, beta.ppf(alpha, np.maximum(k, 1), n - k + 1))


def epsilon_lower_bound(null: np.ndarray, alt: np.ndarray, delta: float, confidence: float = 0.95,
                        thresholds: np.ndarray = THRESHOLDS) -> dict:
    """Lower bound on epsilon from samples of S under D (``null``) and D' (``alt``).

    For each threshold tau and both directions (rejecting when S >= tau: D' -> D; and S < tau:
    D -> D'), the (eps, delta) inequality P'(E) <= e^eps P(E) + delta must hold, so
    eps >= ln((P'(E) - delta) / P(E)); with one-sided Clopper-Pearson bounds (all 4 x len(thresholds)
    of them Bonferroni-corrected to ``confidence``), the bound holds with that confidence.
    """
    n0, n1 = len(null), len(alt)
    alpha = (1 - confidence) / (4 * len(thresholds))
    ge0 = (null[None, :] >= thresholds[:, None]).sum(1)
    ge1 = (alt[None, :] >= thresholds[:, None]).sum(1)
    best = {"epsilon_lower_bound": 0.0, "threshold": None, "direction": None}
    for name, k_pos, n_pos, k_neg, n_neg in (("S >= tau", ge1, n1, ge0, n0),
                                             ("S < tau", n0 - ge0, n0, n1 - ge1, n1)):
        tp_lo = _cp_lower(k_pos, n_pos, alpha)
        fp_hi = _cp_upper(k_neg, n_neg, alpha)
        with np.errstate(divide="ignore", invalid="ignore"):
            eps = np.where(tp_lo > delta, np.log(np.maximum(tp_lo - delta, 1e-300) / fp_hi), 0.0)
        i = int(np.argmax(eps))
        if eps[i] > best["epsilon_lower_bound"]:
            best = {"epsilon_lower_bound": float(eps[i]), "threshold": float(thresholds[i]),
                    "direction": name, "tpr_lower": float(tp_lo[i]), "fpr_upper": float(fp_hi[i])}
    return best


def gdp_epsilon_lower_bound(null: np.ndarray, alt: np.ndarray, delta: float, confidence: float = 0.95,
                            thresholds: np.ndarray = THRESHOLDS) -> dict:
    """Lower bounds on mu and on epsilon (at ``delta``) of a Gaussian trade-off curve, from samples of S
    under D (``null``) and D' (``alt``); the same thresholds, directions and Bonferroni correction as
    ``epsilon_lower_bound``."""
    from scipy.stats import norm

    from ..privacy.pld import gaussian_exact_epsilon

    n0, n1 = len(null), len(alt)
    alpha = (1 - confidence) / (4 * len(thresholds))
    ge0 = (null[None, :] >= thresholds[:, None]).sum(1)
    ge1 = (alt[None, :] >= thresholds[:, None]).sum(1)
    mu = 0.0
    for k_pos, n_pos, k_neg, n_neg in ((ge1, n1, ge0, n0), (n0 - ge0, n0, n1 - ge1, n1)):
        tp_lo, fp_hi = _cp_lower(k_pos, n_pos, alpha), _cp_upper(k_neg, n_neg, alpha)
        with np.errstate(divide="ignore", invalid="ignore"):
            m = np.where((tp_lo > 0) & (fp_hi < 1), norm.ppf(tp_lo) - norm.ppf(fp_hi), 0.0)
        mu = max(mu, float(np.nanmax(m)))
    eps = gaussian_exact_epsilon(1 / mu, 1, delta) if mu > 0 else 0.0
    return {"mu_lower_bound": mu, "epsilon_lower_bound_gdp": eps}


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[at least v of r guesses right] under (eps, delta)-DP (Steinke et al. 2023, Thm 5.2)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    p = 1.0 / (1.0 + math.exp(-eps))
    tail = float(binom.sf(v - 1, r, p))  # P[Binomial(r, p) >= v]
    pmf = binom.pmf(np.arange(v - 1, -1, -1), r, p)  # P[B = v-1], P[B = v-2], ..., P[B = 0]
    window = np.cumsum(pmf) / np.arange(1, v + 1) if v > 0 else np.zeros(0)
    return min(1.0, tail + 2 * m * delta * (float(window.max()) if v > 0 else 0.0))


def one_run_epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> float:
    """The largest eps (to 1e-4) at which v correct guesses of r would have p-value <= 1 - confidence."""
    alpha = 1 - confidence
    if r == 0 or one_run_p_value(m, r, v, 0.0, delta) > alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) <= alpha:
        lo, hi = hi, 2 * hi
        if hi > 200:
            return lo
    while hi - lo > 1e-4:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if one_run_p_value(m, r, v, mid, delta) <= alpha else (lo, mid)
    return lo
