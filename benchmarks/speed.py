"""Step time of private training against non-private training (and Opacus, when importable).

One process, real Fashion-MNIST batches, the arms interleaved repetition by repetition (so a
neighbour's load hits every arm alike), medians with min-max. Each arm does one optimizer step on a
batch of B examples:

* ``nonprivate``: ``loss.mean().backward(); opt.step()`` on the same model (the floor);
* ``dpsgd``, ``dice``, ``normalized``: ``DPEngine.step`` through the public API (per-example
  gradients, clipping, noise, accounting state; noise multiplier fixed, no calibration); the
  ``-fast`` arms with ``grad_path="fast"`` (per-layer norms and book-keeping sums, no rows);
  ``dpsgd-fast-noprobe`` is a diagnostic, not a configuration a user can choose: the fast path with
  its per-step soundness probe skipped, to measure what the probe costs;
* any engine arm with ``-prefetch`` or ``-noprefetch`` appended (``dpsgd-fast-prefetch``): the noise's normals drawn
  in a background thread during the step (``DPEngine(noise_prefetch=True)``) or on the critical path (``False``);
  without either, the engine's default (``noise_prefetch=None``: by size, ``clipbias.randomness.prefetch``);
* ``opacus-hooks`` (and ``opacus-ghost``, ``opacus-ew``: expanded weights): Opacus' ``PrivacyEngine.make_private`` on the same model,
  when ``import opacus`` works (``pip install opacus`` or ``PYTHONPATH`` to a copy; not a clipbias
  dependency);
* any arm with ``:nchw`` appended (``nonprivate:nchw``): the model's convolution weights stored
  NCHW-contiguous instead of channels-last (clipbias's convolutional models store them channels-last:
  ``clipbias.models.simple.channels_last``), to measure what the layout does.

Usage (docs/results.md, "Speed and memory")::

    python benchmarks/speed.py --model cnn --batch-size 256 --threads 2 --reps 15
    python benchmarks/speed.py --model resnet20-gn --batch-size 64 --threads 2 --reps 7
    python benchmarks/speed.py --model scatter-linear --batch-size 2048 --threads 2 --reps 10   # features in, cached
    python benchmarks/speed.py --model cnn --batch-size 256 --device cuda --reps 30   # GPU: synchronised steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from clipbias.cli._common import tune_allocator
from clipbias.config import AlgoConfig
from clipbias.data.catalog import load_dataset
from clipbias.engine.core import DPEngine
from clipbias.models import build_model


def _nonprivate(model: nn.Module, lr: float):
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(x, y, idx):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def _engine(model: nn.Module, algo: str, n: int, b: int, lr: float, max_physical_batch: int):
    prefetch = True if algo.endswith("-prefetch") else False if algo.endswith("-noprefetch") else None
    algo = algo.removesuffix("-noprefetch").removesuffix("-prefetch")
    probe = not algo.endswith("-noprobe")  # a diagnostic arm, not a configuration: the probe's cost
    algo = algo.removesuffix("-noprobe")
    fast = algo.endswith("-fast")  # "dpsgd-fast": the book-keeping fast path
    eng = DPEngine(model, algo.removesuffix("-fast"), n=n, batch_size=float(b), steps=10**6, noise_multiplier=1.0,
                   config=AlgoConfig(lr=lr, clip=1.0), noise_seed=0, max_physical_batch=max_physical_batch,
                   accountant="rdp", grad_path="fast" if fast else "rows", noise_prefetch=prefetch)

    if not probe:  # the per-step soundness check skipped: what the rest of the fast path costs
        eng.fast._check_examples = lambda *args, **kwargs: None

    def step(x, y, idx):
        eng.step(x, y, idx)
    return step


def _opacus(model: nn.Module, n: int, b: int, lr: float, mode: str):
    try:
        from opacus import PrivacyEngine
    except ImportError:
        return None
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.utils.data.TensorDataset(torch.zeros(n, 1), torch.zeros(n, dtype=torch.long))
    loader = torch.utils.data.DataLoader(data, batch_size=b)
    pe = PrivacyEngine()
    common = dict(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                  poisson_sampling=False)
    if mode == "ghost":  # fast gradient clipping: the criterion runs the double backward
        m, opt, crit, _ = pe.make_private(**common, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost")

        def step(x, y, idx):
            opt.zero_grad(set_to_none=True)
            crit(m(x), y).backward()
            opt.step()
        return step
    m, opt, _ = pe.make_private(**common, grad_sample_mode=mode)

    def step(x, y, idx):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return step


def cpu_description() -> dict:
    """The CPU the table was measured on: its name, the vector extensions that change the ratios
    (AVX2 / AVX-512 / AMX), the kernel level torch dispatches to, and the cores this process may use."""
    name, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux
        import platform
        name = platform.processor() or platform.machine()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"name": name, "flags": isa, "torch_capability": torch.backends.cpu.get_cpu_capability(), "cores": cores}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--arms", default="nonprivate,dpsgd,dpsgd-fast,dice,dice-fast,normalized,opacus-hooks,opacus-ghost,opacus-ew")
    p.add_argument("--device", default="cpu", help="cpu or cuda (each timed step ends with a synchronisation)")
    p.add_argument("--no-tune", action="store_true", help="skip the allocator tuning of the CLI")
    p.add_argument("--out", default=None, help="write the table as JSON here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    tuned = False if a.no_tune else tune_allocator()
    ds = load_dataset("fashion-mnist")
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n, b, lr = ds.num_train, a.batch_size, 0.1
    steps = {}
    for arm in a.arms.split(","):
        torch.manual_seed(0)
        model = build_model(a.model, ds.input_shape, ds.num_classes).to(dev)
        name, _, layout = arm.partition(":")
        if layout == "nchw":
            model = model.to(memory_format=torch.contiguous_format)
        elif layout:
            p.error(f"unknown layout {layout!r} in arm {arm!r} (only :nchw)")
        if name == "nonprivate":
            steps[arm] = _nonprivate(model, lr)
        elif name.startswith("opacus-"):
            fn = _opacus(model, n, b, lr, name.split("-", 1)[1])
            if fn is None:
                print(f"skipping {arm}: opacus is not importable", file=sys.stderr)
                continue
            steps[arm] = fn
        else:
            steps[arm] = _engine(model, name, n, b, lr, max_physical_batch=b)
    gen = torch.Generator().manual_seed(1)
    inputs = ds.x_train
    if hasattr(model, "preprocess"):  # a model of features (ScatterNet): the first 16 384 images' features
        n = min(n, 16384)
        inputs = model.preprocess(ds.x_train[:n], f"{ds.name}-train-first{n}")
    times: dict[str, list[float]] = {k: [] for k in steps}
    for rep in range(a.warmup + a.reps):
        idx = torch.randperm(n, generator=gen)[:b]
        x, y = inputs[idx].to(dev), ds.y_train[idx].to(dev)
        for arm, step in steps.items():
            sync()
            t0 = time.perf_counter()
            step(x, y, idx)
            sync()
            if rep >= a.warmup:
                times[arm].append(time.perf_counter() - t0)
    def same_layout(arm: str, name: str) -> str:  # the arm ``name`` measured with ``arm``'s layout
        return name + (":" + arm.partition(":")[2] if ":" in arm else "")
    rows = {arm: {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts)}
            for arm, ts in times.items()}
    for arm, r in rows.items():  # each against the non-private step and Opacus's hooks of its own layout
        base, ref = (rows.get(same_layout(arm, k), {}).get("median_ms") for k in ("nonprivate", "opacus-hooks"))
        r["vs_nonprivate"] = r["median_ms"] / base if base else None
        r["vs_opacus_hooks"] = r["median_ms"] / ref if ref else None
    cpu = cpu_description()
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    out = {"model": a.model, "batch_size": b, "device": gpu or "cpu", "threads": a.threads, "reps": a.reps, "allocator_tuned": tuned,
           "torch": torch.__version__, "cpu": cpu, "load_1min": os.getloadavg()[0], "rows": rows}
    print(f"CPU: {cpu['name']} ({', '.join(cpu['flags']) or 'no AVX2'}; torch kernels {cpu['torch_capability']}; "
          f"{cpu['cores']} cores), load {out['load_1min']:.2f}")
    if gpu:
        print(f"GPU: {gpu} (torch {torch.__version__}, TF32 matmul {torch.backends.cuda.matmul.allow_tf32})")
    print(f"{a.model}, B = {b}, {a.threads} threads, {a.reps} reps (medians, min-max), allocator tuned: {tuned}")
    print(f"{'arm':<20} {'ms/step':>9} {'min-max':>15} {'x non-private':>14} {'x opacus hooks':>15}")
    for arm, r in rows.items():
        vs = f"{r['vs_nonprivate']:.2f}" if r["vs_nonprivate"] else "-"
        vo = f"{r['vs_opacus_hooks']:.2f}" if r["vs_opacus_hooks"] else "-"
        print(f"{arm:<20} {r['median_ms']:9.1f} {r['min_ms']:7.1f}-{r['max_ms']:<7.1f} {vs:>14} {vo:>15}")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
