"""ViT-small fully fine-tuned: clipbias's fast path against its rows path, interleaved in one process.

Issue 46 (docs/results.md, "Hugging Face models at full size"). ``ViTForImageClassification`` at ViT-small's size
as in ``hf_side_by_side.py`` (width 384, 12 layers, 6 heads, 1536 MLP, 224x224 images, 16x16 patches, 10 labels;
eager attention, dropout 0.1, train mode; random weights), nothing frozen, B = 8, DP-SGD with AdamW. Two engines
on two copies of the model, ``grad_path="rows"`` and ``grad_path="fast"``, take turns on the same fixed batches
(one warm-up step each, then ``--rounds`` rounds of one step each), so that a shared machine's load falls on
both alike; the median and range of each path's timed steps are printed as JSON, with the load average before
and after. Memory is not separated in one process (``hf_side_by_side.py`` runs each arm in its own)::

    PYTHONPATH=.:benchmarks python benchmarks/vit_fast_vs_rows.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch

from hf_side_by_side import B, Loss, build
from speed import cpu_description


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine
    n = B * (a.rounds + 1)
    engines = {}
    for path in ("rows", "fast"):
        model, make = build("vit")
        model.train()
        engines[path] = DPEngine(model, "dpsgd", n=n, batch_size=B, steps=a.rounds + 1, noise_multiplier=1.0,
                                 config=AlgoConfig(lr=1e-4, clip=1.0, optimizer="adamw"), max_physical_batch=B,
                                 loss_fn=Loss(False, "none"), noise_seed=0, grad_path=path)
    torch.manual_seed(1)
    xs, ys = make(n)
    load = [os.getloadavg()[0]]
    times: dict[str, list[float]] = {"rows": [], "fast": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(a.rounds + 1):
            idx = torch.arange(s * B, (s + 1) * B)
            x, y = {k: v[idx] for k, v in xs.items()}, ys[idx]
            for path, eng in engines.items():
                t = time.perf_counter()
                eng.step(x, y, idx)
                times[path].append(time.perf_counter() - t)
    load.append(os.getloadavg()[0])
    out = {"cpu": cpu_description(), "threads": a.threads, "torch": torch.__version__, "batch_size": B,
           "rounds": a.rounds, "load_average_1min_before_after": load,
           "notes": {k: e.grad_path_note for k, e in engines.items()}}
    for path, ts in times.items():
        timed = ts[1:]
        out[path] = {"s_per_step_median": statistics.median(timed), "min": min(timed), "max": max(timed),
                     "warmup_s": ts[0], "all": ts}
    out["fast_over_rows"] = out["fast"]["s_per_step_median"] / out["rows"]["s_per_step_median"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
