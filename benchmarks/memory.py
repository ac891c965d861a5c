"""Peak memory and step time of one private step, rows path vs fast path, on a wide MLP.

A 784-4096-4096-10 MLP has d = 20.0M parameters: the rows path holds a [B, d] float32 matrix
(B x 80 MB), the fast path per-layer activations and output gradients only. Each configuration runs
in a fresh process (peak RSS is per process). Usage::

    python benchmarks/memory.py --batch-sizes 16,64,256 --paths rows,fast
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(path: str, b: int, steps: int = 3) -> dict:
    import torch
    from torch import nn

    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 4096), nn.Tanh(), nn.Linear(4096, 4096), nn.Tanh(),
                          nn.Linear(4096, 10))
    d = sum(p.numel() for p in model.parameters())
    eng = DPEngine(model, "dpsgd", n=60000, batch_size=float(b), steps=steps, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.1, clip=1.0), noise_seed=0, max_physical_batch=b, grad_path=path,
                   accountant="rdp")
    x, y = torch.randn(b, 1, 28, 28), torch.randint(0, 10, (b,))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step(x, y, torch.arange(b))
        times.append(time.perf_counter() - t0)
    return {"path": path, "B": b, "d": d, "B_x_d": b * d, "step_s": sorted(times)[len(times) // 2],
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="16,64,256")
    p.add_argument("--paths", default="rows,fast")
    p.add_argument("--one", nargs=2, metavar=("PATH", "B"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]))))
        return
    print(f"{'path':<5} {'B':>4} {'B x d':>10} {'s/step':>7} {'peak RSS GB':>12}")
    for b in map(int, a.batch_sizes.split(",")):
        for path in a.paths.split(","):
            r = subprocess.run([sys.executable, __file__, "--one", path, str(b)], capture_output=True, text=True)
            if r.returncode:
                why = (r.stderr.strip().splitlines() or [f"killed (exit {r.returncode}): out of memory"])[-1]
                print(f"{path:<5} {b:>4} {b * 20_037_642:>10.3g}  failed: {why}")
                continue
            x = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"{path:<5} {b:>4} {x['B_x_d']:>10.3g} {x['step_s']:>7.2f} {x['peak_rss_gb']:>12.2f}")


if __name__ == "__main__":
    main()
