"""What accuracy each epsilon buys on the long protocol (ScatterNet + linear, Fashion-MNIST, 40 epochs,
B = 8192, momentum 0.9, EMA 0.95, Poisson sampling, PLD at delta 1e-5): DP-SGD with the noise
calibrated to each epsilon, the step (lr x clip) and the clip chosen per epsilon on the validation
split, then scored on the test split.

NOT library code: the loop is ``benchmarks/bands_prototype.py``'s (b = 1: DP-SGD; closed-form
per-example gradients of the linear head on the cached GroupNorm'ed scattering features), its
randomness seeded torch generators: an accuracy simulator, not a private run. It answers how far a
target accuracy is from a privacy budget: which epsilon this model needs to reach it.

    python benchmarks/epsilon_headroom.py --split val --epsilons 3 5 8 15 30 --out val.json
    python benchmarks/epsilon_headroom.py --split test --pick val.json --seeds 0 1 2 --out test.json

    python benchmarks/epsilon_headroom.py --table val.json test.json

``--split val`` trains on 50 000 images and scores the other 10 000 (the grid: ``--steps`` x
``--clips``); ``--split test --pick val.json`` trains each epsilon's best validation setting on all
60 000 and scores the test split; ``--table`` prints both as markdown, each epsilon's test accuracy
from the weights (raw or EMA) that scored higher on validation.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import numpy as np
import torch

import bands_prototype as bp

DELTA = 1e-5


@functools.lru_cache(None)
def calibrate(eps: float, q: float, steps: int) -> float:
    """Smallest z (to 1e-4 relative) with PLD epsilon(z) <= eps for ``steps`` Poisson-sampled Gaussian steps."""
    lo, hi = 0.2, 1.0
    while bp.epsilon(hi, q, steps) > eps:
        lo, hi = hi, hi * 2
    while hi / lo > 1 + 1e-4:
        mid = math.sqrt(lo * hi)
        if bp.epsilon(mid, q, steps) > eps:
            lo = mid
        else:
            hi = mid
    return hi


def best(rows: list[dict], eps: float) -> dict:
    """The validation row of seed 0 with the highest accuracy (raw or EMA) at ``eps``."""
    return max((r for r in rows if r["epsilon_target"] == eps and r["seed"] == 0), key=lambda r: max(r["raw"], r["ema"]))


def table(val_path: Path, test_path: Path) -> str:
    """Markdown: per epsilon, the setting chosen on validation and its test accuracy over seeds."""
    val, test = json.loads(val_path.read_text()), json.loads(test_path.read_text())
    lines = ["| epsilon | z | chosen on validation (val %) | test accuracy per seed | mean ± std |",
             "| --- | --- | --- | --- | --- |"]
    for eps in sorted({r["epsilon_target"] for r in test}):
        v = best(val, eps)
        which = "ema" if v["ema"] > v["raw"] else "raw"
        accs = [100 * r[which] for r in sorted(test, key=lambda r: r["seed"]) if r["epsilon_target"] == eps
                and (r["lr"], r["clip"]) == (v["lr"], v["clip"])]
        z = next(r["z"] for r in test if r["epsilon_target"] == eps)
        lines.append(f"| {eps:g} | {z:.3f} | lr {v['lr']:g}, clip {v['clip']:g}, {which.replace('ema', 'EMA')} "
                     f"({100 * v[which]:.2f}) | {', '.join(f'{a:.2f}' for a in accs)} | "
                     f"{np.mean(accs):.2f} ± {np.std(accs, ddof=1) if len(accs) > 1 else 0:.2f} % |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", nargs=2, type=Path, metavar=("VAL", "TEST"), help="print the table of two result files")
    ap.add_argument("--split", choices=["val", "test"], default="val")
    ap.add_argument("--epsilons", nargs="+", type=float, default=[3, 5, 8, 15, 30])
    ap.add_argument("--steps", nargs="+", type=float, default=[1.6, 3.2, 6.4], help="lr x clip")
    ap.add_argument("--clips", nargs="+", type=float, default=[0.025, 0.05, 0.1])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--pick", type=Path, help="--split test: the validation JSON to take each epsilon's setting from")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.table:
        print(table(*a.table))
        return
    if a.out is None:
        ap.error("--out is required (or --table VAL TEST)")
    torch.set_num_threads(a.threads)
    data = bp.load(test=a.split == "test")
    epochs, B, _, _, _ = bp.PROTOCOLS["long"]
    N = len(data["train"])
    T = epochs * max(1, round(N / B))
    q = B / N
    grid: dict[float, list[tuple[float, float]]] = {}
    if a.pick is not None:
        for eps in a.epsilons:
            v = best(json.loads(a.pick.read_text()), eps)
            grid[eps] = [(v["lr"], v["clip"])]
    else:
        grid = {eps: [(s / c, c) for s in a.steps for c in a.clips] for eps in a.epsilons}
    rows = json.loads(a.out.read_text()) if a.out.exists() else []
    done = {(r["epsilon_target"], r["lr"], r["clip"], r["seed"]) for r in rows}
    for eps, settings in grid.items():
        z = calibrate(eps, q, T)
        print(f"epsilon {eps:g}: z = {z:.4f} (q = {q:.4f}, T = {T})", flush=True)
        for lr, clip in settings:
            for seed in a.seeds:
                if (eps, lr, clip, seed) in done:
                    continue
                r = bp.train(data, "long", 1, "dpsgd", lr, clip, seed, np.array([1.0]), z)
                r.update(epsilon_target=eps, epsilon=bp.epsilon(z, q, T), split=a.split)
                rows.append(r)
                print(f"  lr {lr:g} clip {clip:g} seed {seed}: {a.split} raw {100 * r['raw']:.2f} "
                      f"EMA {100 * r['ema']:.2f} ({r['train_s']:.0f} s)", flush=True)
                a.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
