"""Which operators a private fast-path step spends its time on beyond a non-private step (cnn by default).

    python benchmarks/step_ops.py [--model cnn] [--batch-size 256] [--threads 2] [--rows 25]

torch.profiler over 20 steps of each (after 5 warm-up): every operator's self CPU time per step, both
arms, sorted by the difference; then each arm's wall time per step without the profiler, and the
part of it spent outside operators (Python, mostly), from the two. Fixed noise multiplier, seeded
key (a measurement, not a private run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

from clipbias.cli._common import tune_allocator
from clipbias.config import AlgoConfig
from clipbias.data.catalog import load_dataset
from clipbias.engine.core import DPEngine
from clipbias.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=25)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tune_allocator()
    ds = load_dataset("fashion-mnist")
    b = a.batch_size
    torch.manual_seed(0)
    plain = build_model(a.model, ds.input_shape, ds.num_classes)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def nonprivate(x, y, idx):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        opt.step()
    torch.manual_seed(0)
    engine = DPEngine(build_model(a.model, ds.input_shape, ds.num_classes), "dpsgd", n=ds.num_train,
                      batch_size=float(b), steps=10**6, noise_multiplier=1.0, config=AlgoConfig(lr=0.1, clip=1.0),
                      noise_seed=0, max_physical_batch=b, accountant="rdp", grad_path="fast")
    gen = torch.Generator().manual_seed(1)

    def batches(k: int) -> list:
        out = []
        for _ in range(k):
            idx = torch.randperm(ds.num_train, generator=gen)[:b]
            out.append((ds.x_train[idx], ds.y_train[idx], idx))
        return out
    arms = {"non-private": nonprivate, "dpsgd fast": engine.step}
    ops, wall = {}, {}
    for name, step in arms.items():
        for x, y, i in batches(5):
            step(x, y, i)
        work = batches(20)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for x, y, i in work:
                step(x, y, i)
        ops[name] = {e.key: (e.self_cpu_time_total / 20e3, e.count / 20) for e in prof.key_averages()}
        times = []
        for x, y, i in work:
            t = time.perf_counter()
            step(x, y, i)
            times.append(time.perf_counter() - t)
        wall[name] = 1e3 * statistics.median(times)
    (n0, o0), (n1, o1) = ops.items()
    print(f"{a.model}, B = {b}, {a.threads} threads; operator self CPU ms/step (calls/step)")
    print(f"{'operator':44s} {n0:>16s} {n1:>16s} {'difference':>11s}")
    keys = sorted(set(o0) | set(o1), key=lambda k: -(o1.get(k, (0, 0))[0] - o0.get(k, (0, 0))[0]))
    for k in keys[:a.rows]:
        (t0, c0), (t1, c1) = o0.get(k, (0, 0)), o1.get(k, (0, 0))
        print(f"{k:44s} {t0:9.3f} ({c0:4.0f}) {t1:9.3f} ({c1:4.0f}) {t1 - t0:+11.3f}")
    for name in arms:
        inside = sum(t for t, _ in ops[name].values())
        print(f"{name}: {wall[name]:.2f} ms/step wall, {inside:.2f} ms in operators (profiled), "
              f"about {wall[name] - inside:.2f} ms outside them")


if __name__ == "__main__":
    main()
