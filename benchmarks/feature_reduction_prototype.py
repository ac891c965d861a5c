"""Prototype: does a smaller model help DP-SGD on the long protocol? Data-independent reductions of
the GroupNorm'ed ScatterNet features of Fashion-MNIST (50 000 train / 10 000 validation, epsilon 3,
delta 1e-5, 40 epochs at B = 8192, momentum 0.9, EMA 0.95) before the linear head.

NOT library code: randomness is torch.Generator seeded (not the secret key), and the loop is
``benchmarks/bands_prototype.py``'s (closed-form per-example gradients of the linear head, clip to C,
sum, Gaussian noise z C, divide by the expected batch), with the head started at zero. The
reductions are fixed maps applied to every example alike, so the accounting is unchanged (PLD,
Poisson q = B / N, ``bands_prototype.calibrate``):

* ``dctK``: the 2-D DCT of each of the 81 scattering channels' 7 x 7 maps, the K x K lowest
  frequencies kept (orthonormal, d = 81 K^2);
* ``poolK``: adaptive average pooling of the maps to K x K (scaled to keep the energy of a constant map);
* ``order1``: the zeroth- and first-order scattering channels only (17 of 81);
* ``unit``: every example's feature vector scaled to norm sqrt(d) (the clip then acts on the
  output error alone);
* ``none``: the features as ``scatter-linear`` sees them.

    python benchmarks/feature_reduction_prototype.py --kinds none dct5 dct4 dct3 pool4 pool3 order1 \\
        --grid 64:0.025 128:0.025 256:0.025 --out res.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import bands_prototype as bp

EPOCHS, B, DECAY, MOMENTUM = 40, 8192, 0.95, 0.9


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix (rows: frequencies)."""
    k, i = torch.arange(n).double()[:, None], torch.arange(n).double()[None, :]
    m = torch.cos(math.pi * (i + 0.5) * k / n) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    return m


def reduce(h: torch.Tensor, kind: str) -> torch.Tensor:
    x = h.view(len(h), 81, 7, 7)
    if kind == "none":
        return h
    if kind.startswith("dct"):
        d = dct_matrix(7)[:int(kind[3:])].float()
        return torch.einsum("ab,ncbd,ed->ncae", d, x, d).reshape(len(h), -1)
    if kind.startswith("pool"):
        k = int(kind[4:])
        return (torch.nn.functional.adaptive_avg_pool2d(x, k) * (49 / k / k) ** 0.5).reshape(len(h), -1)
    if kind == "order1":
        return x[:, :17].reshape(len(h), -1)
    if kind == "unit":
        return h * (h.shape[1] ** 0.5 / h.norm(dim=1, keepdim=True))
    raise ValueError(kind)


def train(data: dict, lr: float, clip: float, seed: int, z: float, steps: int) -> tuple[float, float]:
    """(validation accuracy of the last weights, of their EMA)."""
    n, d = data["train"].shape
    gen = torch.Generator().manual_seed(10_000 + seed)
    w, bias = torch.zeros(10, d), torch.zeros(10)
    buf_w, buf_b = torch.zeros_like(w), torch.zeros_like(bias)
    ema_w = ema_b = None
    h_all, y_all, hn2 = data["train"], data["y_train"], data["hn2"]
    for _ in range(steps):
        idx = torch.nonzero(torch.rand(n, generator=gen) < B / n).flatten()
        h, y = h_all[idx], y_all[idx]
        g = torch.softmax(h @ w.T + bias, 1)
        g[torch.arange(len(y)), y] -= 1.0
        s = (clip / (g.norm(dim=1) * hn2[idx].sqrt() + 1e-12)).clamp(max=1.0)
        gs = g * s[:, None]
        buf_w.mul_(MOMENTUM).add_((gs.T @ h + torch.randn(w.shape, generator=gen) * z * clip) / B)
        buf_b.mul_(MOMENTUM).add_((gs.sum(0) + torch.randn(10, generator=gen) * z * clip) / B)
        w -= lr * buf_w
        bias -= lr * buf_b
        if ema_w is None:
            ema_w, ema_b = w.clone(), bias.clone()
        else:
            ema_w.mul_(DECAY).add_(w, alpha=1 - DECAY)
            ema_b.mul_(DECAY).add_(bias, alpha=1 - DECAY)

    def acc(wx, bx):
        return float(((data["val"] @ wx.T + bx).argmax(1) == data["y_val"]).float().mean())
    return acc(w, bias), acc(ema_w, ema_b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", default=["none", "dct5", "dct4", "dct3", "pool4", "pool3", "order1"])
    ap.add_argument("--grid", nargs="+", default=["64:0.025", "128:0.025", "256:0.025"], help="lr:clip pairs")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = bp.load()
    n = len(base["train"])
    steps = EPOCHS * max(1, round(n / B))
    z = bp.calibrate(B / n, steps)
    rows = json.loads(a.out.read_text()) if a.out.exists() else []
    for kind in a.kinds:
        data = {"train": reduce(base["train"], kind), "val": reduce(base["val"], kind),
                "y_train": base["y_train"], "y_val": base["y_val"]}
        data["hn2"] = data["train"].pow(2).sum(1) + 1.0  # ||[h, 1]||^2: weight and bias
        for lr, clip in (tuple(map(float, p.split(":"))) for p in a.grid):
            for seed in a.seeds:
                t0 = time.time()
                raw, ema = train(data, lr, clip, seed, z, steps)
                rows.append({"kind": kind, "d": data["train"].shape[1], "lr": lr, "clip": clip, "seed": seed,
                             "z": z, "steps": steps, "raw": raw, "ema": ema, "train_s": time.time() - t0})
                print(f"{kind:>6} d {data['train'].shape[1]:>5} lr {lr:g} clip {clip:g} seed {seed}: "
                      f"validation {100 * raw:.2f} % raw, {100 * ema:.2f} % EMA", flush=True)
                a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
