"""Prototype: does decaying the learning rate help DP-SGD on the long protocol? ScatterNet + linear on
Fashion-MNIST, 50 000 train / 10 000 validation, B = 8192, 40 epochs, epsilon 3 (delta 1e-5, PLD),
momentum 0.9, seeds 0-2; the raw weights and EMAs (0.9, 0.95, 0.99) scored on validation.

NOT library code: the loop and its seeded generators are ``bands_prototype.py``'s (b = 1), about 26 s
a run on one core. Schedules of the base optimizer's step size (post-processing: no privacy cost):
``const``; ``cos`` (cosine to 0); ``lin`` (linear to 0); ``step`` (x1, x0.3 after half the steps,
x0.1 after three quarters). Also ``--nonprivate``: z = 0 and no clipping, B = 1024, 20 epochs (the
model's ceiling on the validation split)::

    python benchmarks/lr_schedule_prototype.py --out lr_schedules.json \\
        --grid const:32:0.05 const:64:0.05 cos:64:0.05 cos:128:0.05 lin:128:0.05 step:64:0.05
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bands_prototype as bp  # noqa: E402


def factor(kind: str, t: int, T: int) -> float:
    u = t / max(1, T)
    return {"const": 1.0, "cos": 0.5 * (1 + math.cos(math.pi * u)), "lin": 1.0 - u,
            "step": 1.0 if u < 0.5 else 0.3 if u < 0.75 else 0.1}[kind]


def train(data: dict, kind: str, lr: float, clip: float, seed: int, z: float, epochs: int, B: int) -> dict:
    from clipbias.models import build_model
    N = len(data["train"])
    T, q = epochs * max(1, round(N / B)), B / N
    torch.manual_seed(seed)
    m = build_model("scatter-linear", data["shape"], 10)
    W, bias = m.fc.weight.detach().clone(), m.fc.bias.detach().clone()
    gen = torch.Generator().manual_seed(10_000 + seed)
    bufW, bufb = torch.zeros_like(W), torch.zeros_like(bias)
    emas: dict[float, list | None] = {0.9: None, 0.95: None, 0.99: None}
    H, Y, hn2 = data["train"], data["y_train"], data["hn2"]
    for t in range(T):
        idx = torch.nonzero(torch.rand(N, generator=gen) < q).flatten()
        h, y = H[idx], Y[idx]
        g = torch.softmax(h @ W.T + bias, 1)
        g[torch.arange(len(y)), y] -= 1.0
        s = (clip / (g.norm(dim=1) * hn2[idx].sqrt() + 1e-12)).clamp(max=1.0)
        gs = g * s[:, None]
        bufW.mul_(0.9).add_((gs.T @ h + torch.randn(W.shape, generator=gen) * z * clip) / B)
        bufb.mul_(0.9).add_((gs.sum(0) + torch.randn(bias.shape, generator=gen) * z * clip) / B)
        f = lr * factor(kind, t, T)
        W -= f * bufW
        bias -= f * bufb
        for d, e in emas.items():
            if e is None:
                emas[d] = [W.clone(), bias.clone()]
            else:
                e[0].mul_(d).add_(W, alpha=1 - d)
                e[1].mul_(d).add_(bias, alpha=1 - d)

    def acc(Wx: torch.Tensor, bx: torch.Tensor) -> float:
        return float(((data["val"] @ Wx.T + bx).argmax(1) == data["y_val"]).float().mean())
    return {"raw": acc(W, bias), **{f"ema{d}": acc(*e) for d, e in emas.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", nargs="+", default=["const:32:0.05", "cos:64:0.05"], help="KIND:LR:CLIP")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--nonprivate", nargs="*", type=float, default=None, metavar="LR",
                    help="instead: the non-private ceiling at these learning rates (B = 1024, 20 epochs)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    data = bp.load()
    rows = json.loads(a.out.read_text()) if a.out.exists() else []
    if a.nonprivate is not None:
        runs = [("const", lr, 1e9, 0, 0.0, 20, 1024) for lr in a.nonprivate]
    else:
        epochs, B = bp.PROTOCOLS["long"][:2]
        z = bp.calibrate(B / len(data["train"]), epochs * max(1, round(len(data["train"]) / B)))
        runs = [(k, float(lr), float(c), s, z, epochs, B) for k, lr, c in (g.split(":") for g in a.grid) for s in a.seeds]
    for kind, lr, clip, seed, z, epochs, B in runs:
        t0 = time.time()
        r = {"kind": kind, "lr": lr, "clip": clip, "seed": seed, "z": z, "epochs": epochs, "B": B,
             **train(data, kind, lr, clip, seed, z, epochs, B), "s": time.time() - t0}
        rows.append(r)
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
