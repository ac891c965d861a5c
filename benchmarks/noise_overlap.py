"""Whether drawing the noise in a thread while the forward and backward run (issue "Speed step 3", noise off the
critical path) saves time on this machine's CPU: the secret normals of a 2M-parameter noise draw, three
forward-backward passes of an MLP at B = 256, both one after the other and both at once (medians over the reps).

    PYTHONPATH=. python benchmarks/noise_overlap.py [--reps 5] [--threads 2] [--count 2000000]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from torch import nn

from clipbias.randomness import SecretKey
from clipbias.randomness.draws import normals
from clipbias.randomness.key import Purpose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--count", type=int, default=2_000_000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    key = SecretKey.of(None)
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x, y = torch.randn(256, 784), torch.randint(0, 10, (256,))

    def noise():
        normals(key, Purpose.NOISE, 0, 0, args.count)

    def work():
        for _ in range(3):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()

    def both():
        thread = threading.Thread(target=noise)
        thread.start()
        work()
        thread.join()

    def timed(fn):
        out = []
        for _ in range(args.reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out) * 1e3

    tn, tw, tb = timed(noise), timed(work), timed(both)
    print(f"noise {tn:.1f} ms, forward-backward {tw:.1f} ms: one after the other {tn + tw:.1f} ms, at once "
          f"{tb:.1f} ms ({(tn + tw - tb) / tn * 100:.0f} % of the noise saved)")


if __name__ == "__main__":
    main()
