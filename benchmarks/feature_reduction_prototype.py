"""Prototype: does a smaller model help DP-SGD on the long protocol? Data-independent reductions of
the GroupNorm'ed ScatterNet features of Fashion-MNIST (50 000 train / 10 000 validation, epsilon 3,
delta 1e-5, 40 epochs at B = 8192, momentum 0.9, EMA 0.95) before the linear head.

NOT library code: randomness is torch.Generator seeded (not the secret key), and the loop is
``benchmarks/bands_prototype.py``'s ``train`` with b = 1 (closed-form per-example gradients of the
linear head, clip to C, sum, Gaussian noise z C, divide by the expected batch), the head started at
zero (the reduced features have other widths). The
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

import numpy as np
import torch

import bands_prototype as bp


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
    epochs, batch = bp.PROTOCOLS["long"][:2]
    steps = epochs * max(1, round(n / batch))
    z = bp.calibrate(batch / n, steps)
    rows = json.loads(a.out.read_text()) if a.out.exists() else []
    for kind in a.kinds:
        data = {"train": reduce(base["train"], kind), "val": reduce(base["val"], kind),
                "y_train": base["y_train"], "y_val": base["y_val"]}
        data["hn2"] = data["train"].pow(2).sum(1) + 1.0  # ||[h, 1]||^2: weight and bias
        for lr, clip in (tuple(map(float, p.split(":"))) for p in a.grid):
            for seed in a.seeds:
                t0 = time.time()
                r = bp.train(data, "long", 1, "sqrt", lr, clip, seed, np.array([1.0]), z, zero_init=True)
                raw, ema = r["raw"], r["ema"]
                rows.append({"kind": kind, "d": data["train"].shape[1], "lr": lr, "clip": clip, "seed": seed,
                             "z": z, "steps": steps, "raw": raw, "ema": ema, "train_s": time.time() - t0})
                print(f"{kind:>6} d {data['train'].shape[1]:>5} lr {lr:g} clip {clip:g} seed {seed}: "
                      f"validation {100 * raw:.2f} % raw, {100 * ema:.2f} % EMA", flush=True)
                a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
