"""Step time of DiSK against DPSGD-GC on compare's model shape, in one process, arms interleaved.

    nice python benchmarks/disk_cost.py [--repeats 5] [--threads 1]

scatter-linear on Fashion-MNIST (81 x 7 x 7 scattering features, GroupNorm, Linear to 10 classes: 39,700
weights), B = 2048 (a fixed batch of 2048 random feature vectors: the cost depends on the shapes only),
micro-batches of 512, rows path as `clipbias compare` runs it. Arms: dpsgd; disk with the defaults
(kappa 0.7, gamma 0.5: c = 6/7, gradients at two points); disk with gamma = (1 - kappa)/kappa (c = 1, one
point). Each arm runs one warm-up step, then `--repeats` rounds of 3 steps each, the arms interleaved;
the minimum per step over the rounds is reported, and its ratio to dpsgd's.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.models.scatter import ScatterLinear

ARMS = {"dpsgd": ("dpsgd", {}), "disk (c = 6/7)": ("disk", {}),
        "disk (c = 1)": ("disk", {"kappa": 0.7, "disk_gamma": 0.3 / 0.7})}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    engines = {}
    for label, (algo, extra) in ARMS.items():
        torch.manual_seed(0)
        m = ScatterLinear((1, 28, 28), 10)
        x = torch.randn(2048, *m.input_shape, generator=g)
        y = torch.randint(0, 10, (2048,), generator=g)
        e = DPEngine(m, algo, n=60000, batch_size=2048, epochs=3, noise_multiplier=0.89, noise_seed=1,
                     config=AlgoConfig(lr=26, clip=0.054, momentum=0.9, extra=extra), max_physical_batch=512)
        idx = torch.arange(2048)
        for _ in range(2):  # warm-up; the second step of disk is the first at two points
            e.step(x, y, idx)
        engines[label] = (e, x, y, idx)
    best = {k: float("inf") for k in engines}
    for _ in range(a.repeats):
        for label, (e, x, y, idx) in engines.items():
            t0 = time.perf_counter()
            for _ in range(3):
                e.step(x, y, idx)
            best[label] = min(best[label], (time.perf_counter() - t0) / 3)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"CPU: {cpu}; torch {torch.__version__}; {a.threads} thread(s); min over {a.repeats} rounds of 3 steps")
    print("| arm | s/step | vs dpsgd |")
    print("| --- | --- | --- |")
    for label, t in best.items():
        print(f"| {label} | {t:.3f} | {t / best['dpsgd']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
