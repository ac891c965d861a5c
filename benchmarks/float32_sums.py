"""``sum_precision="float32"`` against the default float64: the proven inflation ``delta`` of
the sensitivity on real shapes, and the time of the fast path's clipped sums (every rule's ``sums``, the phase the
route changes), float64 and float32 interleaved in one process, medians over ``--rounds``.

Each model's rules come from one forward and backward of a fixed batch (``BookKeeping._rules``, the probe
included); then the two routes' sums run alternately on the same rules and clip factors (C = 1), and their
releases are compared (``max |f32 - f64| / ||f64||``); ``--rounds 0``: delta and the routes only. ``tiny``:
whole ``DPEngine.step`` calls of a small model whose first Linear runs over 32 positions on the ghost norm, at
32 times the batch size given, the two engines alternating.

    PYTHONPATH=.:benchmarks python benchmarks/float32_sums.py --models bert gpt2 resnet tiny --batch-sizes 8 32 \\
        --rounds 5 --out benchmarks/results/speed/float32_sums.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from clipbias.grads import fast, precision
from clipbias.grads.fast import BookKeeping
from clipbias.grads.layers.linear import Matrix, float32_sum_route
from clipbias.step.clip import Clip
from speed import cpu_description


def _sums(rules, S) -> list:
    with precision.full_float32():
        return [t for r in rules for t in r.sums(S)]


def sums_phase(name: str, b: int, rounds: int) -> dict:
    """The clipped sums of model ``name`` at batch ``b``: both routes' medians, delta, the routes taken."""
    if name in ("bert", "gpt2"):
        import hf_side_by_side as hf
        model, make = hf.build(name)
        loss = hf.Loss(name == "gpt2", "none")
        x, y = make(b)
        saved = None
    else:  # resnet20-gn at 32 x 32: its last stage's convolutions (8 x 8 positions) on the ghost norm
        from clipbias.models import build_model
        torch.manual_seed(0)
        model = build_model("resnet20-gn", (3, 32, 32), 10)
        from clipbias.grads.rows import cross_entropy as loss
        x, y = torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))
        saved, fast.FORMED_BYTES = fast.FORMED_BYTES, 0  # every layer that may take the ghost norm takes it
    try:
        bk = BookKeeping(model, loss)
        _, rules, _ = bk._rules(x, y)
    finally:
        if saved is not None:
            fast.FORMED_BYTES = saved
    norms = torch.sqrt(sum(r.sq for r in rules))
    S = Clip(1.0).scale(norms).unsqueeze(0)
    routes, delta = float32_sum_route(rules, 1.0)
    chosen = {j: r.sum32 for j, r in enumerate(rules) if isinstance(r, Matrix)}
    shapes = {}
    for j, route in routes.items():
        _, L, k = rules[j].a.shape
        o = rules[j].g.shape[2]
        shapes.setdefault(f"L={L} k={k} o={o}", {"layers": 0, "rho": precision.sum32_rho(L, k, o), "route": route})
        shapes[f"L={L} k={k} o={o}"]["layers"] += 1
    base = {"model": name, "batch": b, "delta": delta, "layers_float32": sum(v == "float32" for v in routes.values()),
            "ghost_layers": len(routes), "shapes": shapes}
    if rounds == 0:  # delta and the routes only
        return base
    times = {"float64": [], "float32": []}
    out = {}
    for _ in range(rounds + 1):  # the first round is a warm-up
        for arm in ("float64", "float32"):
            for j, r in enumerate(rules):
                if isinstance(r, Matrix):
                    r.sum32 = chosen[j] if arm == "float32" else None
            t = time.perf_counter()
            out[arm] = _sums(rules, S)
            times[arm].append(time.perf_counter() - t)
    f64 = torch.cat([t.reshape(-1).double() for t in out["float64"]])
    f32 = torch.cat([t.reshape(-1).double() for t in out["float32"]])
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {**base, "sums_s": med, "speedup": med["float64"] / med["float32"],
            "rel_diff": float((f32 - f64).abs().max() / f64.norm()), "rounds": rounds}


class _SumPositions(nn.Module):
    def forward(self, h):
        return h.sum(1)


def tiny_steps(b: int, rounds: int) -> dict:
    """Whole engine steps of a small positions model (Linear(256, 512) over 32 positions on the ghost norm, a
    one-position head), the float64 and float32 engines alternating."""
    from clipbias.config import AlgoConfig
    from clipbias.engine import DPEngine
    saved, fast.FORMED_BYTES = fast.FORMED_BYTES, -1
    try:
        engines = {}
        for sp in ("float64", "float32"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), _SumPositions(), nn.Linear(512, 10))
            engines[sp] = DPEngine(model, "dpsgd", n=b * (rounds + 1), batch_size=b, steps=rounds + 1,
                                   noise_multiplier=1.0, config=AlgoConfig(lr=0.1, clip=1.0), grad_path="fast",
                                   max_physical_batch=b, sum_precision=sp)
        x, y = torch.randn(b, 32, 256), torch.randint(0, 10, (b,))
        times = {"float64": [], "float32": []}
        for _ in range(rounds + 1):
            for sp, e in engines.items():
                t = time.perf_counter()
                e.step(x, y, torch.arange(b))
                times[sp].append(time.perf_counter() - t)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        return {"model": "tiny (Linear 256 -> 512 over 32 positions)", "batch": b, "step_s": med,
                "speedup": med["float64"] / med["float32"], "delta": engines["float32"].fast.last_sum_delta,
                "rounds": rounds}
    finally:
        fast.FORMED_BYTES = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["bert", "gpt2", "resnet", "tiny"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import warnings
    warnings.simplefilter("ignore")
    res = {"cpu": cpu_description(), "torch": torch.__version__, "threads": torch.get_num_threads(), "runs": []}
    for name in args.models:
        for b in args.batch_sizes:
            r = tiny_steps(b * 32, args.rounds) if name == "tiny" else sums_phase(name, b, args.rounds)
            print(json.dumps(r), flush=True)
            res["runs"].append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
