"""Cross-check of ``--bands-strategy optimized`` (clipbias/algorithms/band_strategy.py) against
jax_privacy's banded Toeplitz optimiser (``matrix_factorization.toeplitz.optimize_banded_toeplitz``,
mean squared error on the prefix-sum workload, i.e. momentum 0; it has no momentum workload).

jax-privacy is not a clipbias dependency: install it into a throwaway folder and run in two steps
(the first under that folder's own numpy, the second in clipbias's environment):

    pip install --target /tmp/jaxp jax-privacy jax
    PYTHONPATH=/tmp/jaxp python benchmarks/bands_strategy_jax.py jax --out /tmp/jaxp_coefs.json
    python benchmarks/bands_strategy_jax.py compare --jax /tmp/jaxp_coefs.json \
        --out benchmarks/results/bands_strategy/jax_privacy.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CASES = [(87, 4), (87, 8), (280, 8), (1160, 16)]  # (steps, bands), momentum 0


def run_jax(out: Path) -> None:
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax_privacy
    from jax_privacy.matrix_factorization import toeplitz
    rows = []
    for n, b in CASES:
        t0 = time.perf_counter()
        c = toeplitz.optimize_banded_toeplitz(n, b)
        rows.append({"steps": n, "bands": b, "coefs": [float(x) for x in c], "seconds": time.perf_counter() - t0,
                     "jax_privacy": jax_privacy.__version__ if hasattr(jax_privacy, "__version__") else "?"})
        print(rows[-1], flush=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")


def compare(jax_file: Path, out: Path) -> None:
    from clipbias.algorithms.band_strategy import error, optimize
    from clipbias.algorithms.bands import coefficients
    rows = []
    for r in json.loads(jax_file.read_text()):
        n, b = r["steps"], r["bands"]
        ours = optimize(b, n, 0.0)
        e_ours, e_jax, e_tay = error(ours, n), error(r["coefs"], n), error(coefficients(b), n)
        diff = max(abs(x - y) for x, y in zip(ours, r["coefs"]))
        rows.append({**r, "clipbias": list(ours), "error_clipbias": e_ours, "error_jax_privacy": e_jax,
                     "error_taylor": e_tay, "max_coef_difference": diff})
        print(f"T={n:5d} b={b:2d}: clipbias / jax_privacy error {e_ours / e_jax:.8f}, max |c diff| {diff:.2e}, "
              f"clipbias / taylor {e_ours / e_tay:.4f}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")


def two_step_main(run_jax, compare) -> None:
    """The two steps of a jax_privacy cross-check (also ``blt_jax.py``'s): ``jax --out F`` under jax-privacy's
    own folder, then ``compare --jax F --out G`` in clipbias's environment."""
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["jax", "compare"])
    ap.add_argument("--jax", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    run_jax(args.out) if args.step == "jax" else compare(args.jax, args.out)


if __name__ == "__main__":
    two_step_main(run_jax, compare)
