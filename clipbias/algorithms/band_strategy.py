"""Banded Toeplitz strategies optimised for the run's workload (banded matrix factorisation with the
coefficients chosen for the error, as in Choquette-Choo et al. 2023 "Amplified BandMF" and McKenna
2024 "Scaling up the banded matrix factorization mechanism").

The workload A is the T x T lower-triangular Toeplitz matrix that maps the noisy updates to the
iterates: SGD with heavy-ball momentum ``beta`` (``m_t = beta m_{t-1} + g_t``, ``theta_t = theta_0 -
lr sum_{s <= t} m_s``) has first column ``a_k = sum_{j <= k} beta^j`` (beta 0: the prefix sum). The
strategy C is lower-triangular banded Toeplitz with first column ``c_0 > 0, c_1, ..., c_{b-1}`` and
unit norm (the sensitivity of one participation under cyclic participation: docs/privacy.md, "Banded
noise"). The noise the iterates receive is ``A C^{-1} sigma Z``; its expected total squared error over
the T iterates (per coordinate, in units of sigma^2) is

    E(c) = ||A C^{-1}||_F^2 = sum_{k < T} (T - k) h_k^2,   h = the first column of A C^{-1},

since ``A C^{-1}`` is lower-triangular Toeplitz with the series ``h(x) = a(x) / c(x)`` as its first
column (the recursion ``c_0 h_k = a_k - sum_{1 <= j < b} c_j h_{k-j}``, O(T b)). E is homogeneous of
degree -2 in c, so ``||c||^2 E(c)`` is the error of the normalised strategy; it is minimised over
``c_1 .. c_{b-1}`` with ``c_0 = 1`` by L-BFGS (scipy, analytic gradient ``dh / dc_j = -x^j h(x) /
c(x)``), from the Taylor coefficients and from the identity, keeping the better of the two optima
and never worse than the Taylor coefficients themselves.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter

from ..errors import ConfigError
from .band_taylor import coefficients

def workload(steps: int, momentum: float = 0.0) -> np.ndarray:
    """The first column of the Toeplitz workload of SGD with momentum: ``sum_{j <= k} momentum^j``."""
    return np.cumsum(momentum ** np.arange(steps, dtype=np.float64))


def _error_and_grad(c: np.ndarray, a: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
    """sum_k w_k h_k^2 with h = a / c (power series), and its gradient in c."""
    h = lfilter([1.0], c, a)
    err = float(w @ (h * h))
    g = lfilter([1.0], c, h)  # h / c: dh_k / dc_j = -g_{k-j}
    wh = w * h
    grad = np.array([-2.0 * float(wh[j:] @ g[:len(g) - j]) for j in range(len(c))])
    return err, grad


def error(coefs, steps: int, momentum: float = 0.0) -> float:
    """``||A C^{-1}||_F^2`` for the workload of ``steps`` steps of SGD with ``momentum`` and the banded
    Toeplitz strategy of ``coefs`` (not normalised here)."""
    a = workload(steps, momentum)
    c = np.asarray(coefs, dtype=np.float64)
    return _error_and_grad(c, a, np.arange(steps, 0, -1, dtype=np.float64))[0]


def optimize(bands: int, steps: int, momentum: float = 0.0, start=None) -> tuple[float, ...]:
    """Unit-norm banded coefficients (c_0 > 0) that minimise the total squared error of the iterates
    (module docstring). ``start``: the coefficients to start from besides the identity (default the
    Taylor ones); the result's error is never above theirs."""
    if not (isinstance(bands, int) and bands >= 1):
        raise ConfigError(f"bands must be a whole number >= 1, got {bands!r}")
    if not (isinstance(steps, int) and steps >= 1):
        raise ConfigError(f"bands_strategy='optimized' needs a finite number of steps >= 1, got {steps!r}")
    taylor = np.asarray(start if start is not None else coefficients(bands, momentum), dtype=np.float64)
    if bands == 1:
        return (1.0,)
    a, w = workload(steps, momentum), np.arange(steps, 0, -1, dtype=np.float64)

    def objective(free: np.ndarray) -> tuple[float, np.ndarray]:
        c = np.concatenate(([1.0], free))
        n2 = float(c @ c)
        with np.errstate(over="ignore", invalid="ignore"):
            err, grad = _error_and_grad(c, a, w)
        if not (math.isfinite(err) and err > 0 and np.isfinite(grad).all()):
            return math.inf, np.zeros_like(free)  # C(x) with a root inside the unit disc: the error explodes
        # log(||c||^2 E(c)): scale-free, the same minimiser, better scaled for the line search
        return math.log(n2) + math.log(err), (2.0 * c / n2 + grad / err)[1:]

    best = taylor / taylor[0]
    best_val = objective(best[1:])[0]
    for x0 in (best[1:], np.zeros(bands - 1)):
        res = minimize(objective, x0, jac=True, method="L-BFGS-B",
                       options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12, "maxcor": 20})
        val = objective(res.x)[0]
        if val < best_val:
            best, best_val = np.concatenate(([1.0], res.x)), val
    best = best / math.sqrt(float(best @ best))
    return tuple(float(x) for x in best)


# ------------------------------------------------------------------ cache
_FILE = "band_strategies.json"


def _valid(v, bands: int, steps: int, momentum: float) -> bool:
    """A cached entry is used only if it is a unit-norm strategy with c_0 > 0 of the right length and
    no worse than the Taylor coefficients (so a damaged file costs time, never privacy or accuracy)."""
    if not (isinstance(v, list) and len(v) == bands and all(isinstance(x, float) and math.isfinite(x) for x in v)):
        return False
    if not (v[0] > 0 and math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-12)):
        return False
    return error(v, steps, momentum) <= error(coefficients(bands, momentum), steps, momentum) * (1 + 1e-12)


def optimized(bands: int, steps: int, momentum: float = 0.0) -> tuple[float, ...]:
    """``optimize(bands, steps, momentum)``, cached on disk next to the calibrations
    (``clipbias.privacy.cache``: ``$CLIPBIAS_CACHE``, ``CLIPBIAS_CACHE=off`` disables it)."""
    from ..privacy.cache import memo, module_digest
    if bands == 1:
        return optimize(bands, steps, momentum)
    key = {"bands": bands, "steps": steps, "momentum": float(momentum), "error": "total",
           "code": module_digest(__file__)}
    return memo(_FILE, key, lambda: optimize(bands, steps, momentum),
                lambda v: tuple(v) if _valid(v, bands, steps, momentum) else None, list)
