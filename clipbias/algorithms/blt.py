"""Buffered linear Toeplitz (BLT) noise (Dvijotham, McMahan, Pillutla, Steinke, Thakurta 2024, "Efficient
and near-optimal noise generation for streaming differential privacy"): a Toeplitz strategy whose
every column reaches the end of the run, streamed with ``BUFFERS`` state vectors per side instead of
banded noise's b - 1, and accounted without amplification (``bands_strategy="blt"``).

The strategy C is lower-triangular Toeplitz with the rational generating function

    C(x) = c_0 (1 + sum_i omega_i x / (1 - theta_i x)),   0 < theta_i < 1,

so ``C_{t,j} = c_0`` for t = j and ``c_0 sum_i omega_i theta_i^(t-j-1)`` below: ``(C v)_t = c_0 (v_t +
sum_i omega_i s_{i,t})`` with ``s_{i,t+1} = theta_i s_{i,t} + v_t``, and ``C^{-1}`` streams alike
(``step.BLTNoise``).

Privacy (docs/privacy.md, "BLT noise"). With ``bands = k`` participation classes (cyclic Poisson:
example x joins only steps of its class l, t = l mod k, each with probability k q <= 1), x's
contributions over the first t steps enter the releases as ``C U``, U holding x's clipped gradient at
its participating steps (a subset of class l's) and 0 elsewhere. With ``X = C^T C`` (first t rows),

    ||C U||_F^2 = sum_{i,j} X_ij <u_i, u_j> <= sum_{i,j in class l} |X_ij| (C / B)^2 = S_l(t) (C / B)^2,

for every subset of participations and every choice of directions, so the sensitivity is ``Delta(t) =
sqrt(max_l S_l(t)) C / B`` (attained when C >= 0 entrywise, all u equal, every step of the class
taken). Adaptive choice of the u (each a function of the releases before it) does not change that: the
squared mean shifts of the releases add up to at most Delta(t)^2 on every path, a fully adaptive
composition of Gaussian mechanisms (Smith & Thakurta 2022; for a lower-triangular C, Denisov, McMahan,
Rush, Smith, Thakurta 2022, Thm 2.1), and a
data-independent mixture over x's class and inclusion bits is no less private than its worst member
(joint convexity of the hockey-stick divergence): the releases of t steps are the Gaussian mechanism at
noise multiplier ``z / (Delta(t) B / C)``. No amplification by sampling is claimed: choose k = floor(1 /
q), every example in one step per epoch. ``c_0`` is set so that ``Delta(T) = C / B`` at the planned T;
a run longer than planned is accounted at its own, larger Delta(t).

Coefficients: (omega, theta) that minimise ``Delta(T)^2 ||A C^{-1}||_F^2``, the expected total squared
error of the T iterates for the workload A of SGD with momentum (``band_strategy.workload``), with the
sensitivity above (Nelder-Mead over omega and the logit of theta from four fixed starts, ``|omega| <=
OMEGA_MAX``; cached like the optimised bands).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter

from ..errors import ConfigError
from ..privacy.toeplitz import blt_column, blt_sensitivity, class_sums
from .band_strategy import workload

OMEGA_MAX = 1.0  # |omega| bound: no near-cancelling pair of buffers (float64 state stays well conditioned)
BUFFERS = 2  # theta/omega pairs: 2 BUFFERS float64 state vectors of the model's size (s for C, r for C^-1)


@dataclass(frozen=True)
class BLT:
    """A BLT strategy: ``scale`` c_0 > 0, ``omegas`` and ``thetas`` (each 0 < theta < 1), and the number of
    participation ``classes`` k and planned ``steps`` T it was normalised for (``Delta(T) = 1``)."""

    scale: float
    omegas: tuple[float, ...]
    thetas: tuple[float, ...]
    classes: int
    steps: int

    def __post_init__(self) -> None:
        ok = (len(self.omegas) == len(self.thetas) >= 1 and math.isfinite(self.scale) and self.scale > 0
              and all(math.isfinite(w) for w in self.omegas) and all(0 < t < 1 for t in self.thetas)
              and isinstance(self.classes, int) and self.classes >= 1 and isinstance(self.steps, int)
              and self.steps >= 1)
        if not ok or not stable(self.omegas, self.thetas):
            raise ConfigError(f"a BLT strategy needs scale > 0, finite omegas, thetas in (0, 1), classes >= 1, "
                              f"steps >= 1 and no zero of C(x) in the closed unit disc (a stable C^-1), got {self!r}")

    def column(self, steps: int) -> np.ndarray:
        """``c_0 .. c_{steps-1}``: the first column of C (every column is it, shifted)."""
        return self.scale * _column(np.array(self.omegas), np.array(self.thetas), steps)

    def sensitivity(self, steps: int) -> float:
        """Delta(steps) in units of C / B: ``sqrt(max_l S_l(steps))`` (module docstring)."""
        return blt_sensitivity(self.scale, self.omegas, self.thetas, self.classes, steps)

    def to_dict(self) -> dict:
        return {"scale": self.scale, "omegas": list(self.omegas), "thetas": list(self.thetas),
                "classes": self.classes, "steps": self.steps}

    @classmethod
    def from_dict(cls, d: dict) -> "BLT":
        return cls(float(d["scale"]), tuple(float(w) for w in d["omegas"]), tuple(float(t) for t in d["thetas"]),
                   int(d["classes"]), int(d["steps"]))


def _column(omegas: np.ndarray, thetas: np.ndarray, steps: int) -> np.ndarray:
    return blt_column(1.0, omegas, thetas, steps)


def _polys(omegas: np.ndarray, thetas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) with C(x) / c_0 = N(x) / D(x): D = prod (1 - theta_i x), N = D + sum_i omega_i x prod_{j != i}."""
    den = np.array([1.0])
    for th in thetas:
        den = np.convolve(den, [1.0, -th])
    num = np.concatenate((den, [0.0]))
    for i, w in enumerate(omegas):
        p = np.array([0.0, w])
        for j, th in enumerate(thetas):
            if j != i:
                p = np.convolve(p, [1.0, -th])
        num[:len(p)] += p
    return np.trim_zeros(num, "b"), den


