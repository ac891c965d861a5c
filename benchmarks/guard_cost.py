"""The state guard's cost (clipbias.engine.guard, docs/privacy.md "The guard at every door"): one snapshot and
one snapshot-and-compare on BERT-base (random weights, 109M parameters), and the guard's share of a rows-path
step of a small CNN at B = 256 (median step time with the guard against the same engine with it switched off,
the arms interleaved in one process).

    PYTHONPATH=. python benchmarks/guard_cost.py [--reps 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.engine import guard as g


def bert(reps: int) -> None:
    try:
        import transformers
    except ImportError:
        print("BERT-base: transformers is not installed")
        return
    model = transformers.BertForSequenceClassification(transformers.BertConfig())
    guard = g.StateGuard(model)
    snap, both = [], []
    for _ in range(reps):
        t = time.perf_counter()
        guard.snapshot()
        snap.append(time.perf_counter() - t)
        t = time.perf_counter()
        with guard.watching(intercept=False):
            pass
        both.append(time.perf_counter() - t)
    n = sum(p.numel() for p in model.parameters())
    print(f"BERT-base ({n / 1e6:.0f}M parameters, {len(list(model.modules()))} modules): snapshot "
          f"{statistics.median(snap) * 1e3:.1f} ms, snapshot and compare {statistics.median(both) * 1e3:.1f} ms")


class _Off:
    error = None
    listen = (frozenset(), None)


@contextlib.contextmanager
def _off(self, intercept=True, since=None):
    yield _Off()


def cnn(reps: int) -> None:
    x, y = torch.randn(2048, 1, 28, 28), torch.randint(0, 10, (2048,))
    engines = {}
    for arm in ("guard", "off"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 5), nn.ReLU(),
                              nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 10))
        engines[arm] = DPEngine(model, "dpsgd", n=2048, batch_size=256, steps=10 * reps + 10, noise_multiplier=1.0,
                                config=AlgoConfig(lr=0.01, clip=1.0), grad_path="rows")
    real, times = g.StateGuard.watching, {"guard": [], "off": []}
    for rep in range(reps + 1):
        for arm, eng in engines.items():
            g.StateGuard.watching = real if arm == "guard" else _off
            idx = eng.sampler.sample()
            t = time.perf_counter()
            eng.step(x[idx], y[idx], idx)
            if rep:  # (the first step of each arm warms up)
                times[arm].append(time.perf_counter() - t)
    g.StateGuard.watching = real
    on, off = statistics.median(times["guard"]), statistics.median(times["off"])
    print(f"cnn, rows path, B = 256: {on * 1e3:.1f} ms a step with the guard, {off * 1e3:.1f} ms without "
          f"({on / off:.3f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    bert(args.reps)
    cnn(args.reps)


if __name__ == "__main__":
    main()
