"""(a) Adversarial signs and directions against the claimed sensitivity Delta(t)^2 = max_l sum_{i,j in l} |X_ij|.

For each strategy (the optimised ones of the audited settings, a sweep of optimised ones, and hand-made ones
whose C has negative entries), every class l and t in {T, 2T}: the largest ||C U||^2 found over (1) every
participation subset and sign pattern (brute force, m <= 14 steps in the class; beyond, all +1 and the signs
of X's leading eigenvector), (2) unit vectors in R^min(m, 8) (100 random starts of the ascent u_i <-
normalise(sum_j X_ij u_j), which never lowers U^T X U), against the claimed S_l(t) (``blt.class_sums``, also
checked against the dense X). A value above the claim would break it; the ratio found / claimed shows how
tight the claim is.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/redteam/blt/rt_signs.py
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np

os.environ.setdefault("CLIPBIAS_CACHE", "off")

from clipbias.algorithms import blt  # noqa: E402
from clipbias.audit.blt import dense  # noqa: E402


def brute(x: np.ndarray) -> float:
    """max over a in {-1, 0, 1}^m of a^T x a (a subset of participations with signs)."""
    m = len(x)
    pats = np.array(list(itertools.product((1.0, -1.0, 0.0), repeat=m - 1)))
    pats = np.concatenate((np.ones((len(pats), 1)), pats), 1)
    best = 0.0
    for chunk in np.array_split(pats, max(1, len(pats) // 200_000)):
        best = max(best, float(np.einsum("pi,ij,pj->p", chunk, x, chunk).max()))
    return best


def ascent(x: np.ndarray, dim: int, starts: int, rng) -> float:
    best = 0.0
    m = len(x)
    for _ in range(starts):
        u = rng.standard_normal((m, dim))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        for _ in range(200):
            w = x @ u
            n = np.linalg.norm(w, axis=1, keepdims=True)
            u = np.where(n > 0, w / np.maximum(n, 1e-300), u)
        best = max(best, float(np.einsum("ij,ik,jk->", x, u, u)))
    return best


def check(name: str, b: blt.BLT, rng) -> tuple[float, float]:
    worst_ratio, neg = 0.0, 0
    for t in (b.steps, 2 * b.steps):
        c = dense(b, t)
        xfull = c.T @ c
        sums = blt.class_sums(b.column(t), b.classes)
        for cls in range(min(b.classes, t)):
            idx = np.arange(cls, t, b.classes)
            x = xfull[np.ix_(idx, idx)]
            assert np.isclose(np.abs(x).sum(), sums[cls], rtol=1e-12), (name, t, cls)
            neg += int((x < 0).sum())
            ones, top = np.ones(len(idx)), np.sign(np.linalg.eigh(x)[1][:, -1])
            found = max(ascent(x, min(len(idx), 8), 100, rng), ones @ x @ ones, top @ x @ top)
            if len(idx) <= 14:
                found = max(found, brute(x))
            worst_ratio = max(worst_ratio, found / sums.max())
            assert found <= sums.max() * (1 + 1e-12), (name, t, cls, found, sums.max())
    return worst_ratio, neg


def main() -> None:
    rng = np.random.default_rng(0)
    cases = {}
    for T, k, m in ((40, 4, 0.9), (40, 4, 0.0), (87, 29, 0.9)):
        cases[f"optimize({T}, {k}, {m})"] = blt.optimize(T, k, m)
    for T in (12, 30, 60):
        for k in (2, 3, 5):
            for m in (0.0, 0.5, 0.9):
                cases[f"optimize({T}, {k}, {m})"] = blt.optimize(T, k, m)
    # hand-made strategies with negative entries in C; the BLT type refuses an unstable C^{-1}, so those
    # whose C(x) has a zero in the unit disc are replaced by stable ones with negative entries
    for om, th in (((-0.05, 0.1), (0.9, 0.3)), ((1.0, -1.0), (0.95, 0.5)), ((-0.3, 0.5), (0.6, 0.2)),
                   ((0.9, -0.95), (0.99, 0.9))):
        if not blt.stable(om, th):
            print(f"skipped normalised({om}, {th}): unstable C^-1 (refused by blt.BLT)")
            continue
        for T, k in ((24, 2), (40, 4), (30, 3)):
            cases[f"normalised({om}, {th}, {k}, {T})"] = blt.normalised(om, th, k, T)
    print("| strategy | min c | negative X_ij in a class (t = T, 2T) | max found / claimed S(t) |")
    print("|---|---|---|---|")
    t0 = time.time()
    for name, b in cases.items():
        ratio, neg = check(name, b, rng)
        print(f"| {name} | {b.column(2 * b.steps).min():.3g} | {neg} | {ratio:.6f} |", flush=True)
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
