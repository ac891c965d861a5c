"""Does the learning-rate schedule change the best banded strategy? The iterates of SGD with momentum
beta and a schedule eta_t are ``A g`` with ``A = P diag(eta) M`` (P the prefix sum, M momentum's Toeplitz
matrix): no longer Toeplitz, so ``band_strategy.optimize`` (which models a constant rate) does not see
the schedule. For each schedule this script optimises the unit-norm banded coefficients for ``||A
C^{-1}||_F^2`` itself (L-BFGS from the constant-rate optimum) and prints the error of the constant-rate
optimum and of the Taylor coefficients as ratios to it.

    PYTHONPATH=. python benchmarks/bands_schedule.py --out benchmarks/results/bands_strategy/schedule.json  # ~1 min
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
from scipy.linalg import solve_triangular, toeplitz
from scipy.optimize import minimize

from clipbias.algorithms.band_strategy import optimize
from clipbias.algorithms.band_taylor import coefficients


def schedules(steps: int) -> dict[str, np.ndarray]:
    t = np.arange(steps)
    return {"linear decay": 1 - t / steps, "cosine": 0.5 * (1 + np.cos(np.pi * t / steps)),
            "10 % warm-up, linear decay": np.minimum((t + 1) / (0.1 * steps), (steps - t) / (0.9 * steps)),
            "step (x0.1 at 50 % and 75 %)": np.where(t < steps // 2, 1.0, np.where(t < 3 * steps // 4, 0.1, 0.01))}


def error(a: np.ndarray, c: np.ndarray) -> float:
    steps = a.shape[0]
    col = np.zeros(steps)
    col[:len(c)] = c[:steps]
    x = solve_triangular(toeplitz(col, np.zeros(steps)).T, a.T, lower=False).T  # A C^{-1}
    return float((x * x).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", nargs="+", type=int, default=[87, 280])
    ap.add_argument("--bands", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--momentum", nargs="+", type=float, default=[0.9, 0.0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows, t0 = [], time.time()
    print("| T | momentum | schedule | b | constant-rate optimum / schedule's | Taylor / schedule's |")
    print("| --- | --- | --- | --- | --- | --- |")
    for steps in a.steps:
        for beta in a.momentum:
            m = toeplitz(beta ** np.arange(steps), np.zeros(steps))
            for name, eta in schedules(steps).items():
                work = np.tril(np.ones((steps, steps))) @ np.diag(eta) @ m
                for b in a.bands:
                    const = np.array(optimize(b, steps, beta))

                    def f(free: np.ndarray) -> float:
                        c = np.concatenate(([1.0], free))
                        return math.log(error(work, c)) + math.log(float(c @ c))
                    r = minimize(f, const[1:] / const[0], method="L-BFGS-B")
                    best = min(error(work, const), math.exp(r.fun))
                    row = {"steps": steps, "momentum": beta, "schedule": name, "bands": b,
                           "constant_over_schedule": error(work, const) / best,
                           "taylor_over_schedule": error(work, np.array(coefficients(b, beta))) / best}
                    rows.append(row)
                    print(f"| {steps} | {beta:g} | {name} | {b} | {row['constant_over_schedule']:.4f} | "
                          f"{row['taylor_over_schedule']:.4f} |", flush=True)
    print(f"({time.time() - t0:.0f} s)")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
