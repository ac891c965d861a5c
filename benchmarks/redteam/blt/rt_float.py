"""(c) Float rounding of the streamed recursion: does ``BLTNoise`` release (before its noise) the exact C v?

The stage's noiseless release ``x_t = c_0 (v_t + sum_i omega_i s_{i,t})``, ``s_{i,t+1} = theta_i s_{i,t} + v_t``
(float64), is read by running the stage with ``snapped_gaussian`` replaced by the identity; the reference is
the dense C v in extended precision (numpy longdouble, 64-bit mantissa on x86). Reported: the largest
``|x_t - (C v)_t| / (|C| |v|)_t`` over t < T and the coordinates, where ``(|C| |v|)_t = sum_j |C_tj| |v_j|``;
also the round trip of the inverse (g = C^{-1} x against v: the updates the optimizer would get without
noise), ``|g_t - v_t| / max |v|``. Inputs: i.i.d. normals, all ones (s grows to 1 / (1 - theta)), and signs
alternating per step, R = 16 coordinates, T = 1,000 and 5,000 steps of the strategy (extended past its planned
T; ``--long`` adds T = 20,000: about 50 s a row, the dense reference is O(T^2)).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/redteam/blt/rt_float.py
"""

from __future__ import annotations

import os
import sys
import time
from unittest import mock

import numpy as np
import torch

os.environ.setdefault("CLIPBIAS_CACHE", "off")

from clipbias.step import noise  # noqa: E402
from clipbias.algorithms import blt  # noqa: E402
from clipbias.randomness import SecretKey  # noqa: E402


def streamed(b: blt.BLT, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, g): the stage's noiseless releases and its outputs, T x R."""
    stage = noise.BLTNoise(1.0, SecretKey.from_seed(0), b)
    xs, gs = [], []

    def identity(x, std, key, draw, *a, **k):
        xs.append(x.clone())
        return x.clone()

    with mock.patch.object(noise, "snapped_gaussian", identity):
        for t in range(len(v)):
            gs.append(stage(torch.from_numpy(v[t])).numpy())
            stage.commit()
    return torch.stack(xs).numpy(), np.stack(gs)


def exact(b: blt.BLT, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(C v, |C| |v|) in longdouble: the Toeplitz product as a convolution (O(T^2 R))."""
    T = len(v)
    om, th = np.array(b.omegas, np.longdouble), np.array(b.thetas, np.longdouble)
    k = np.arange(T - 1, dtype=np.longdouble)
    c = np.concatenate(([np.longdouble(1)], (om[:, None] * th[:, None] ** k).sum(0))) * np.longdouble(b.scale)
    vl = v.astype(np.longdouble)
    cv, av = np.zeros_like(vl), np.zeros_like(vl)
    for t in range(T):
        cv[t] = c[:t + 1][::-1] @ vl[:t + 1]
        av[t] = np.abs(c[:t + 1][::-1]) @ np.abs(vl[:t + 1])
    return cv, av


def main() -> None:
    rng = np.random.default_rng(0)
    strategies = {"optimize(87, 29, 0.9)": blt.optimize(87, 29, 0.9), "optimize(40, 4, 0.9)": blt.optimize(40, 4, 0.9),
                  "normalised((1, -0.95), (0.99, 0.9))": blt.normalised((1.0, -0.95), (0.99, 0.9), 4, 40),
                  "normalised((1, -1), (0.999, 0.998))": blt.normalised((1.0, -1.0), (0.999, 0.998), 4, 40)}
    print("| strategy | input | T | max rel. error of x vs C v | max |g - v| / max |v| | s |")
    print("|---|---|---|---|---|---|")
    for name, b in strategies.items():
        for T in (1000, 5000) + ((20000,) if "--long" in sys.argv else ()):
            for kind in ("normal", "ones", "alternating"):
                t0 = time.time()
                R = 16
                if kind == "normal":
                    v = rng.standard_normal((T, R))
                elif kind == "ones":
                    v = np.ones((T, R))
                else:
                    v = np.where(np.arange(T)[:, None] % 2 == 0, 1.0, -1.0) * np.ones((T, R))
                x, g = streamed(b, v)
                cv, av = exact(b, v)
                rel = float(np.max(np.abs(x.astype(np.longdouble) - cv) / av))
                rt = float(np.max(np.abs(g - v)) / np.abs(v).max())
                print(f"| {name} | {kind} | {T} | {rel:.2e} | {rt:.2e} | {time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
