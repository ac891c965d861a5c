"""Cross-check of BLT noise (clipbias/algorithms/blt.py) against jax_privacy's BLT
(``matrix_factorization.buffered_toeplitz``): on shared cases (prefix-sum workload, i.e. momentum 0;
min-separation k = clipbias's classes; every participation allowed) it compares

* the sensitivity: jax_privacy's ``toeplitz.minsep_sensitivity_squared`` of its BLT's coefficients against
  clipbias's ``class_sums`` of the same coefficients;
* the objective: jax_privacy's ``LossFn.build_min_sep(error="mean")`` loss of its BLT against clipbias's
  ``objective / T`` of the same BLT (mean squared error x sensitivity^2);
* the optimisers: that objective at clipbias's ``optimize`` against jax_privacy's ``optimize``, both with 2
  buffers.

jax-privacy is not a clipbias dependency: install it into a throwaway folder and run in two steps:

    pip install --target /tmp/jaxp jax-privacy jax
    PYTHONPATH=/tmp/jaxp python benchmarks/blt_jax.py jax --out /tmp/jaxp_blt.json
    PYTHONPATH=. python benchmarks/blt_jax.py compare --jax /tmp/jaxp_blt.json \\
        --out benchmarks/results/noise_error/blt_jax_privacy.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

CASES = [(87, 29), (280, 7), (1160, 29)]  # (steps, classes = min separation), momentum 0


def run_jax(out: Path) -> None:
    import jax
    jax.config.update("jax_enable_x64", True)
    from jax_privacy.matrix_factorization import buffered_toeplitz as bt
    from jax_privacy.matrix_factorization import toeplitz
    rows = []
    for n, k in CASES:
        t0 = time.perf_counter()
        blt = bt.optimize(n=n, min_sep=k, max_participations=None, error="mean", min_buffers=2, max_buffers=2)
        seconds = time.perf_counter() - t0
        coefs = blt.toeplitz_coefs(n)
        loss = bt.LossFn.build_min_sep(n=n, error="mean", min_sep=k, max_participations=None).loss(blt)
        rows.append({"steps": n, "classes": k, "thetas": [float(x) for x in blt.buf_decay],
                     "omegas": [float(x) for x in blt.output_scale], "loss": float(loss),
                     "sensitivity_squared": float(toeplitz.minsep_sensitivity_squared(coefs, k, None, n)),
                     "seconds": seconds})
        print(rows[-1], flush=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")


def compare(jax_file: Path, out: Path) -> None:
    import numpy as np

    from clipbias.algorithms import blt
    rows = []
    for r in json.loads(jax_file.read_text()):
        n, k = r["steps"], r["classes"]
        s2 = float(blt.class_sums(blt._column(np.array(r["omegas"]), np.array(r["thetas"]), n), k).max())
        theirs = blt.objective(r["omegas"], r["thetas"], n, k, 0.0) / n
        t0 = time.perf_counter()
        mine = blt.optimize(n, k, 0.0)
        seconds = time.perf_counter() - t0
        ours = blt.objective(mine.omegas, mine.thetas, n, k, 0.0) / n
        rows.append({**r, "clipbias_sensitivity_squared": s2, "clipbias_loss_of_jax_blt": theirs,
                     "clipbias_omegas": list(mine.omegas), "clipbias_thetas": list(mine.thetas),
                     "clipbias_loss": ours, "clipbias_seconds": seconds})
        print(f"T={n:5d} k={k:2d}: sensitivity^2 {s2 / r['sensitivity_squared']:.10f} x jax_privacy's, loss of its "
              f"BLT {theirs / r['loss']:.10f} x, clipbias's optimum / jax_privacy's {ours / r['loss']:.4f} "
              f"({seconds:.2f} s against {r['seconds']:.1f} s)", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    from bands_strategy_jax import two_step_main  # benchmarks/ is the script's own folder on sys.path
    two_step_main(run_jax, compare)
