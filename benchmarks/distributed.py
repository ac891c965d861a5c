"""Throughput of `clipbias train` on 1 and 2 CPU processes (issue 15, docs/results.md).

Arms: one process with 1 thread, one process with 2 threads, and `torchrun --standalone
--nproc-per-node 2` with 1 thread per process; the same run (same seed, --reproducible-noise, a fixed
noise multiplier) each time. Training time per epoch is read off results.json (`epoch_time_s`: the
steps only, without evaluation), as examples per second. Usage:

    python benchmarks/distributed.py [--data fashion-mnist --model cnn --subset 12000 --epochs 2] OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def arm(name: str, procs: int, threads: int, args: argparse.Namespace) -> dict:
    out = Path(args.out) / name
    train = ["train", "--data", args.data, "--model", args.model, "--algo", args.algo, "--noise-multiplier", "1",
             "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", "0.5",
             "--subset", str(args.subset), "--seed", "0", "--reproducible-noise", "--quiet",
             "--threads", str(threads), "--out", str(out), "--overwrite", "--json"]
    if procs == 1:
        cmd = [sys.executable, "-m", "clipbias", *train]
    else:
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(procs),
               "-m", "clipbias", *train]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    res = json.loads((out / "results.json").read_text())
    times = [h["epoch_time_s"] for h in res["history"]]
    examples = res["n"] * res["sample_rate"] * res["steps"]  # expected examples processed
    return {"arm": name, "processes": procs, "threads_per_process": threads, "world_size": res["world_size"],
            "steps": res["steps"], "train_s": sum(times), "examples_per_s": examples / sum(times),
            "ms_per_step": 1000 * sum(times) / res["steps"], "epsilon": res["epsilon"],
            "test_accuracy": res["test_accuracy"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--data", default="fashion-mnist")
    p.add_argument("--model", default="cnn")
    p.add_argument("--algo", default="dpsgd")
    p.add_argument("--subset", type=int, default=12000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    args = p.parse_args()
    rows = [arm("1p-1t", 1, 1, args), arm("1p-2t", 1, 2, args), arm("2p-1t", 2, 1, args)]
    Path(args.out, "summary.json").write_text(json.dumps(rows, indent=1))
    print("| arm | processes x threads | ms/step | examples/s | x 1p-1t | epsilon | test acc |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['arm']} | {r['processes']} x {r['threads_per_process']} | {r['ms_per_step']:.1f} | "
              f"{r['examples_per_s']:.0f} | {r['examples_per_s'] / rows[0]['examples_per_s']:.2f} | "
              f"{r['epsilon']:.4f} | {r['test_accuracy']:.4f} |")


if __name__ == "__main__":
    main()
