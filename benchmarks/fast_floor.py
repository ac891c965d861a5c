"""How fast a fast-path step could be: the same per-example kernels with nothing else around them.

    python benchmarks/fast_floor.py [--model cnn] [--batch-size 256] [--threads 2] [--reps 30] [--out F.json]
    python benchmarks/fast_floor.py --phases   # then the library step's time by phase (100 more steps)

Three arms, interleaved step by step on the same batches (so a neighbour's load hits them alike):

* ``nonprivate``: ``cross_entropy(model(x), y).backward(); opt.step()``;
* ``floor``: the fast path's arithmetic written straight, with none of its checks: one forward with
  hooks on the Linear/Conv layers, ``autograd.grad`` to their outputs, each convolution's per-example
  weight gradients by the kernel ``clipbias.grads.conv_rows`` picks, float32 norms, clip factors, the
  clipped sums, ``torch.randn`` noise (not secret: a floor, not a private step) and an SGD update;
* ``fast``: ``DPEngine(..., "dpsgd", grad_path="fast")``, the library's step.

Then, per convolution, the per-example kernel's time against the batched weight-gradient kernel that
the non-private step runs instead (same multiply-adds, one product over the whole batch). The
``floor`` arm's ratio to ``nonprivate`` is what removing every check, every float64 rounding bound
and the secret noise would leave; the kernel table says how much of it is the per-example products
themselves. Only models of Linear and Conv2d layers (the Tramer & Boneh cnn, the MLP).

``--phases``: the library's step timed by phase (its functions wrapped with timers, so the numbers
include a few microseconds of wrapping each): what it spends beyond the floor, and where.
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
from torch.nn import functional as F

from clipbias.cli._common import tune_allocator
from clipbias.config import AlgoConfig
from clipbias.data.catalog import load_dataset
from clipbias.engine.core import DPEngine
from clipbias.grads.conv_rows import conv_weight_rows
from clipbias.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import cpu_description  # noqa: E402


def _layers(model: nn.Module) -> list[nn.Module]:
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    trainable = {id(p) for m in layers for p in m.parameters(recurse=False)}
    if any(id(p) not in trainable for p in model.parameters()):
        raise SystemExit("fast_floor: the floor arm handles models whose parameters are all in Linear and Conv2d layers")
    return layers


def _inputs_and_output_grads(model: nn.Module, layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor):
    """One forward with hooks on ``layers`` and ``autograd.grad`` of the summed per-example losses to
    their outputs: (each layer's input, each layer's output gradient in ``layers``' order)."""
    acts, outs = {}, {}

    def hook(m, inp, out):
        acts[m], outs[m] = inp[0].detach(), out
    handles = [m.register_forward_hook(hook) for m in layers]
    try:
        losses = F.cross_entropy(model(x), y, reduction="none")
    finally:
        for h in handles:
            h.remove()
    return acts, torch.autograd.grad(losses.sum(), [outs[m] for m in layers])


def _floor(model: nn.Module, b: int, lr: float, clip: float = 1.0):
    """The straight-line step (module doc): same kernels as the fast path, no checks, no bounds."""
    layers, params = _layers(model), list(model.parameters())

    def step(x, y, idx):
        acts, grads = _inputs_and_output_grads(model, layers, x, y)
        sq, parts = torch.zeros(x.shape[0]), []
        for m, g in zip(layers, grads):
            a = acts[m]
            if isinstance(m, nn.Conv2d):
                pe, gb = conv_weight_rows(m, a, g).flatten(1), g.sum((2, 3))
                sq += pe.square().sum(1)
            else:
                pe, gb = None, g
                sq += a.square().sum(1) * g.square().sum(1)
            sq += gb.square().sum(1)
            parts.append((m, a, pe, gb))
        s = clip / sq.sqrt().clamp_min(clip)
        flat = []
        for m, a, pe, gb in parts:
            flat.append((s @ pe) if pe is not None else ((gb * s[:, None]).t() @ a).reshape(-1))
            flat.append(s @ gb)
        total = torch.cat(flat)
        total += clip * torch.randn(total.shape)
        total /= b
        with torch.no_grad():
            for p, u in zip(params, total.split([p.numel() for p in params])):
                p.add_(u.view_as(p), alpha=-lr)
    return step


def _nonprivate(model: nn.Module, lr: float):
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(x, y, idx):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def _fast(model: nn.Module, n: int, b: int, lr: float):
    eng = DPEngine(model, "dpsgd", n=n, batch_size=float(b), steps=10**6, noise_multiplier=1.0,
                   config=AlgoConfig(lr=lr, clip=1.0), noise_seed=0, max_physical_batch=b, accountant="rdp",
                   grad_path="fast")
    return lambda x, y, idx: eng.step(x, y, idx)


def _best(f, reps: int = 25) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _kernels(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[dict]:
    """Per convolution: ms of its per-example weight gradients (the chosen kernel) and of the batched
    weight gradient over the same inputs and output gradients."""
    layers = [m for m in _layers(model) if isinstance(m, nn.Conv2d)]
    acts, grads = _inputs_and_output_grads(model, layers, x, y)
    rows = []
    for m, g in zip(layers, grads):
        a = acts[m]
        per_example = _best(lambda: conv_weight_rows(m, a, g))
        batched = _best(lambda: torch.ops.aten.convolution_backward(
            g, a, m.weight, None, list(m.stride), list(m.padding), list(m.dilation), False, [0, 0], 1,
            [False, True, False]))
        rows.append({"layer": repr(m), "per_example_ms": per_example, "batched_ms": batched,
                     "macs_per_example": g[0, 0].numel() * m.weight.numel()})
    return rows


_PHASES = {  # label -> (module, attribute path) of the library functions timed by --phases
    "forward and backward to the layer outputs": ("clipbias.grads.fast", "BookKeeping._backward"),
    "per-layer rules (per-example kernels, norms, rounding bounds)": ("clipbias.grads.fast", "_rule"),
    "structural proof": ("clipbias.grads.separable", "proven"),
    "secret noise snapped onto its grid": ("clipbias.step.noise", "snapped_gaussian"),
    "check of the step's arguments": ("clipbias.engine.core", "check_step"),
    "finite-norm checks": ("clipbias.engine.core", "check_finite_norms"),
    "model check": ("clipbias.grads.fast", "check_model"),
    "graph check": ("clipbias.grads.fast_checks", "RuntimeChecks.check_graph"),
    "per-example losses": ("clipbias.grads.fast_losses", "PerExampleLosses.__call__"),
    "ghost plan": ("clipbias.grads.fast", "ghost_plan"),
    "clipped sums": ("clipbias.grads.layers.linear", "Matrix.sums"),
}


def _phases(model: nn.Module, n: int, b: int, lr: float, batches: list) -> dict[str, float]:
    """ms per step of each ``_PHASES`` entry in the library's fast ``dpsgd`` step, and of the whole step."""
    import importlib
    spent: dict[str, float] = dict.fromkeys(_PHASES, 0.0)
    saved = []
    for label, (module, path) in _PHASES.items():
        owner = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        f = owner.__dict__[name]

        def timed(*args, _f=f, _label=label, **kw):
            t = time.perf_counter()
            try:
                return _f(*args, **kw)
            finally:
                spent[_label] += time.perf_counter() - t
        saved.append((owner, name, f))
        setattr(owner, name, timed)
    try:
        step = _fast(model, n, b, lr)
        for x, y, idx in batches[:5]:
            step(x, y, idx)
        for k in spent:
            spent[k] = 0.0
        t = time.perf_counter()
        for x, y, idx in batches[5:]:
            step(x, y, idx)
        total = time.perf_counter() - t
    finally:
        for owner, name, f in saved:
            setattr(owner, name, f)
    steps = len(batches) - 5
    return {"whole step": 1e3 * total / steps, **{k: 1e3 * v / steps for k, v in spent.items()}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--phases", action="store_true", help="also time the library's step by phase (100 steps)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    tune_allocator()
    ds = load_dataset("fashion-mnist")
    n, b, lr = ds.num_train, a.batch_size, 0.1

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return build_model(a.model, ds.input_shape, ds.num_classes)
    steps = {"nonprivate": _nonprivate(fresh(), lr), "floor": _floor(fresh(), b, lr), "fast": _fast(fresh(), n, b, lr)}
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for rep in range(a.warmup + a.reps):
        idx = torch.randperm(n, generator=gen)[:b]
        x, y = ds.x_train[idx], ds.y_train[idx]
        for arm, step in steps.items():
            t0 = time.perf_counter()
            step(x, y, idx)
            if rep >= a.warmup:
                times[arm].append(time.perf_counter() - t0)
    rows = {arm: {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts)} for arm, ts in times.items()}
    base = rows["nonprivate"]["median_ms"]
    for r in rows.values():
        r["vs_nonprivate"] = r["median_ms"] / base
    kernels = _kernels(fresh(), x, y)
    cpu = cpu_description()
    out = {"model": a.model, "batch_size": b, "threads": a.threads, "reps": a.reps, "torch": torch.__version__,
           "cpu": cpu, "load_1min": os.getloadavg()[0], "rows": rows, "kernels": kernels}
    print(f"CPU: {cpu['name']} ({', '.join(cpu['flags']) or 'no AVX2'}; torch kernels {cpu['torch_capability']}; "
          f"{cpu['cores']} cores), load {out['load_1min']:.2f}")
    print(f"{a.model}, B = {b}, {a.threads} threads, {a.reps} reps (medians)")
    print(f"{'arm':<12} {'ms/step':>8} {'min':>6} {'x non-private':>14}")
    for arm, r in rows.items():
        print(f"{arm:<12} {r['median_ms']:8.2f} {r['min_ms']:6.2f} {r['vs_nonprivate']:14.2f}")
    extra = 0.0
    for k in kernels:
        extra += k["per_example_ms"] - k["batched_ms"]
        gmacs = b * k["macs_per_example"] / 1e6
        print(f"{k['layer']}: per-example {k['per_example_ms']:.2f} ms ({gmacs / k['per_example_ms']:.0f} GMAC/s), "
              f"batched weight gradient {k['batched_ms']:.2f} ms ({gmacs / k['batched_ms']:.0f} GMAC/s)")
    print(f"non-private + the per-example kernels' extra time: {base + extra:.2f} ms ({(base + extra) / base:.2f}x)")
    if a.phases:
        batches = []
        for _ in range(105):
            idx = torch.randperm(n, generator=gen)[:b]
            batches.append((ds.x_train[idx], ds.y_train[idx], idx))
        out["phases_ms"] = _phases(fresh(), n, b, lr, batches)
        print("the library's fast step by phase, ms/step (nested phases are inside the larger ones):")
        for k, v in out["phases_ms"].items():
            print(f"  {k:<64} {v:7.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
