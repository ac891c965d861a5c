"""Peak memory and step time of one private step, rows path vs fast path (and a non-private step).

``--model mlp`` (default): a 784-4096-4096-10 MLP, d = 20.0M parameters: the rows path holds a
[B, d] float32 matrix (B x 80 MB), the fast path per-layer activations and output gradients only.
``--model cnn``: the Fashion-MNIST cnn (26k parameters). Each configuration runs in a fresh process
(peak RSS is per process); ``step GB`` is the peak RSS minus the RSS before the first step (the
interpreter, torch and the model), what the steps themselves add. Usage::

    python benchmarks/memory.py --batch-sizes 16,64,256 --paths rows,fast
    python benchmarks/memory.py --model cnn --batch-sizes 256 --paths nonprivate,rows,fast
    python benchmarks/memory.py --batch-sizes 64 --paths fast --noise plain,bands:3,bands:8,blt:8 --steps 10

``--noise``: the noise stage's state too: ``bands:b`` banded noise (2 (b - 1) float64 vectors of d), ``blt:k``
BLT noise in k classes (4 vectors whatever k); the batches then come from the engine's sampler.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_gb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**30


def one(model_name: str, path: str, b: int, steps: int = 3, noise: str = "plain") -> dict:
    import torch
    from torch import nn

    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine
    from clipbias.models import build_model
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10) if model_name == "cnn" else nn.Sequential(
        nn.Flatten(), nn.Linear(784, 4096), nn.Tanh(), nn.Linear(4096, 4096), nn.Tanh(), nn.Linear(4096, 10))
    d = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(b, 1, 28, 28), torch.randint(0, 10, (b,))
    if path == "nonprivate":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    else:
        kind, _, count = noise.partition(":")
        bands = int(count) if count else 1
        eng = DPEngine(model, "dpsgd", n=60000, batch_size=float(b), steps=steps, noise_multiplier=1.0,
                       config=AlgoConfig(lr=0.1, clip=1.0, momentum=0.9), noise_seed=0, max_physical_batch=4 * b,
                       grad_path=path, accountant="rdp", bands=bands,
                       bands_strategy="blt" if kind == "blt" else "taylor")
        xs, ys = torch.randn(4 * b, 1, 28, 28), torch.randint(0, 10, (4 * b,))

        def step():
            if bands == 1:
                eng.step(x, y, torch.arange(b))
                return
            idx = eng.sampler.sample()  # the class of the step (banded and BLT noise refuse other batches)
            eng.step(xs[:len(idx)], ys[:len(idx)], idx)
    before, times = _rss_gb(), []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"model": model_name, "path": path, "noise": noise, "B": b, "d": d, "B_x_d": b * d,
            "step_s": sorted(times)[len(times) // 2], "peak_rss_gb": peak, "step_gb": peak - before}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--batch-sizes", default="16,64,256")
    p.add_argument("--paths", default="rows,fast")
    p.add_argument("--noise", default="plain", help="plain, bands:b, blt:k, comma-separated (default plain)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--one", nargs=3, metavar=("PATH", "B", "NOISE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.model, a.one[0], int(a.one[1]), a.steps, a.one[2])))
        return
    print(f"{'path':<10} {'noise':<8} {'B':>4} {'B x d':>10} {'s/step':>7} {'peak RSS GB':>12} {'step GB':>8}")
    for b in map(int, a.batch_sizes.split(",")):
        for path in a.paths.split(","):
            for noise in a.noise.split(","):
                r = subprocess.run([sys.executable, __file__, "--model", a.model, "--steps", str(a.steps), "--one",
                                    path, str(b), noise], capture_output=True, text=True)
                if r.returncode:
                    why = (r.stderr.strip().splitlines() or [f"killed (exit {r.returncode}): out of memory"])[-1]
                    print(f"{path:<10} {noise:<8} {b:>4}  failed: {why}")
                    continue
                x = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"{path:<10} {noise:<8} {b:>4} {x['B_x_d']:>10.3g} {x['step_s']:>7.3f} {x['peak_rss_gb']:>12.2f} "
                      f"{x['step_gb']:>8.3f}")


if __name__ == "__main__":
    main()
