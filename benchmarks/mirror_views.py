"""Mirror views on ScatterNet features: does averaging each example's gradient over the image and its
mirror image help DPSGD-GC? (De et al.'s augmentation multiplicity with the one augmentation that
keeps every Fashion-MNIST class, taken exhaustively: K = 2 views, no random draw.)

The scattering features of the mirrored images are computed once (and cached) like the originals'.
The model sees both views of an example as one input ``[2, 81, 7, 7]`` and its loss is the mean of
the two views' cross-entropies, so the per-example gradient is the views' average and the
sensitivity, the sampling and the accounting are DPSGD-GC's (epsilon 3, delta 1e-5, Poisson, PLD).
Scored on a validation split (50 000 / 10 000, seed 0), raw weights and an EMA (0.9), the mirror arm
also with test-time averaging of the two views' probabilities. Compare's protocol: 3 epochs,
B = 2048, momentum 0.9. Usage::

    python benchmarks/mirror_views.py --out benchmarks/results/selection_studies/mirror_views.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.data.catalog import load_dataset
from clipbias.engine.core import DPEngine
from clipbias.models import build_model


class TwoViews(nn.Module):
    """``[b, 2, *features]`` -> ``[b, 2, classes]``: the inner model on both views of each example."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        b = x.shape[0]
        return self.inner(x.reshape(b * 2, *x.shape[2:])).view(b, 2, -1)


def mean_of_views(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.repeat_interleave(2), reduction="none").view(-1, 2).mean(1)


def run(mode: str, lr: float, clip: float, seed: int, data: dict, epochs: int, batch: int) -> dict:
    torch.manual_seed(seed)  # the initial weights (public); batches and noise come from the secret key
    m = build_model("scatter-linear", data["shape"], 10)
    x = data["train"] if mode == "plain" else torch.stack([data["train"], data["train_mirror"]], 1)
    eng = DPEngine(TwoViews(m) if mode == "mirror" else m, "dpsgd", n=len(x), batch_size=float(batch), epochs=epochs,
                   epsilon=3.0, delta=1e-5, grad_path="rows", loss_fn=mean_of_views if mode == "mirror" else F.cross_entropy,
                   config=AlgoConfig(lr=lr, clip=clip, momentum=0.9), max_physical_batch=512)
    ema = {k: v.clone() for k, v in m.state_dict().items()}
    t0 = time.time()
    for _ in range(eng.total_steps):
        idx = eng.sampler.sample()
        eng.step(x[idx], data["y"][idx], idx)
        with torch.no_grad():
            for k, v in m.state_dict().items():
                ema[k].mul_(0.9).add_(v, alpha=0.1)

    def scores(state: dict) -> dict:
        m.load_state_dict(state)
        with torch.no_grad():
            p = m(data["val"]).softmax(1)
            out = {"plain": float((p.argmax(1) == data["y_val"]).float().mean())}
            if mode == "mirror":
                both = p + m(data["val_mirror"]).softmax(1)
                out["views_averaged"] = float((both.argmax(1) == data["y_val"]).float().mean())
        return out
    raw = scores({k: v.clone() for k, v in m.state_dict().items()})
    return {"mode": mode, "lr": lr, "clip": clip, "seed": seed, "noise_multiplier": eng.noise_multiplier,
            "epsilon": eng.privacy().epsilon, "certified": eng.privacy().certified, "raw": raw, "ema": scores(ema), "train_s": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", nargs="+", type=float, default=[56, 112, 224])
    p.add_argument("--clip", type=float, default=0.025)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ds = load_dataset("fashion-mnist", validation=10000, seed=0)
    probe = build_model("scatter-linear", ds.input_shape, 10)
    data = {"shape": ds.input_shape, "y": ds.y_train, "y_val": ds.y_val,
            "train": probe.preprocess(ds.x_train, "fashion-mnist-val10000-train"),
            "val": probe.preprocess(ds.x_val, "fashion-mnist-val10000-val"),
            "train_mirror": probe.preprocess(ds.x_train.flip(-1), "fashion-mnist-val10000-train-mirror"),
            "val_mirror": probe.preprocess(ds.x_val.flip(-1), "fashion-mnist-val10000-val-mirror")}
    rows = []
    for seed in a.seeds:
        for lr in a.lrs:
            for mode in ("plain", "mirror"):
                r = run(mode, lr, a.clip, seed, data, 3, 2048)
                rows.append(r)
                print(json.dumps(r), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1) + "\n")
    print("| views | lr | clip | seed | val raw | val EMA | views averaged (raw / EMA) |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        va = (f"{100 * r['raw']['views_averaged']:.2f} / {100 * r['ema']['views_averaged']:.2f}"
              if r["mode"] == "mirror" else "-")
        print(f"| {r['mode']} | {r['lr']:g} | {r['clip']:g} | {r['seed']} | {100 * r['raw']['plain']:.2f} | "
              f"{100 * r['ema']['plain']:.2f} | {va} |")


if __name__ == "__main__":
    main()
