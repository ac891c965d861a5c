"""The fast path's per-step check under dropout: the probed example run alone (a batch of one under its keyed
masks) against the batch of copies of it (a second forward and backward of the whole batch), interleaved in one
process on GPT-2 small, BERT-base and ViT-small at full size.

Hugging Face models are not per-example by construction (``grads.separable``), so every fast-path step checks
one secret random example; with dropout on (train mode, 0.1 as the configs have it) the check was a
counterfactual batch of b copies of it. ``alone`` is the library's check (the batch of copies only where the
example alone disagrees beyond rounding); ``copies`` is the check forced to the batch of copies on the same
engine class. Two engines on two copies of the model take turns on the same fixed batches (B = 8, T = 128, as
``hf_side_by_side.py``; one warm-up step each, then ``--rounds`` rounds), so that a shared machine's load falls
on both alike; the medians and ranges are printed as JSON::

    PYTHONPATH=.:benchmarks python benchmarks/dropout_probe_cost.py --models gpt2 bert vit --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types
import warnings

import torch

from hf_side_by_side import B, Loss, build
from speed import cpu_description


def _copies_only(self, rules, sq, x, y, params, rng):
    """The check as it was: the probed example among copies of itself, always."""
    from clipbias.errors import PathRefusal
    from clipbias.grads import fast_checks
    if rng is None:
        return type(self)._check_examples(self, rules, sq, x, y, params, rng)
    i = self.checks.rng.randrange(len(y))
    mine = self._ordered([r.one(i) for r in rules])
    if not fast_checks._close(mine, self._counterfactual(x, y, i, rng), params, 1e-4):
        raise PathRefusal("fast", fast_checks._MIXING.format(i=i, alone="among copies of itself"))


def one_model(name: str, rounds: int) -> dict:
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine
    n = B * (rounds + 1)
    engines = {}
    for arm in ("alone", "copies"):
        model, make = build(name)
        model.train()
        engines[arm] = DPEngine(model, "dpsgd", n=n, batch_size=B, steps=rounds + 1, noise_multiplier=1.0,
                                config=AlgoConfig(lr=1e-4, clip=1.0, optimizer="adamw"), max_physical_batch=B,
                                loss_fn=Loss(name == "gpt2", "none"), noise_seed=0, grad_path="fast")
    engines["copies"].fast._check_examples = types.MethodType(_copies_only, engines["copies"].fast)
    torch.manual_seed(1)
    xs, ys = make(n)
    times: dict[str, list[float]] = {"alone": [], "copies": []}
    for s in range(rounds + 1):
        idx = torch.arange(s * B, (s + 1) * B)
        x, y = {k: v[idx] for k, v in xs.items()}, ys[idx]
        for arm, eng in engines.items():
            t = time.perf_counter()
            eng.step(x, y, idx)
            times[arm].append(time.perf_counter() - t)
    med = {arm: statistics.median(t[1:]) for arm, t in times.items()}
    return {"seconds_per_step": {arm: {"median": med[arm], "range": [min(t[1:]), max(t[1:])], "all": t}
                                 for arm, t in times.items()},
            "alone_over_copies": med["alone"] / med["copies"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt2", "bert", "vit"], choices=["gpt2", "bert", "vit"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    out = {"cpu": cpu_description(), "threads": a.threads, "torch": torch.__version__, "batch_size": B,
           "rounds": a.rounds, "load_average_1min_before": os.getloadavg()[0], "models": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in a.models:
            out["models"][name] = one_model(name, a.rounds)
    out["load_average_1min_after"] = os.getloadavg()[0]
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
