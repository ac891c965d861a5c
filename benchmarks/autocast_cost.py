"""What ``DPEngine(autocast=torch.bfloat16)`` saves against float32: time per private step and peak memory.

Models: ``gpt`` (``clipbias.models.gpt.GPT``, vocabulary 4096, context 64, width 256, 2 layers, 4
heads: 3.7M parameters; next-token loss per sequence, B = 32), ``gpt512`` (vocabulary 8192, width 512, 4
layers: 21M parameters, B = 16) and ``cnn`` (the Fashion-MNIST cnn, 26k parameters, B = 256). For each
model and gradient path (``fast``, ``rows``), and for a non-private step (one forward and backward of the
summed loss), the float32 and the bfloat16 step:

* time: both precisions in one process, their steps interleaved (the machine's load drifts alike for
  both), the median of ``--steps`` steps after one warm-up step each;
* memory: one fresh process per arm: the peak RSS of the steps (Linux's VmHWM, reset just before the
  first step) minus the RSS before it, what the steps themselves add.

Usage::

    python benchmarks/autocast_cost.py --models gpt,cnn --paths nonprivate,fast,rows --steps 5
    python benchmarks/autocast_cost.py --memory-only
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BATCH = {"gpt": 32, "gpt512": 16, "cnn": 256}


def _rss_gb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**30


def _reset_peak() -> None:
    """Linux: the peak RSS (VmHWM) restarts from the current RSS, so that a peak of the start-up (the
    imports, the engine's noise calibration) does not hide the steps' own."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _peak_gb() -> float:
    with open("/proc/self/status") as fh:
        kb = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    return kb / 2**20


def _setup(model_name: str):
    import torch
    from clipbias.models import build_model
    from clipbias.models.gpt import GPT, lm_loss
    torch.set_num_threads(2)
    torch.manual_seed(0)
    b = BATCH[model_name]
    if model_name in ("gpt", "gpt512"):
        vocab, width, layers = (4096, 256, 2) if model_name == "gpt" else (8192, 512, 4)
        model, T = GPT(vocab=vocab, context=64, width=width, layers=layers, heads=4), 64
        x = torch.randint(0, vocab, (b, T))
        return model, x, x.roll(-1, 1), lm_loss
    from clipbias.grads.rows import cross_entropy
    return build_model("cnn", (1, 28, 28), 10), torch.randn(b, 1, 28, 28), torch.randint(0, 10, (b,)), cross_entropy


def _stepper(model_name: str, path: str, dtype):
    """A function running one step of the arm (a fresh model each arm, the same initial weights)."""
    import torch
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine
    model, x, y, loss_fn = _setup(model_name)
    b = len(x)
    if path == "nonprivate":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
            with ctx:
                loss = loss_fn(model(x), y)  # the batch's summed loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    eng = DPEngine(model, "dpsgd", n=100 * b, batch_size=b, steps=10_000, noise_multiplier=1.0, accountant="rdp",
                   grad_path=path, autocast=dtype, loss_fn=loss_fn, max_physical_batch=b,
                   config=AlgoConfig(lr=1e-3, clip=1.0), noise_seed=0)
    idx = torch.arange(b)
    return lambda: eng.step(x, y, idx)


def _dtype(name: str):
    import torch
    return None if name == "float32" else torch.bfloat16


def one_memory(model_name: str, path: str, precision: str, steps: int) -> dict:
    """Peak RSS the steps add, in a fresh process."""
    warnings.simplefilter("ignore")
    step = _stepper(model_name, path, _dtype(precision))
    before = _rss_gb()
    _reset_peak()
    for _ in range(steps):
        step()
    return {"step_gb": round(_peak_gb() - before, 3)}


def interleaved_times(model_name: str, path: str, steps: int) -> dict:
    """Median seconds per step of float32 and bfloat16, their steps alternating in this process."""
    warnings.simplefilter("ignore")
    arms = {p: _stepper(model_name, path, _dtype(p)) for p in ("float32", "bfloat16")}
    times = {p: [] for p in arms}
    for p in arms:
        arms[p]()  # warm-up
    for _ in range(steps):
        for p, step in arms.items():
            t = time.perf_counter()
            step()
            times[p].append(time.perf_counter() - t)
    return {p: statistics.median(v) for p, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt,cnn")
    ap.add_argument("--paths", default="nonprivate,fast,rows")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--memory-only", action="store_true", help="skip the timing")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # model,path,precision: the memory of one arm
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one_memory(*a.one.split(","), steps=a.steps)))
        return
    from speed import cpu_description
    print(json.dumps(cpu_description()))
    print("| model | B | path | float32 s/step | bfloat16 s/step | time bf16/f32 | float32 step GB | "
          "bfloat16 step GB | memory bf16/f32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in a.models.split(","):
        for path in a.paths.split(","):
            t = {"float32": float("nan"), "bfloat16": float("nan")} if a.memory_only else \
                interleaved_times(m, path, a.steps)
            mem = {}
            for p in ("float32", "bfloat16"):
                r = subprocess.run([sys.executable, __file__, "--one", f"{m},{path},{p}", "--steps", "2"],
                                   capture_output=True, text=True, check=True)
                mem[p] = json.loads(r.stdout.strip().splitlines()[-1])["step_gb"]
            print(f"| {m} | {BATCH[m]} | {path} | {t['float32']:.3f} | {t['bfloat16']:.3f} | "
                  f"{t['bfloat16'] / t['float32']:.2f} | {mem['float32']:.3f} | {mem['bfloat16']:.3f} | "
                  f"{mem['bfloat16'] / max(mem['float32'], 1e-9):.2f} |", flush=True)


if __name__ == "__main__":
    main()
