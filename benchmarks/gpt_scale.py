"""DP training of a GPT-2-style language model at a scale the rows path cannot hold.

``clipbias.models.gpt.GPT()`` (vocabulary 50257, width 512, 4 layers, context 64: d = 64.1M
parameters, random init) on random token sequences (the content does not change time or memory),
expected Poisson batch B = 128 sequences of 64 tokens: B x d = 8.2e9, so the rows path would hold a
[B, d] float32 matrix of 33 GB. ``dpsgd`` and ``dice`` run with the default ``--grad-path auto``
(which picks the fast path here: one micro-batch of rows would exceed 2 GiB), a non-private step
(plain autograd, mean loss) is the baseline. Each arm runs in a fresh process (peak RSS is per
process); the first step is a warm-up, the median of the rest is reported. Usage::

    python benchmarks/gpt_scale.py --steps 3 --batch-size 128 --out benchmarks/results/gpt_scale.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def one(arm: str, b: int, steps: int, threads: int) -> dict:
    import torch

    from clipbias.cli._common import tune_allocator
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine
    from clipbias.models.gpt import GPT, lm_loss
    tune_allocator()  # as the CLI does
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPT()
    d = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab, (b, model.context + 1), generator=g)
    x, y, idx = tokens[:, :-1], tokens[:, 1:], torch.arange(b)
    if arm == "nonprivate":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(x), y) / b
            loss.backward()
            opt.step()
            return float(loss)
        path = "autograd"
    else:
        eng = DPEngine(model, arm, n=50_000, batch_size=float(b), steps=steps, noise_multiplier=1.0,
                       accountant="rdp", loss_fn=lm_loss, config=AlgoConfig(lr=0.1, clip=1.0), max_physical_batch=b)
        path = eng.grad_path_note

        def step():
            return float(eng.step(x, y, idx).mean())
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    return {"arm": arm, "path": path, "B": b, "d": d, "B_x_d": b * d, "tokens_per_step": b * model.context,
            "step_s": statistics.median(times[1:] or times), "step_s_all": times, "mean_loss": losses,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="nonprivate,dpsgd,dice")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.batch_size, a.steps, a.threads)))
        return
    rows = []
    print(f"{'arm':<11} {'B x d':>8} {'s/step':>7} {'x non-private':>14} {'peak RSS GB':>12}  path")
    for arm in a.arms.split(","):
        r = subprocess.run([sys.executable, __file__, "--one", arm, "--batch-size", str(a.batch_size), "--steps",
                            str(a.steps), "--threads", str(a.threads)], capture_output=True, text=True)
        if r.returncode:
            print(f"{arm:<11} failed: {(r.stderr.strip().splitlines() or ['killed: out of memory'])[-1]}")
            continue
        x = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append(x)
        base = rows[0]["step_s"] if rows[0]["arm"] == "nonprivate" else None
        ratio = f"{x['step_s'] / base:.2f}" if base else "-"
        print(f"{arm:<11} {x['B_x_d']:>8.2g} {x['step_s']:>7.1f} {ratio:>14} {x['peak_rss_gb']:>12.2f}  {x['path']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
