"""What secret randomness costs per step: ChaCha20 keystream, Poisson inclusion and the snapped
Gaussian noise, against a whole DP-SGD step of the same size, in one process, interleaved.

Arms, repeated ``--reps`` times in turn (medians; the CPU is named):

* ``step``: a whole ``DPEngine.step`` of ``dpsgd`` (cnn on Fashion-MNIST-shaped inputs, B = 256,
  N = 60,000, rows path) on the batch the sampler drew;
* ``sample``: one Poisson batch of N = 60,000 (``PoissonSampler._draw``: 480 kB of keystream);
* ``noise``: the release of one update, ``snapped_gaussian`` of the model's d parameters;
* ``torch-randn`` / ``torch-rand64``: what the recoverable design drew instead (``torch.randn(d)``,
  ``torch.rand(N, dtype=float64)`` from a seeded generator), for reference;
* with ``--large D``: the noise of a D-parameter model (64.1M: the GPT of ``benchmarks/gpt_scale.py``).

Usage (docs/results.md, "Secret randomness")::

    python benchmarks/randomness_cost.py --reps 30 --threads 2 --large 64100000
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from clipbias.cli._common import tune_allocator
from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.models import build_model
from clipbias.randomness import SecretKey, snapped_gaussian


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
        return " ".join(f for f in ("avx2", "avx512f", "aes", "sha_ni") if f in flags)
    except (OSError, StopIteration):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--large", type=int, default=0, help="also time the noise of a model of this many parameters")
    ap.add_argument("--json", default=None, help="write the medians here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tune_allocator()  # as the CLI and benchmarks/speed.py run
    torch.manual_seed(0)
    n, b = 60_000, 256
    model = build_model("cnn", (1, 28, 28), 10)
    d = sum(p.numel() for p in model.parameters())
    eng = DPEngine(model, "dpsgd", n=n, batch_size=float(b), steps=10 ** 6, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.1, clip=1.0), accountant="rdp", grad_path="rows")
    x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    key, std = SecretKey.generate(), 1.0 / b
    v = torch.randn(d)
    gen = torch.Generator().manual_seed(0)

    def step():
        idx = eng.sampler.sample()
        eng.step(x[idx], y[idx], idx)

    arms = {"step": step, "sample": eng.sampler._draw,
            "noise": lambda: snapped_gaussian(v, std, key, 0).float(),
            "torch-randn": lambda: torch.randn(d, generator=gen),
            "torch-rand64": lambda: torch.rand(n, generator=gen, dtype=torch.float64)}
    for f in arms.values():  # warm-up
        f()
    times = {k: [] for k in arms}
    for _ in range(a.reps):
        for k, f in arms.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {"cpu": cpu_name(), "flags": cpu_flags(), "threads": a.threads, "torch": torch.__version__,
           "d": d, "n": n, "B": b, "ms": med,
           "secret_share_of_step": (med["sample"] + med["noise"]) / med["step"]}
    if a.large:
        big = torch.zeros(a.large)
        snapped_gaussian(big[:1000], 1.0, key, 0)
        t = time.perf_counter()
        snapped_gaussian(big, 1.0, key, 1).float()
        out["large"] = {"d": a.large, "noise_s": time.perf_counter() - t}
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
