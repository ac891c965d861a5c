"""Bands wider than the class spacing: what amplification could give banded noise whose participations share
rows, measured two ways against the amplified bands (b <= k) that clipbias runs.

With k classes (an example joins only steps ``l mod k``, each with probability ``p = k q``) and a band
``k < b <= 2 k``, the column of one participation overlaps the next one's by ``b - k`` rows, so the proof of
``--bands`` (disjoint blocks, docs/privacy.md) does not apply. For such strategies this script computes:

* ``bound``: an epsilon clipbias can prove, by conditional composition (the argument of MMCC, Choquette-Choo,
  Ganesh, Steinke, Thakurta 2024, specialised to one shared participation per block; the proof is in
  docs/privacy.md, "Bands wider than 1 / q"): block ``R_j`` (the k rows from class step j) holds x's new bit
  at rate p and the previous participation's bit at its posterior, which is at most ``p~`` outside an event
  of probability ``delta_1``; splitting the noise of the shared rows (fraction ``lam`` to the old bit) makes
  the block a sum of two independent subsampled Gaussians. The blocks compose adaptively (PLD), and the
  ``delta_1`` of every block with an old bit is added to delta.
* ``exact``: the epsilon of one input, estimated by Monte Carlo: the class-0 canary with the same unit
  gradient at every step and no adaptivity, whose participation bits are a chain (each block couples two
  bits). Every sound analysis of the fixed-class mechanism must certify at least this for it, so the error
  it allows is a floor for MMCC or any tighter accounting of the same strategy.

Coefficients: the band-b optimum of ``--bands-strategy optimized`` with its tail (``c_k .. c_{b-1}``) scaled by
``gamma`` and renormalised (``gamma = 0``: a k-band); the error is ``z^2 ||A C^{-1}||_F^2`` for SGD with
momentum 0.9, as a ratio to DP-SGD's at the same epsilon (the units of benchmarks/noise_error.py).

    PYTHONPATH=. python benchmarks/bands_overlap.py --epsilons 3 --out benchmarks/results/noise_error/overlap-compare-eps3.json
    PYTHONPATH=. python benchmarks/bands_overlap.py --protocols long-b2048 --configs 8:16 16:32 29:58 --gammas 0 0.5 1 \
        --out benchmarks/results/noise_error/overlap-long-b2048-eps3.json   # 36 min
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from pathlib import Path

import numpy as np
from scipy.stats import norm

from clipbias.algorithms.band_strategy import _error_and_grad, optimized, workload
from clipbias.privacy import AccountingSpec, calibrate, fast_pld

N, DELTA, BETA = 60_000, 1e-5, 0.9
PROTOCOLS = {"compare": (2048, 3), "long-b2048": (2048, 40)}  # batch size, epochs
DISCRETIZATION = 1e-3


def scaled_tail(c, k: int, gamma: float) -> np.ndarray:
    """``c`` with its coefficients from ``k`` on multiplied by ``gamma``, at unit norm."""
    c = np.array(c, dtype=np.float64)
    c[k:] *= gamma
    return c / np.linalg.norm(c)


def class_gram(c, k: int, steps: int) -> np.ndarray:
    """``C_J^T C_J`` for the columns of class 0 (steps 0, k, 2k, ...) of the banded Toeplitz C of ``c``."""
    c, js = np.asarray(c, dtype=np.float64), range(0, steps, k)
    cols = np.zeros((len(js), steps))
    for e, j in enumerate(js):
        n = min(len(c), steps - j)
        cols[e, j:j + n] = c[:n]
    return cols @ cols.T


def instance_losses(gram: np.ndarray, p: float, z: float, n: int, rng: np.random.Generator, world: str,
                    chunk: int = 200_000) -> np.ndarray:
    """Privacy-loss samples ``log dQ/dP`` of the canary: P releases noise only, Q adds ``C_J s`` with the bits
    s i.i.d. Bernoulli(p). The loss is a function of ``w = C_J^T y / sigma^2 ~ N(G s, G)`` (G = gram / z^2),
    ``log E_s exp(s.w - s^T G s / 2)``, summed over the bits by the forward algorithm (G tridiagonal:
    ``b <= 2 k``). ``world`` "P" or "Q" says which law y is drawn from."""
    g = gram / z ** 2
    e_n = len(g)
    if np.abs(np.triu(g, 2)).max(initial=0.0) > 0:
        raise ValueError("the class's columns overlap beyond their neighbours (b > 2 k)")
    chol = np.linalg.cholesky(g + 1e-15 * np.eye(e_n))
    lp, lq = math.log1p(-p) if p < 1 else -math.inf, math.log(p)
    out = np.empty(n)
    for s0 in range(0, n, chunk):
        m = min(chunk, n - s0)
        w = rng.standard_normal((m, e_n)) @ chol.T
        if world == "Q":
            w += (rng.random((m, e_n)) < p).astype(np.float64) @ g
        a0, a1 = np.full(m, lp), lq + w[:, 0] - g[0, 0] / 2
        for e in range(1, e_n):
            gain = lq + w[:, e] - g[e, e] / 2
            a0, a1 = np.logaddexp(a0, a1) + lp, np.logaddexp(a0 + gain, a1 + gain - g[e - 1, e])
        out[s0:s0 + m] = np.logaddexp(a0, a1)
    return out


def instance_epsilon(gram: np.ndarray, p: float, z: float, delta: float = DELTA, n: int = 2_000_000,
                     seed: int = 0) -> float:
    """Monte Carlo estimate of the canary's epsilon at ``delta`` (both directions: the larger), from ``n``
    samples per world (the same seed at every z: common random numbers keep the calibration monotone)."""
    rng = np.random.default_rng(seed)
    lq, lp = instance_losses(gram, p, z, n, rng, "Q"), instance_losses(gram, p, z, n, rng, "P")

    def excess(e: float) -> float:
        return max(np.mean(-np.expm1(np.minimum(e - lq, 0.0))), np.mean(-np.expm1(np.minimum(e + lp, 0.0))))

    lo, hi = 0.0, 40.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > delta else (lo, mid)
    return hi


@functools.cache
def _sg(noise: float, p: float):
    return fast_pld.gaussian_pld(noise, min(p, 1.0), DISCRETIZATION)


def posterior_cap(p: float, head: float, cross: float, z: float, delta1: float) -> float:
    """``p~``: the largest posterior probability that x joined the previous step of its class, given the
    releases before the current block, outside an event of probability ``delta1`` in either world: the
    likelihood ratio is at most ``exp(|h| g / z + |h|^2 / (2 z^2) + cross / z^2)`` with g ~ N(0, 1)."""
    log_ratio = head * norm.isf(delta1) / z + head ** 2 / (2 * z * z) + cross / z ** 2
    if log_ratio > 700:
        return 1.0
    r = math.exp(log_ratio)
    return p * r / (1 - p + p * r)


def conditional_bound(c, k: int, p: float, z: float, steps: int, lam: float, share: float,
                      delta: float = DELTA) -> float:
    """The conditional-composition epsilon of banded noise with coefficients ``c`` (unit norm, ``b <= 2 k``)
    for class 0 at rate ``p`` (module docstring; docs/privacy.md): ``share`` of delta goes to the posterior
    caps, split evenly over the blocks that have one (``delta_1`` each). ``b <= k`` (no shared rows) gives the
    amplified bands' composition, block by block."""
    c = np.trim_zeros(np.asarray(c, dtype=np.float64), "b")
    b = len(c)
    if b > 2 * k:
        raise ValueError("conditional_bound covers b <= 2 k only")
    head, tail = c[:k], c[k:]
    shared = len(tail)
    cross = abs(float(tail @ head[:shared]))
    js = list(range(0, steps, k))
    tail_rows = min(shared, steps - (js[-1] + k))
    bad = sum(1 for i, j in enumerate(js) if i > 0 and min(shared, steps - j) > 0) + (tail_rows > 0)
    delta1 = share * delta / bad if bad else 0.0
    plds = []
    for i, j in enumerate(js):
        rows = min(k, steps - j)
        o = min(shared, rows) if i > 0 else 0
        if o > 0:
            pt = posterior_cap(p, float(np.linalg.norm(head)), cross if i >= 2 else 0.0, z, delta1)
            plds.append(_sg(z * math.sqrt(lam) / np.linalg.norm(tail[:o]), pt))
            new = math.sqrt(float(np.sum(head[:o] ** 2)) / (1 - lam) + float(np.sum(head[o:rows] ** 2)))
        else:
            new = float(np.linalg.norm(head[:rows]))
        plds.append(_sg(z / new, p))
    if tail_rows > 0:  # the rows after the last block: the last participation's tail alone
        pt = posterior_cap(p, float(np.linalg.norm(head)), cross if len(js) >= 2 else 0.0, z, delta1)
        plds.append(_sg(z / np.linalg.norm(tail[:tail_rows]), pt))
    total = functools.reduce(lambda x, y: x.compose(y), plds)
    return total.get_epsilon_for_delta(delta - bad * delta1)


