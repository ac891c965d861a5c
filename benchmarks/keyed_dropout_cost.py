"""What keyed dropout costs per step: a ``DPEngine.step`` of an MLP with dropout, its masks keyed per
example (``clipbias.randomness.forward``) against torch's own dropout (the step with the keyed scope
replaced by a plain one: the design before it, position-assigned masks from torch's generator), in
one process, interleaved; and the same MLP without dropout (the mode's pass-through cost alone).

Arms, each a whole step on the batch the sampler drew (medians of ``--reps`` rounds; the CPU is named):

* ``keyed``: the library's step (dropout masks from the keystream);
* ``torch``: the same step with ``forward.keyed`` a no-op (torch's dropout, not private);
* ``keyed-p0``: the same model with p = 0 (the mode on, nothing drawn).

Usage::

    python benchmarks/keyed_dropout_cost.py --reps 30 --threads 1 --path rows
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.randomness import forward

N, D, WIDTH, CLASSES = 4096, 128, 256, 10

from speed import cpu_description  # benchmarks/speed.py: name, vector extensions, cores


def engine(p: float, path: str, batch: int) -> DPEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, WIDTH), nn.ReLU(), nn.Dropout(p), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                          nn.Dropout(p), nn.Linear(WIDTH, CLASSES))
    return DPEngine(model, "dpsgd", n=N, batch_size=batch, steps=10 ** 6, noise_multiplier=1.0, grad_path=path,
                    config=AlgoConfig(lr=0.01, clip=1.0))


@contextlib.contextmanager
def _plain(*args, **kwargs):
    yield None


def timed(eng: DPEngine, x: torch.Tensor, y: torch.Tensor, plain: bool) -> float:
    idx = eng.sampler.sample()
    saved = forward.keyed  # every caller reaches it as forward.keyed: replacing it here replaces it there
    forward.keyed = _plain if plain else saved
    try:
        t = time.perf_counter()
        eng.step(x[idx], y[idx], idx)
        return (time.perf_counter() - t) * 1e3
    finally:
        forward.keyed = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--path", choices=("rows", "fast"), default="rows")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    x, y = torch.randn(N, D), torch.randint(0, CLASSES, (N,))
    arms = {"keyed": (engine(0.1, a.path, a.batch), False), "torch": (engine(0.1, a.path, a.batch), True),
            "keyed-p0": (engine(0.0, a.path, a.batch), False)}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(a.reps + 2):  # two warm-up rounds
        for name, (eng, plain) in arms.items():
            ms = timed(eng, x, y, plain)
            if r >= 2:
                times[name].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"cpu": cpu_description(), "threads": a.threads, "path": a.path, "batch": a.batch,
                      "ms_per_step": {k: round(v, 2) for k, v in med.items()},
                      "keyed_over_torch": round(med["keyed"] / med["torch"], 3),
                      "p0_over_torch": round(med["keyed-p0"] / med["torch"], 3)}))


if __name__ == "__main__":
    main()
