"""Every algorithm at hyperparameters selected with the same budget: ScatterNet + linear on
Fashion-MNIST at epsilon 3 (``--epsilon``; delta 1e-5, Poisson, PLD), momentum 0.9, two protocols:

* ``--protocol compare``: `clipbias compare`'s, 3 epochs of expected batch size 2048 (87 steps);
* ``--protocol long``: Tramer & Boneh's, 40 epochs of expected batch size 8192 (280 steps).

Stage 1, selection: for each algorithm the same number of grid points (``--steps`` x ``--clips``),
each trained on 50 000 training images and scored on the other 10 000 (``--validation 10000``),
seed 0; the raw weights and their EMA (``--ema``, fixed beforehand per protocol) are both scored.
The grid is in step = lr * clip and clip (with almost every example clipped, the step sets the
update's size and the clip decides which examples are clipped); ``normalized`` bounds each example
by 1 whatever the clip, so its points are as many learning rates spanning the same steps. The best
validation accuracy picks (lr, clip, raw or EMA). **This choice reads the private training split
outside the guarantee** (a validation split, as published DP results do; `clipbias tune` is the
accounted alternative, docs/results.md); the test split plays no part in it.

Stage 2: the chosen configuration trains on all 60 000 images with each seed (``--seeds``), every run
under its own secret key, certified at epsilon 3; test accuracy mean ± std of the chosen weights.

Runs are ``clipbias train`` processes, ``--jobs`` at a time with one thread each; finished runs
(``OUT/runs/<label>/results.json``) are skipped on a re-run. An algorithm may carry its own settings,
``NAME:flag=value,...`` (``disk:kappa=0.9,disk-gamma=1``): one more row with the same grid. Writes
``OUT/selection.json`` and prints a markdown table::

    python benchmarks/selection.py --protocol long --out benchmarks/results/selection_long          # ~45 min on 2 cores
    python benchmarks/selection.py --protocol compare --algos dpsgd dice disk normalized adaptive \\
        inner-outer p-avg --out benchmarks/results/selection_compare                              # ~25 min
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

COMMON = ["--data", "fashion-mnist", "--model", "scatter-linear", "--epsilon", "3", "--delta", "1e-5",
          "--momentum", "0.9", "--threads", "1", "--quiet"]
PROTOCOLS = {  # epochs and expected batch size, EMA decay (fixed beforehand), default steps (lr * clip)
    "compare": (["--epochs", "3", "--batch-size", "2048"], 0.9, [0.7, 1.4, 2.8, 5.6]),
    "long": (["--epochs", "40", "--batch-size", "8192"], 0.95, [0.8, 1.6, 3.2]),
}
OWN = {"inner-outer": ["--momentum", "0"]}  # its outer momentum replaces the base optimizer's


def grid(algo: str, steps: list[float], clips: list[float]) -> list[tuple[float, float]]:
    """(lr, clip) points: lr = step / clip, or for ``normalized`` (bound 1) as many learning rates
    log-spaced over the same steps, at the middle clip (which it does not read)."""
    if variant(algo)[0] != "normalized":
        return [(s / c, c) for s in steps for c in clips]
    n, lo, hi = len(steps) * len(clips), min(steps) / 2 ** 0.5, max(steps) * 2 ** 0.5
    return [(lo * (hi / lo) ** (i / (n - 1)), clips[len(clips) // 2]) for i in range(n)]


def variant(algo: str) -> tuple[str, list[str]]:
    """``"disk:kappa=0.9,disk-gamma=1"`` -> ``("disk", ["--kappa", "0.9", "--disk-gamma", "1"])``: an
    algorithm with some of its own settings fixed (a variant is one more entry of the table, with
    the same grid budget as the others)."""
    name, _, flags = algo.partition(":")
    return name, [t for kv in flags.split(",") if kv for t in (f"--{kv.split('=')[0]}", kv.split("=", 1)[1])]


def run(out: Path, proto: list[str], algo: str, lr: float, clip: float, ema: float, stage: str, seed: int) -> dict:
    label = algo.replace(":", "-").replace(",", "-").replace("=", "")
    d = out / "runs" / f"{stage}-{label}-lr{lr:.4g}-clip{clip:g}-s{seed}"
    if (d / "results.json").exists():
        return json.loads((d / "results.json").read_text())
    name, flags = variant(algo)
    argv = [sys.executable, "-m", "clipbias", "train", *COMMON, *proto, "--algo", name, "--lr", f"{lr:.6g}",
            "--clip", f"{clip:g}", "--ema", f"{ema:g}", "--seed", str(seed), "--out", str(d), "--overwrite",
            *OWN.get(name, []), *flags, *(["--validation", "10000"] if stage == "select" else [])]
    print(" ".join(argv[1:]), file=sys.stderr, flush=True)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return json.loads((d / "results.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", choices=sorted(PROTOCOLS), default="long")
    ap.add_argument("--algos", nargs="+", default=["dpsgd", "disk", "dice"])
    ap.add_argument("--steps", nargs="+", type=float, default=None, help="lr * clip values (default per protocol)")
    ap.add_argument("--clips", nargs="+", type=float, default=[0.025, 0.05, 0.1])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--select-only", action="store_true", help="stop after the validation grid (no test runs)")
    ap.add_argument("--epsilon", type=float, default=3.0, help="every run's certified epsilon (default 3)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    COMMON[COMMON.index("--epsilon") + 1] = f"{a.epsilon:g}"
    proto, ema, steps = PROTOCOLS[a.protocol]
    steps = a.steps or steps
    points = [(algo, lr, c) for algo in a.algos for lr, c in grid(algo, steps, a.clips)]
    with ThreadPoolExecutor(a.jobs) as pool:
        sel = list(pool.map(lambda g: run(a.out, proto, *g, ema, "select", 0), points))
    summary = {"protocol": " ".join(COMMON + proto), "ema": ema, "algos": {}}
    chosen = {}
    for algo in a.algos:
        pts = [(max(r["val_accuracy"], r["ema_val_accuracy"]), r["ema_val_accuracy"] > r["val_accuracy"], lr, c, r)
               for (al, lr, c), r in zip(points, sel) if al == algo]
        chosen[algo] = best = max(pts, key=lambda p: p[0])
        summary["algos"][algo] = {
            "grid": [{"lr": lr, "clip": c, "val_accuracy": r["val_accuracy"], "ema_val_accuracy": r["ema_val_accuracy"]}
                     for _, _, lr, c, r in pts],
            "chosen": {"lr": best[2], "clip": best[3], "weights": "ema" if best[1] else "raw", "val_accuracy": best[0]}}
    if a.select_only:  # the validation table alone (a search before the equal-budget table)
        print("| algorithm | lr | clip | val raw | val EMA |\n| --- | --- | --- | --- | --- |")
        for algo in a.algos:
            for g in summary["algos"][algo]["grid"]:
                print(f"| {algo} | {g['lr']:.4g} | {g['clip']:g} | {100 * g['val_accuracy']:.2f} | "
                      f"{100 * g['ema_val_accuracy']:.2f} |")
        (a.out / "selection.json").write_text(json.dumps(summary, indent=1))
        return
    finals = [(algo, chosen[algo][2], chosen[algo][3], s) for algo in a.algos for s in a.seeds]
    with ThreadPoolExecutor(a.jobs) as pool:
        fin = list(pool.map(lambda f: run(a.out, proto, *f[:3], ema, "final", f[3]), finals))
    print(f"protocol {a.protocol}: {summary['protocol']}, EMA {ema}")
    print("| algorithm | chosen on validation | test accuracy per seed | mean ± std | noise mult. | epsilon | certified |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for algo in a.algos:
        rs = [r for (al, *_), r in zip(finals, fin) if al == algo]
        ema_w = chosen[algo][1]
        accs = [100 * r["ema_test_accuracy" if ema_w else "test_accuracy"] for r in rs]
        m, sd = statistics.mean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0
        s = summary["algos"][algo]
        s["final"] = {"test_accuracy": accs, "mean": m, "std": sd,
                      "raw_test_accuracy": [100 * r["test_accuracy"] for r in rs],
                      "ema_test_accuracy": [100 * r["ema_test_accuracy"] for r in rs],
                      "noise_multiplier": rs[0]["noise_multiplier"], "epsilon": max(r["epsilon"] for r in rs),
                      "certified": all(r["certified"] for r in rs),
                      "s_per_epoch": statistics.mean(r["wall_time_per_epoch_s"] for r in rs)}
        c, f = s["chosen"], s["final"]
        print(f"| {algo} | lr {c['lr']:.4g}, clip {c['clip']:g}, {c['weights']} (val {100 * c['val_accuracy']:.2f}) | "
              f"{', '.join(f'{x:.2f}' for x in accs)} | **{m:.2f} ± {sd:.2f}** | {f['noise_multiplier']:.4g} | "
              f"{f['epsilon']:.3f} | {str(f['certified']).lower()} |")
    assert all(math.isfinite(s["final"]["mean"]) for s in summary["algos"].values())
    (a.out / "selection.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
