"""DP training of a GPT-2-style language model at a scale the rows path cannot hold.

``clipbias.models.gpt.GPT()`` (vocabulary 50257, width 512, 4 layers, context 64: d = 64.1M
parameters, random init) on random token sequences (the content does not change time or memory),
expected Poisson batch B = 128 sequences of 64 tokens: B x d = 8.2e9, so the rows path would hold a
[B, d] float32 matrix of 33 GB. ``dpsgd`` and ``dice`` run with the default ``--grad-path auto``
(which picks the fast path here: one micro-batch of rows would exceed 2 GiB), a non-private step
(plain autograd, mean loss) is the baseline. Each arm runs in a fresh process (peak RSS is per
process); the first step is a warm-up, the median of the rest is reported. With ``--device cuda``
the memory is the GPU's peak allocation (``torch.cuda.max_memory_allocated``) and the table has
Opacus' ghost clipping (``opacus-ghost``, when ``import opacus`` works) as a reference. Usage::

    python benchmarks/gpt_scale.py --steps 3 --batch-size 128 --out benchmarks/results/gpt_scale/gpt_scale.json
    python benchmarks/gpt_scale.py --device cuda --steps 6 --arms nonprivate,dpsgd,dice,opacus-ghost
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def one(arm: str, b: int, steps: int, threads: int, device: str = "cpu") -> dict:
    import torch

    from clipbias.cli._common import tune_allocator
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine
    from clipbias.models.gpt import GPT, lm_loss
    tune_allocator()  # as the CLI does
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dev = torch.device(device)
    model = GPT().to(dev)
    d = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab, (b, model.context + 1), generator=g).to(dev)
    x, y, idx = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.arange(b)
    if arm == "nonprivate":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(x), y) / b
            loss.backward()
            opt.step()
            return float(loss)
        path = "autograd"
    elif arm == "opacus-ghost":  # Opacus' fast gradient clipping (double backward), the reference on a GPU
        from opacus import PrivacyEngine
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.utils.data.TensorDataset(torch.zeros(50_000, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=b)
        m, opt, crit, _ = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, criterion=torch.nn.CrossEntropyLoss(), grad_sample_mode="ghost")

        def step():
            opt.zero_grad(set_to_none=True)
            logits = m(x)
            loss = crit(logits.flatten(0, 1), y.flatten(), shape=(b, model.context))
            loss.backward()
            opt.step()
            return loss.item()
        path = "opacus ghost"
    else:
        eng = DPEngine(model, arm, n=50_000, batch_size=float(b), steps=steps, noise_multiplier=1.0,
                       accountant="rdp", loss_fn=lm_loss, config=AlgoConfig(lr=0.1, clip=1.0), max_physical_batch=b)
        path = eng.grad_path_note
        tune_allocator(eng.fast is None)  # as `clipbias train` does once the engine is built

        def step():
            return float(eng.step(x, y, idx).mean())
    cuda = dev.type == "cuda"
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())  # float(...) / .item() synchronises a GPU step
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"arm": arm, "path": path, "B": b, "d": d, "B_x_d": b * d, "tokens_per_step": b * model.context,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "step_s": statistics.median(times[1:] or times), "step_s_all": times, "mean_loss": losses,
            "peak_gb": peak, "peak_rss_gb": peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="nonprivate,dpsgd,dice")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (memory: peak RSS on the CPU, peak allocation on a GPU)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.batch_size, a.steps, a.threads, a.device)))
        return
    rows = []
    print(f"{'arm':<11} {'B x d':>8} {'s/step':>7} {'x non-private':>14} {'peak GB':>12}  path ({a.device}; peak {'GPU allocation' if a.device != 'cpu' else 'RSS'})")
    for arm in a.arms.split(","):
        r = subprocess.run([sys.executable, __file__, "--one", arm, "--batch-size", str(a.batch_size), "--steps",
                            str(a.steps), "--threads", str(a.threads), "--device", a.device], capture_output=True, text=True)
        if r.returncode:
            print(f"{arm:<11} failed: {(r.stderr.strip().splitlines() or ['killed: out of memory'])[-1]}")
            continue
        x = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append(x)
        base = rows[0]["step_s"] if rows[0]["arm"] == "nonprivate" else None
        ratio = f"{x['step_s'] / base:.2f}" if base else "-"
        print(f"{arm:<11} {x['B_x_d']:>8.2g} {x['step_s']:>7.1f} {ratio:>14} {x['peak_gb']:>12.2f}  {x['path']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
