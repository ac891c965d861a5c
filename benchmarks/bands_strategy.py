"""The expected total squared error of the iterates, ||A C^{-1}||_F^2, of the optimised banded strategy
(``--bands-strategy optimized``, clipbias/algorithms/band_strategy.py) against the Taylor coefficients
(the default), at the step counts of the Fashion-MNIST protocols, and the time to optimise.

    python benchmarks/bands_strategy.py --out benchmarks/results/bands_strategy/ratios.json

Both strategies have unit norm and the same accounting (the same noise multiplier), so the ratio is the
ratio of the noise variance the iterates receive, summed over the run. It also prints the error of
independent noise at the same multiplier (C = I) for scale.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from clipbias.algorithms.band_strategy import error, optimize
from clipbias.algorithms.bands import coefficients

# (name, steps): compare's protocol (60 000 examples, B = 2048, 3 epochs: 29 steps an epoch), the same
# batch for 40 epochs, and the long protocol (B = 8192, 40 epochs of 7 steps; b q <= 1 needs b <= 7)
SETTINGS = [("compare, 3 epochs, B 2048", 87), ("40 epochs, B 2048", 1160), ("long, 40 epochs, B 8192", 280)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bands", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--momenta", nargs="+", type=float, default=[0.0, 0.9])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for name, steps in SETTINGS:
        for beta in args.momenta:
            for b in args.bands:
                t0 = time.perf_counter()
                opt = optimize(b, steps, beta)
                dt = time.perf_counter() - t0
                e_opt, e_tay = error(opt, steps, beta), error(coefficients(b, beta), steps, beta)
                e_ind = error((1.0,), steps, beta)
                rows.append({"protocol": name, "steps": steps, "momentum": beta, "bands": b,
                             "error_optimized": e_opt, "error_taylor": e_tay, "error_independent": e_ind,
                             "ratio_optimized_over_taylor": e_opt / e_tay, "seconds": dt, "coefs": list(opt)})
                print(f"{name:26s} T={steps:5d} beta={beta:3.1f} b={b:2d}: optimized / taylor {e_opt / e_tay:.4f}  "
                      f"taylor / independent {e_tay / e_ind:.4f}  ({dt:.2f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
