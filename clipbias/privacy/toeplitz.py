"""The sensitivity of a Toeplitz strategy over one participation class (BLT noise's accounting:
``AccountingSpec.blt``; the strategies themselves are in ``clipbias.algorithms.blt``).

For the t x t lower-triangular Toeplitz C with first column c and k classes (example x may join only steps
``j = l mod k`` of its class l), ``||C U||_F^2 <= S_l (C / B)^2`` for every choice of x's participations and
contributions, ``S_l = sum_{i, j in class l} |X_ij|``, X = C^T C (docs/privacy.md, "BLT noise")."""

from __future__ import annotations

import functools
import math

import numpy as np


def blt_column(scale: float, omegas, thetas, steps: int) -> np.ndarray:
    """``c_0 .. c_{steps-1}`` of ``C(x) = scale (1 + sum_i omega_i x / (1 - theta_i x))``."""
    om, th = np.asarray(omegas, dtype=np.float64), np.asarray(thetas, dtype=np.float64)
    k = np.arange(max(steps - 1, 0), dtype=np.float64)
    tail = (om[:, None] * th[:, None] ** k).sum(0) if steps > 1 else np.zeros(0)
    return scale * np.concatenate(([1.0], tail))[:steps]


def class_sums(c: np.ndarray, classes: int) -> np.ndarray:
    """``S_l = sum_{i, j in class l, i, j < t} |X_ij|`` for every class l, X = C^T C of the t x t lower-triangular
    Toeplitz C with first column ``c`` (t = len(c)). For i <= j, ``X_ij = sum_{u <= t-1-j} c_u c_{u+j-i}``;
    O(t^2 / k)."""
    t, out = len(c), np.zeros(classes)
    for d in range(0, t, classes):  # d = j - i, a multiple of k
        prefix = np.cumsum(c[:t - d] * c[d:])
        j = np.arange(d, t)
        out += np.bincount(j % classes, np.abs(prefix[t - 1 - j]) * (1.0 if d == 0 else 2.0), minlength=classes)
    return out


def blt_sensitivity(scale: float, omegas, thetas, classes: int, steps: int) -> float:
    """Delta(steps) in units of the per-example sensitivity: ``sqrt(max_l S_l)`` (remembered: a run's report
    asks for it at every epoch, and it costs O(steps^2 / classes))."""
    return _sensitivity(float(scale), tuple(map(float, omegas)), tuple(map(float, thetas)), int(classes), int(steps))


@functools.lru_cache(maxsize=256)
def _sensitivity(scale: float, omegas: tuple, thetas: tuple, classes: int, steps: int) -> float:
    c = blt_column(scale, omegas, thetas, steps)
    # rounded up: every S_l is a float64 sum of at most steps + (steps / classes + 1)^2 rounded terms, so its
    # error is within gamma_n of the same sums of absolute values (the class sums of |c|)
    n = steps + (steps // classes + 1) ** 2 + 4
    gamma = 1.01 * n * 2.0 ** -53
    return math.sqrt(float((class_sums(c, classes) + gamma * class_sums(np.abs(c), classes)).max()))
