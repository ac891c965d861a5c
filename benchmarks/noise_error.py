"""The noise each correlated-noise mechanism puts on the iterates, at equal certified epsilon: the
expected total squared error ``z^2 ||A C^{-1}||_F^2`` (per coordinate, in units of (C / B)^2) of the T
iterates of SGD with momentum 0.9, as a ratio to DP-SGD's (C = I, its own z), for the Fashion-MNIST
protocols of docs/choosing.md (N = 60 000):

* ``dpsgd``: independent noise, the subsampled Gaussian at rate q for T steps;
* ``bands b``: banded noise (``--bands b``, optimised coefficients), the subsampled Gaussian at rate b q for
  ceil(T / b) steps (b q <= 1); 2 (b - 1) state vectors;
* ``blt``: BLT noise (``--bands k --bands-strategy blt``, k = floor(1 / q)), the Gaussian mechanism at the
  strategy's sensitivity over a class's participations, no amplification; 4 state vectors;
* ``toeplitz w (no amp.)``: the least-error Toeplitz strategy of width w >= k under the same sensitivity
  (sum of |C^T C| over a class's steps) and the same unamplified accounting as BLT: what bands wider than 1 / q
  could give without an amplification analysis (not a mechanism clipbias offers; computed here only).

    PYTHONPATH=. python benchmarks/noise_error.py --out benchmarks/results/noise_error/ratios.json   # ~2 min
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import minimize

from clipbias.algorithms import blt
from clipbias.algorithms.band_strategy import _error_and_grad, optimized, workload
from clipbias.privacy import AccountingSpec, calibrate

PROTOCOLS = {"compare": (2048, 3), "long": (8192, 40), "long-b2048": (2048, 40)}  # batch size, epochs
N, DELTA, BETA = 60_000, 1e-5, 0.9


def z_for(q: float, steps: int, eps: float, bands: int = 1, shape: blt.BLT | None = None) -> float:
    spec = AccountingSpec("gaussian", q, 0.0, bands=bands,
                          blt=(shape.scale, *shape.omegas, *shape.thetas) if shape else ())
    return calibrate(spec, eps, DELTA, steps)


def class_sums_t(c: torch.Tensor, classes: int) -> torch.Tensor:
    """``blt.class_sums`` in torch (for the gradient): the largest class's sum of |X_ij|."""
    t, out = len(c), torch.zeros(classes, dtype=torch.float64)
    for d in range(0, t, classes):
        prefix = torch.cumsum(c[:t - d] * c[d:], 0)
        j = torch.arange(d, t)
        out = out.index_add(0, j % classes, prefix[t - 1 - j].abs() * (1.0 if d == 0 else 2.0))
    return out.max()


def wide_toeplitz(width: int, steps: int, classes: int) -> float:
    """min over c (c_0 = 1, ``width`` coefficients) of ||A C^{-1}||^2 * max_l S_l: L-BFGS from the banded
    optimum's shape, from the identity and from BLT's column, the best kept."""
    a, w = workload(steps, BETA), np.arange(steps, 0, -1, dtype=np.float64)

    def f(free: np.ndarray) -> tuple[float, np.ndarray]:
        c = np.concatenate(([1.0], free))
        with np.errstate(over="ignore", invalid="ignore"):
            e, ge = _error_and_grad(c, a, w)
        if not (math.isfinite(e) and e > 0 and np.isfinite(ge).all()):
            return math.inf, np.zeros_like(free)
        ct = torch.tensor(np.concatenate((c, np.zeros(steps - width))), requires_grad=True)
        s = class_sums_t(ct, classes)
        s.backward()
        gs, sv = ct.grad.numpy()[:width], float(s.detach())
        return math.log(e) + math.log(sv), (ge / e + gs / sv)[1:]

    s = blt.optimize(steps, classes, BETA)
    starts = [np.zeros(width - 1), (s.column(width) / s.scale)[1:]]
    starts.append(np.array(optimized(min(width, classes), steps, BETA) + (0.0,) * (width - min(width, classes)))[1:]
                  / optimized(min(width, classes), steps, BETA)[0])
    best = math.inf
    for x0 in starts:
        r = minimize(f, x0, jac=True, method="L-BFGS-B", options={"maxiter": 3000, "maxcor": 30})
        best = min(best, math.exp(r.fun))
    return best


def rows(protocol: str, eps: float) -> list[dict]:
    batch, epochs = PROTOCOLS[protocol]
    q, per_epoch = batch / N, round(N / batch)
    steps, k = epochs * per_epoch, int(1 / (batch / N))
    a, w = workload(steps, BETA), np.arange(steps, 0, -1, dtype=np.float64)
    plain = float(w @ (a * a))
    z0 = z_for(q, steps, eps)
    base = z0 ** 2 * plain
    out = [{"mechanism": "dpsgd", "z": z0, "ratio": 1.0, "state_vectors": 0}]
    for b in (2, 3, 4, 8, 16, 24, 29):
        if b > k:
            continue
        c = optimized(b, steps, BETA)
        z = z_for(q, steps, eps, bands=b)
        out.append({"mechanism": f"bands {b}", "z": z, "ratio": z ** 2 * _error_and_grad(np.array(c), a, w)[0] / base,
                    "state_vectors": 2 * (b - 1)})
    s = blt.optimize(steps, k, BETA)
    z = z_for(q, steps, eps, bands=k, shape=s)
    out.append({"mechanism": f"blt (k = {k})", "z": z, "state_vectors": 2 * blt.BUFFERS,
                "ratio": z ** 2 * blt.error(s.omegas, s.thetas, steps, BETA) / s.scale ** 2 / base})
    zg = z  # the Gaussian mechanism's multiplier at unit sensitivity (BLT is normalised to Delta(T) = 1)
    for width in sorted({k, 2 * k, min(4 * k, steps), steps}):
        if width > steps or (width > 4 * k and steps > 300):
            continue
        out.append({"mechanism": f"toeplitz {width} (no amp.)", "z": None, "state_vectors": 2 * (width - 1),
                    "ratio": zg ** 2 * wide_toeplitz(width, steps, k) / base})
    for r in out:
        r.update(protocol=protocol, epsilon=eps, steps=steps, q=q, classes=k)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=list(PROTOCOLS))
    ap.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0, table = time.time(), []
    for p in a.protocols:
        for e in a.epsilons:
            table += rows(p, e)
    print("| protocol | T | epsilon | mechanism | z | state vectors | error / dpsgd's |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        z = f"{r['z']:.3f}" if r["z"] is not None else "-"
        print(f"| {r['protocol']} | {r['steps']} | {r['epsilon']:g} | {r['mechanism']} | {z} | {r['state_vectors']} "
              f"| {r['ratio']:.3f} |")
    print(f"({time.time() - t0:.0f} s)")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