def calibrate_z(epsilon_of, target: float, start: float = 2.0, rtol: float = 0.003) -> float:
    """The smallest z (to ``rtol``) with ``epsilon_of(z) <= target``: a bracket grown from ``start`` by
    factors of 1.25, then regula falsi on log epsilon against log z (epsilon is close to a power of z
    there), kept bracketing, so that a Monte Carlo epsilon is evaluated 4-6 times rather than 10-15."""
    def f(z: float) -> float:
        e = epsilon_of(z)
        return math.log(e / target) if 0 < e < math.inf else (math.inf if e == math.inf else -math.inf)

    lo, flo = start, f(start)
    hi, fhi = lo, flo
    while flo <= 0:  # grow down until epsilon is above the target
        hi, fhi, lo = lo, flo, lo / 1.25
        flo = f(lo)
        if lo < 1e-2:
            raise ValueError(f"epsilon stays below {target} down to z = {lo:.3g}")
    while fhi > 0:  # grow up until it is below
        lo, flo, hi = hi, fhi, hi * 1.25
        fhi = f(hi)
        if hi > 1e3:
            raise ValueError(f"epsilon stays above {target} up to z = {hi:.3g}")
    last, same = None, 0  # the end the last steps moved: regula falsi stalls on one end, so bisect then
    while hi / lo > 1 + rtol:
        if same >= 2 or not (math.isfinite(flo) and math.isfinite(fhi)):
            t = 0.5
        else:
            t = min(max(flo / (flo - fhi), 0.05), 0.95)  # the chord's zero, in log z
        mid = lo * (hi / lo) ** t
        fm = f(mid)
        end = "lo" if fm > 0 else "hi"
        last, same = end, (same + 1 if end == last else 1)
        if fm > 0:
            lo, flo = mid, fm
        else:
            hi, fhi = mid, fm
    return hi


