"""An upper bound on private data normalisation for ScatterNet + linear (Tramer & Boneh's "DataNorm").

Tramer & Boneh normalise the scattering features either per example (GroupNorm, no privacy cost,
what ``scatter-linear`` does) or per channel with the training set's mean and variance, released
privately (a Gaussian mechanism composed with the training). Before building the private release
this measures its best case: the per-channel mean and standard deviation taken **exactly** from the
training split (no noise, no privacy cost for them, so the "data" arm is NOT a private result),
against GroupNorm, both trained with DPSGD-GC at epsilon 3 (delta 1e-5, Poisson, PLD) and scored
on a validation split (50 000 / 10 000, seed 0) and the test split, raw weights and an EMA of the
weights. A private release could only do worse than the "data" arm (its noise, and the budget it
takes from the training). Usage::

    python benchmarks/datanorm_bound.py --out benchmarks/results/selection_studies/datanorm_bound.json
    python benchmarks/datanorm_bound.py --protocol long --seeds 0 \\
        --out benchmarks/results/selection_studies/datanorm_bound_long.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.data.catalog import load_dataset
from clipbias.engine.core import DPEngine
from clipbias.models import build_model

PROTOCOLS = {  # epochs, batch size, EMA decay; (lr, clip) per arm: GroupNorm's are the tuned ones
    "compare": (3, 2048, 0.9, {"group": (26.0, 0.054), "data": (26.0, 0.1)}),
    "long": (40, 8192, 0.95, {"group": (128.0, 0.025), "data": (128.0, 0.025)}),
}


class ChannelStandardize(nn.Module):
    """``(x - mean_c) / std_c`` per scattering channel, with fixed statistics (buffers)."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean.view(1, -1, 1, 1))
        self.register_buffer("std", std.view(1, -1, 1, 1))

    def forward(self, x):
        return (x - self.mean) / (self.std + 1e-5)


def run(mode: str, lr: float, clip: float, seed: int, data: dict, epochs: int, batch: int, decay: float) -> dict:
    torch.manual_seed(seed)  # the initial weights (public); batches and noise come from the secret key
    m = build_model("scatter-linear", data["shape"], 10)
    if mode == "data":
        m.norm = ChannelStandardize(data["mean"], data["std"])
    eng = DPEngine(m, "dpsgd", n=len(data["train"]), batch_size=float(batch), epochs=epochs, epsilon=3.0, delta=1e-5,
                   grad_path="rows", config=AlgoConfig(lr=lr, clip=clip, momentum=0.9), max_physical_batch=512)
    ema = {k: v.clone() for k, v in m.state_dict().items()}
    t0 = time.time()
    for _ in range(eng.total_steps):
        idx = eng.sampler.sample()
        eng.step(data["train"][idx], data["y"][idx], idx)
        with torch.no_grad():
            for k, v in m.state_dict().items():
                ema[k].mul_(decay).add_(v, alpha=1 - decay)

    def scores(state: dict) -> dict:
        m.load_state_dict(state)
        with torch.no_grad():
            return {s: float((m(data[s]).argmax(1) == data[f"y_{s}"]).float().mean()) for s in ("val", "test")}
    raw = scores({k: v.clone() for k, v in m.state_dict().items()})
    return {"mode": mode, "lr": lr, "clip": clip, "seed": seed, "epochs": epochs, "batch": batch,
            "noise_multiplier": eng.noise_multiplier, "epsilon": eng.privacy().epsilon,
            "raw": raw, "ema": scores(ema), "train_s": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default="compare")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    epochs, batch, decay, settings = PROTOCOLS[a.protocol]
    ds = load_dataset("fashion-mnist", validation=10000, seed=0)
    probe = build_model("scatter-linear", ds.input_shape, 10)
    train = probe.preprocess(ds.x_train, "fashion-mnist-val10000-train")
    per_channel = train.transpose(0, 1).reshape(train.shape[1], -1)  # [81, examples x positions]
    data = {"shape": ds.input_shape, "y": ds.y_train, "y_val": ds.y_val, "y_test": ds.y_test, "train": train,
            "val": probe.preprocess(ds.x_val, "fashion-mnist-val10000-val"),
            "test": probe.preprocess(ds.x_test, "fashion-mnist-test"),
            "mean": per_channel.mean(1), "std": per_channel.std(1)}
    rows = []
    for seed in a.seeds:
        for mode, (lr, clip) in settings.items():
            r = run(mode, lr, clip, seed, data, epochs, batch, decay)
            rows.append(r)
            print(json.dumps(r), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1) + "\n")
    print("| norm | lr | clip | seed | val raw / EMA | test raw / EMA |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['lr']:g} | {r['clip']:g} | {r['seed']} | {100 * r['raw']['val']:.2f} / "
              f"{100 * r['ema']['val']:.2f} | {100 * r['raw']['test']:.2f} / {100 * r['ema']['test']:.2f} |")


if __name__ == "__main__":
    main()
