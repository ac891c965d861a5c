"""Epsilon lower bounds from the attack scores of one training run's canaries.

Each of m canaries was included independently with probability 1/2; the auditor scores every canary
(higher = "more likely in") and, for a threshold t, guesses "in" for the canaries scoring >= t and
abstains on the others. With ``r`` guesses of which ``v`` are right, two tests bound epsilon:

* ``"one-run"``: Steinke, Nasr & Jagielski (2023), Theorem 5.2 (``stats.one_run_p_value``): under
  (eps, delta)-DP, v is dominated by Binomial(r, e^eps / (1 + e^eps)) up to a delta term. Valid for
  any (eps, delta)-DP mechanism.
* ``"one-run-fdp"``: Mahloujifar, Melis & Chaudhuri (2024), "Auditing f-differential privacy in one
  run": the same guessing game tested against a trade-off curve f instead of (eps, delta). The curve
  tested is the Gaussian one, mu-GDP with the mu whose privacy profile passes through (eps, delta)
  (Balle & Wang 2018, the analytic Gaussian mechanism). It refutes "the mechanism is as private as a
  Gaussian mechanism with this (eps, delta)"; that is a lower bound on epsilon for mechanisms whose
  trade-off curve is Gaussian (the full-batch Gaussian mechanism, DP-SGD without subsampling, and
  by the central limit theorem approximately so over many subsampled steps), and about twice as
  tight as ``"one-run"``.

Every threshold is tried. As in jax_privacy's ``CanaryScoreAuditor`` (whose published values the
tests reproduce), only thresholds on the upper concave hull of the ROC curve are candidates and, by
default (``correction="hull"``), the significance is split equally among them (Bonferroni); the
reported bound is the largest epsilon that any candidate refutes at its share of the significance.
The hull depends on the scores, so this split is the reference's convention rather than a union
bound over a family fixed in advance; ``correction="all"`` splits the significance among all m + 1
possible thresholds, a union bound that holds whatever the scores. It can cost much: on the
reference's case at shift 2 (m = 20,000, delta 1e-6) the f-DP bound drops from 4.72 to 3.92, and the
plain one-run bound to 0 (its per-threshold level 2.5e-6 is below the delta term of Thm 5.2).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from dp_accounting import get_sigma_gaussian
from scipy.optimize import brentq
from scipy.special import ndtr, ndtri
from scipy.stats import binom

from ..errors import ConfigError
from .stats import one_run_p_value

METHODS = ("one-run", "one-run-fdp")
CORRECTIONS = ("hull", "all")


def epsilon_from_scores(in_scores, out_scores, *, delta: float, significance: float = 0.05,
                        method: str = "one-run", correction: str = "hull") -> float:
    """Largest epsilon refuted at level ``significance`` by the canaries' scores (0 if none is).

    ``in_scores``: the scores of the included canaries; ``out_scores``: the excluded ones'; ``delta``:
    the delta of the (eps, delta) claims tested; ``method``: "one-run" (Steinke et al. 2023, valid for
    any (eps, delta)-DP mechanism) or "one-run-fdp" (Mahloujifar et al. 2024, the Gaussian trade-off
    curve with that (eps, delta)); ``correction``: "hull" (the reference's Bonferroni split among the
    ROC hull's vertices) or "all" (among all m + 1 thresholds); see the module's docstring.
    """
    return one_run_estimate(in_scores, out_scores, delta=delta, significance=significance,
                            method=method, correction=correction)["epsilon_lower_bound"]


def one_run_estimate(in_scores, out_scores, *, delta: float, significance: float = 0.05,
                     method: str = "one-run", correction: str = "hull") -> dict:
    """``epsilon_from_scores`` with its witness: the threshold, guesses and right guesses used, and
    the number of candidate thresholds the significance was split among."""
    pos, neg = _scores(in_scores, "in_scores"), _scores(out_scores, "out_scores")
    if method not in METHODS:
        raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if correction not in CORRECTIONS:
        raise ConfigError(f"correction must be one of {', '.join(CORRECTIONS)}, got {correction!r}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ConfigError(f"delta must be in (0, 1), got {delta!r}")
    if not (isinstance(significance, (int, float)) and 0 < significance < 1):
        raise ConfigError(f"significance must be in (0, 1) (one minus the confidence), got {significance!r}")
    thresholds, tp, fp = _hull(pos, neg)
    m = len(pos) + len(neg)
    level = significance / (len(thresholds) if correction == "hull" else m + 1)
    bound = _bound_one_run if method == "one-run" else _bound_fdp
    # try the most precise thresholds first: a later one whose precision cannot beat the current
    # bound's e^eps / (1 + e^eps) is skipped without a search (it could only refute a smaller eps)
    order = np.argsort(-(tp / np.maximum(tp + fp, 1)), kind="stable")
    best = {"epsilon_lower_bound": 0.0, "threshold": math.inf, "guesses": 0, "correct": 0}
    for i in order:
        r, v = int(tp[i] + fp[i]), int(tp[i])
        if r == 0 or v / r <= 1 / (1 + math.exp(-best["epsilon_lower_bound"])):
            continue
        eps = bound(best["epsilon_lower_bound"], m, r, v, level, delta)
        if eps > best["epsilon_lower_bound"]:
            best = {"epsilon_lower_bound": eps, "threshold": float(thresholds[i]), "guesses": r, "correct": v}
    return {**best, "method": method, "candidates": len(thresholds), "correction": correction,
            "significance": significance,
            "delta": delta, "canaries": m}


def _scores(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    if a.ndim != 1 or a.size == 0:
        raise ConfigError(f"{name} must be a non-empty 1-D array of scores, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ConfigError(f"{name} holds {int((~np.isfinite(a)).sum())} non-finite scores; drop or fix them")
    return a


def _hull(pos: np.ndarray, neg: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The candidate thresholds and their (true, false) "in" guesses.

    Every distinct score and +inf (no guess) is a threshold; in the plane of (missed in-canaries,
    rejected out-canaries), increasing in the threshold, only the vertices of the upper concave hull
    are kept (a point on or under the chord of two others is dropped; collinear points too)."""
    t = np.concatenate([np.unique(np.concatenate([pos, neg])), [math.inf]])
    fn = np.searchsorted(np.sort(pos), t, side="left")  # in-canaries below t
    tn = np.searchsorted(np.sort(neg), t, side="left")
    keep: list[int] = []
    for i in range(len(t)):
        while len(keep) >= 2:
            a, b = keep[-2], keep[-1]
            # drop b unless the slope from a to b is strictly larger than from b to i
            if (fn[b] - fn[a]) * (tn[i] - tn[b]) - (tn[b] - tn[a]) * (fn[i] - fn[b]) >= 0:
                keep.pop()
            else:
                break
        keep.append(i)
    k = np.array(keep)
    return t[k], len(pos) - fn[k], len(neg) - tn[k]


def _search(refutes, eps_lo: float) -> float:
    """The largest eps >= eps_lo at which ``refutes(eps) > 0`` (a decreasing function), to 1e-6;
    eps_lo when it does not refute there."""
    if refutes(eps_lo) <= 0:
        return eps_lo
    hi = max(1.0, 2 * eps_lo)
    while refutes(hi) > 0:
        eps_lo, hi = hi, 2 * hi
        if hi > 1e4:
            return eps_lo
    return brentq(refutes, eps_lo, hi, xtol=1e-6)


def _bound_one_run(eps_lo: float, m: int, r: int, v: int, level: float, delta: float) -> float:
    """Steinke et al. (2023), Thm 5.2: the largest eps whose p-value for v right of r is below level."""
    if binom.sf(v - 1, r, 1 / (1 + math.exp(-eps_lo))) > level:
        return eps_lo  # even the delta = 0 p-value is too large: nothing above eps_lo is refuted
    return _search(lambda eps: level - one_run_p_value(m, r, v, eps, delta), eps_lo)


@functools.lru_cache(maxsize=4096)
def _gdp_mu(eps: float, delta: float) -> float:
    """mu of the Gaussian mechanism that is exactly (eps, delta)-DP (sensitivity 1, std 1/mu)."""
    sigma = get_sigma_gaussian(eps, delta)
    return math.inf if sigma == 0 else 1.0 / sigma


def _bound_fdp(eps_lo: float, m: int, r: int, v: int, level: float, delta: float) -> float:
    """Mahloujifar et al. (2024): the largest eps whose Gaussian trade-off curve makes v right of r
    guesses an event of probability below level."""
    return _search(lambda eps: _fdp_excess(_gdp_mu(eps, delta), m, r, v, level), eps_lo)


def _fdp_excess(mu: float, m: int, r: int, v: int, level: float) -> float:
    """Positive when mu-GDP is refuted by v right of r guesses at this level.

    ``right`` and ``wrong`` are the level-scaled fractions of the m canaries on which the guesses
    are right and wrong, starting from the observed counts. Walking down the number of right guesses
    (v - 1, ..., 0), the trade-off curve forces a floor on the wrong mass (1 - f's inverse, here
    Phi(Phi^-1(right) - mu)); each raise of the wrong mass moves the corresponding share
    j / (r - j) of it back to the right mass. Under mu-GDP the total cannot exceed the r / m of the
    canaries that were guessed, so an excess refutes the curve; the walk stops once the floor stops
    rising (nothing changes after it).
    """
    right, wrong = level * v / m, level * (r - v) / m
    for j in range(v - 1, -1, -1):
        floor = float(ndtr(ndtri(right) - mu)) if math.isfinite(mu) else float(right >= 1.0)
        if floor <= wrong:
            break
        right = min(right + j / (r - j) * (floor - wrong), 1.0)
        wrong = floor
    return right + wrong - r / m