def _bound_at(c, k, p, steps, lam, share, z):
    return conditional_bound(c, k, p, z, steps, lam, share)


def _canary_at(gram, p, samples, z):
    return instance_epsilon(gram, p, z, n=samples)


def rows(protocol: str, eps: float, configs: list[tuple[int, int]], gammas: list[float], samples: int,
         lams: list[float], shares: list[float]) -> list[dict]:
    batch, epochs = PROTOCOLS[protocol]
    q = batch / N
    steps = epochs * round(N / batch)
    a, w = workload(steps, BETA), np.arange(steps, 0, -1, dtype=np.float64)
    z0 = calibrate(AccountingSpec("gaussian", q, 0.0), eps, DELTA, steps)
    base = z0 ** 2 * float(w @ (a * a))
    common = {"protocol": protocol, "epsilon": eps, "steps": steps, "q": q}
    out = []
    for k in sorted({k for k, _ in configs}):
        c = np.array(optimized(k, steps, BETA))
        z = calibrate(AccountingSpec("gaussian", q, 0.0, bands=k), eps, DELTA, steps)
        out.append({**common, "classes": k, "band": k, "gamma": None, "analysis": "claim (--bands k)", "z": z,
                    "ratio": z ** 2 * _error_and_grad(c, a, w)[0] / base})
    for k, b in configs:
        p = min(1.0, k * q)
        z_k = calibrate(AccountingSpec("gaussian", q, 0.0, bands=k), eps, DELTA, steps)
        for gamma in gammas:
            c = scaled_tail(optimized(b, steps, BETA), k, gamma)
            err = _error_and_grad(c, a, w)[0] / base
            t0 = time.time()
            best = min((calibrate_z(functools.partial(_bound_at, c, k, p, steps, lam, sh), eps, start=z_k), lam, sh)
                       for lam in lams for sh in shares)
            out.append({**common, "classes": k, "band": b, "gamma": gamma, "analysis": "bound", "z": best[0],
                        "lam": best[1], "delta_share": best[2], "ratio": best[0] ** 2 * err})
            g = class_gram(c, k, steps)
            zx = calibrate_z(functools.partial(_canary_at, g, p, samples), eps, start=z_k, rtol=0.005)
            out.append({**common, "classes": k, "band": b, "gamma": gamma, "analysis": "exact (one canary, MC)",
                        "z": zx, "samples": samples, "ratio": zx ** 2 * err})
            print(f"{protocol} eps {eps:g} k {k} b {b} gamma {gamma:g}: bound {best[0] ** 2 * err:.3f}, "
                  f"exact canary {zx ** 2 * err:.3f} ({time.time() - t0:.0f} s)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocols", nargs="+", default=["compare"], choices=list(PROTOCOLS))
    ap.add_argument("--epsilons", nargs="+", type=float, default=[3.0])
    ap.add_argument("--configs", nargs="+", default=["4:8", "8:16", "14:28", "29:58"], help="k:b pairs, k < b <= 2k")
    ap.add_argument("--gammas", nargs="+", type=float, default=[0.0, 0.25, 0.5, 1.0])
    ap.add_argument("--samples", type=int, default=2_000_000, help="Monte Carlo samples per world")
    ap.add_argument("--lams", nargs="+", type=float, default=[0.35, 0.5, 0.65])
    ap.add_argument("--shares", nargs="+", type=float, default=[0.1, 0.3],
                    help="the part of delta spent on the posterior caps")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    configs = [tuple(int(v) for v in s.split(":")) for s in a.configs]
    t0, table = time.time(), []
    for p in a.protocols:
        for e in a.epsilons:
            table += rows(p, e, configs, a.gammas, a.samples, a.lams, a.shares)
    print("| protocol | epsilon | k | b | tail scale | analysis | z | error / dpsgd's |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        g = "-" if r["gamma"] is None else f"{r['gamma']:g}"
        print(f"| {r['protocol']} | {r['epsilon']:g} | {r['classes']} | {r['band']} | {g} | {r['analysis']} "
              f"| {r['z']:.3f} | {r['ratio']:.3f} |")
    print(f"({time.time() - t0:.0f} s)")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
