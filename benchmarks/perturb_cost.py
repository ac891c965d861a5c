"""What the pre-clipping perturbation (``--algo perturb``) costs per step against ``dpsgd``, in one
process, on the default protocol of ``clipbias compare``: scatter-linear (d = 39,700), B = 2048,
N = 60,000, lr 26, clip 0.054, momentum 0.9, rows path, 512 rows per micro-batch.

Arms, repeated ``--reps`` times in turn (medians and minima; the CPU is named):

* ``dpsgd`` and ``perturb``: a whole ``DPEngine.step`` on the batch the engine's sampler drew;
* ``draws``: the perturbation alone, ``keyed_normal`` of 2048 example indices x d.

The inputs are random scattering-shaped features (the content does not change the time); the
perturbation draws 2048 x 39,700 = 81.3M secret normals per step.

Usage (docs/results.md, "Speed and memory")::

    python benchmarks/perturb_cost.py --reps 5 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from clipbias.cli._common import tune_allocator
from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.models import build_model
from clipbias.randomness import Purpose, SecretKey, keyed_normal

try:
    from randomness_cost import cpu_flags, cpu_name
except ImportError:  # run as a module
    from benchmarks.randomness_cost import cpu_flags, cpu_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tune_allocator()  # as the CLI runs
    torch.manual_seed(0)
    n, b, pool = 60_000, 2048, 4096
    engines, d = {}, 0
    for algo in ("dpsgd", "perturb"):
        model = build_model("scatter-linear", (1, 28, 28), 10)
        d = sum(p.numel() for p in model.parameters())
        cfg = AlgoConfig(lr=26.0, clip=0.054, momentum=0.9, extra={"k": 0.01} if algo == "perturb" else {})
        engines[algo] = DPEngine(model, algo, n=n, batch_size=float(b), steps=10 ** 6, noise_multiplier=1.0,
                                 config=cfg, grad_path="rows")
    x = torch.randn(pool, *build_model("scatter-linear", (1, 28, 28), 10).input_shape)
    y = torch.randint(0, 10, (pool,))
    key, rows = SecretKey.generate(), list(range(b))

    def step(eng: DPEngine):
        idx = eng.sampler.sample()
        eng.step(x[idx % pool], y[idx % pool], idx)

    arms = {"dpsgd": lambda: step(engines["dpsgd"]), "perturb": lambda: step(engines["perturb"]),
            "draws": lambda: keyed_normal(key, Purpose.PERTURB, 0, rows, d)}
    for f in arms.values():  # warm-up
        f()
    wall = {k: [] for k in arms}
    cpu = {k: [] for k in arms}
    for _ in range(a.reps):
        for k, f in arms.items():
            t, c = time.perf_counter(), time.process_time()
            f()
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    med = {k: statistics.median(v) for k, v in wall.items()}
    out = {"cpu": cpu_name(), "flags": cpu_flags(), "threads": a.threads, "torch": torch.__version__,
           "d": d, "B": b, "normals_per_step": b * d,
           "wall_s_median": med, "wall_s_min": {k: min(v) for k, v in wall.items()},
           "cpu_s_median": {k: statistics.median(v) for k, v in cpu.items()},
           "perturb_over_dpsgd": med["perturb"] / med["dpsgd"],
           "perturb_over_dpsgd_cpu": statistics.median(cpu["perturb"]) / statistics.median(cpu["dpsgd"])}
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