def stable(omegas, thetas) -> bool:
    """Whether C(x) has no zero in the closed unit disc (else C^{-1}'s noise grows without bound: useless,
    though as private as any strategy)."""
    return _stable(_polys(np.asarray(omegas, float), np.asarray(thetas, float))[0])


def _stable(num: np.ndarray) -> bool:
    return len(num) <= 1 or bool(np.all(np.abs(np.roots(num[::-1])) > 1.0 + 1e-9))


def error(omegas, thetas, steps: int, momentum: float = 0.0) -> float:
    """``||A C^{-1}||_F^2`` with c_0 = 1 (the series ``a(x) D(x) / N(x)``), inf where C^{-1} is unstable."""
    num, den = _polys(np.asarray(omegas, float), np.asarray(thetas, float))
    if not _stable(num):
        return math.inf
    a, w = workload(steps, momentum), np.arange(steps, 0, -1, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        h = lfilter(den, num, a)
        e = float(w @ (h * h))
    return e if math.isfinite(e) else math.inf


def objective(omegas, thetas, steps: int, classes: int, momentum: float = 0.0) -> float:
    """Delta(T)^2 ||A C^{-1}||_F^2 (scale-free): the total squared error at unit sensitivity."""
    om, th = np.asarray(omegas, float), np.asarray(thetas, float)
    return error(om, th, steps, momentum) * float(class_sums(_column(om, th, steps), classes).max())


def optimize(steps: int, classes: int, momentum: float = 0.0, buffers: int = BUFFERS) -> BLT:
    """The BLT strategy of ``buffers`` pairs of least total squared error at unit sensitivity for ``steps``
    steps in ``classes`` participation classes (module docstring), normalised to Delta(steps) = 1."""
    for name, v, lo in (("steps", steps, 1), ("bands", classes, 1), ("buffers", buffers, 1)):
        if not (isinstance(v, int) and v >= lo):
            raise ConfigError(f"`{name}` must be a whole number >= {lo} for BLT noise, got {v!r}")
    if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
        raise ConfigError(f"momentum must be in [0, 1), got {momentum!r}")

    def f(p: np.ndarray) -> float:
        om, th = p[:buffers], 1.0 / (1.0 + np.exp(-p[buffers:]))
        if not np.all((th > 0) & (th < 1)) or np.abs(om).max() > OMEGA_MAX:
            return math.inf
        v = objective(om, th, steps, classes, momentum)
        return math.log(v) if math.isfinite(v) and v > 0 else math.inf

    best = None
    for w0 in (0.1, 0.3):  # fixed starts: the same public settings give the same strategy
        for spread in (0.5, 2.0):
            th0 = 1.0 - np.geomspace(0.5, 0.5 / (1 + spread * 10), buffers)
            x0 = np.concatenate((np.full(buffers, w0 / buffers), np.log(th0 / (1 - th0))))
            r = minimize(f, x0, method="Nelder-Mead", options={"maxiter": 400 * buffers, "xatol": 1e-8,
                                                                 "fatol": 1e-12})
            if best is None or r.fun < best.fun:
                best = r
    if best is None or not math.isfinite(best.fun):
        raise ConfigError(f"no stable BLT strategy found for {steps} steps in {classes} classes")
    om, th = best.x[:buffers], 1.0 / (1.0 + np.exp(-best.x[buffers:]))
    return normalised(tuple(float(w) for w in om), tuple(float(t) for t in th), classes, steps)


def normalised(omegas: tuple[float, ...], thetas: tuple[float, ...], classes: int, steps: int) -> BLT:
    """The BLT strategy of these (omega, theta) with c_0 such that Delta(steps) = 1."""
    s = float(class_sums(_column(np.array(omegas), np.array(thetas), steps), classes).max())
    return BLT(1.0 / math.sqrt(s), omegas, thetas, classes, steps)


# ------------------------------------------------------------------ cache
_FILE = "blt_strategies.json"


def optimized(steps: int, classes: int, momentum: float = 0.0) -> BLT:
    """``optimize(steps, classes, momentum)``, cached on disk next to the calibrations (``$CLIPBIAS_CACHE``;
    ``CLIPBIAS_CACHE=off`` disables it). Only (omega, theta) are read back: the scale, hence the
    sensitivity, is always recomputed here, so a damaged file costs accuracy at most, never privacy."""
    from ..privacy.cache import memo, module_digest

    def load(entry) -> BLT | None:
        if not (isinstance(entry, dict) and len(entry.get("omegas", ())) == BUFFERS):
            return None
        om, th = tuple(float(w) for w in entry["omegas"]), tuple(float(t) for t in entry["thetas"])
        return normalised(om, th, classes, steps) if math.isfinite(objective(om, th, steps, classes, momentum)) \
            else None
    key = {"steps": steps, "classes": classes, "momentum": float(momentum), "buffers": BUFFERS,
           "code": module_digest(__file__)}
    return memo(_FILE, key, lambda: optimize(steps, classes, momentum), load,
                lambda b: {"omegas": list(b.omegas), "thetas": list(b.thetas)})
