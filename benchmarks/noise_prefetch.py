"""The noise drawn ahead (``DPEngine(noise_prefetch=True)``: its normals in a background thread while the step's
forward and backward run) against drawn on the critical path (``noise_prefetch=False``), in one process.

Two engines on two identical copies of one model, the same fixed batches, the same seeded key: their steps
alternate (the order flips every round, so a neighbour's load and the order hit both arms alike), and after every
round the two models' parameters are compared bit for bit (the script stops if they differ). Medians with min-max
over the timed rounds, after ``--warmup`` rounds, and the process's CPU time per step (all its threads: drawing
ahead overlaps work, it does not remove any; on a shared machine a second busy thread also takes a larger share of
the cores from other processes, which the CPU time shows). Models where the noise is a large share of the step:

* ``mlp``: an MLP 784 -> W -> W -> 10 (``--width``, default 4096: 20.0M parameters) on random inputs, B examples;
* ``bert``, ``gpt2``, ``vit``: the Hugging Face models of ``hf_side_by_side.py`` at full size, random weights
  (BERT-base 110M, GPT-2 small 124M, ViT-small 22M), T = 128;
* ``cnn``: clipbias's Fashion-MNIST cnn (26k parameters: the noise is a small share) on random images.

``dpsgd`` on the path ``--grad-path`` (default ``fast``), SGD (``--optimizer``)::

    PYTHONPATH=.:benchmarks python benchmarks/noise_prefetch.py --model mlp --batch-size 16 --rounds 15
    PYTHONPATH=.:benchmarks python benchmarks/noise_prefetch.py --model bert --batch-size 8 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings

import torch
from torch import nn

from speed import cpu_description


def build(name: str, b: int, rounds: int, width: int):
    """(model, loss_fn, [(x, y, indices)] of ``rounds`` batches of ``b`` examples, n)."""
    from clipbias.grads.rows import cross_entropy
    torch.manual_seed(0)
    if name in ("bert", "gpt2", "vit"):
        import hf_side_by_side as hf
        hf.B = b
        model, make = hf.build(name)
        model.train()
        return model, hf.Loss(name == "gpt2", "none"), hf.fixed_batches(make, rounds), b * rounds
    if name == "mlp":
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 10))
    elif name == "cnn":
        from clipbias.models import build_model
        model = build_model("cnn", (1, 28, 28), 10)
    else:
        raise SystemExit(f"unknown model {name!r}")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(b * rounds, 1, 28, 28, generator=g), torch.randint(0, 10, (b * rounds,), generator=g)
    return model, cross_entropy, [(x[s * b:(s + 1) * b], y[s * b:(s + 1) * b], torch.arange(s * b, (s + 1) * b))
                                  for s in range(rounds)], b * rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mlp", choices=["mlp", "bert", "gpt2", "vit", "cnn"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=4096, help="the MLP's hidden width")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (one step of each arm a round)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--grad-path", default="fast", choices=["fast", "rows", "auto"])
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine
    rounds = a.warmup + a.rounds
    model, loss_fn, batches, n = build(a.model, a.batch_size, rounds, a.width)
    models = {"prefetch": model, "no-prefetch": copy.deepcopy(model)}
    engines = {arm: DPEngine(m, "dpsgd", n=n, batch_size=a.batch_size, steps=rounds, noise_multiplier=1.0,
                             config=AlgoConfig(lr=1e-4, clip=1.0, optimizer=a.optimizer), loss_fn=loss_fn,
                             max_physical_batch=a.batch_size, noise_seed=0, grad_path=a.grad_path,
                             noise_prefetch=arm == "prefetch")
               for arm, m in models.items()}
    d = engines["prefetch"].rows.layout.dim
    times: dict[str, list[float]] = {arm: [] for arm in engines}
    cpu_times: dict[str, list[float]] = {arm: [] for arm in engines}  # the process's CPU seconds (all its threads)
    order = list(engines)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixed batches are not the sampler's: uncertified, as intended here
        for r, (x, y, idx) in enumerate(batches):
            for arm in order:
                t, c = time.perf_counter(), time.process_time()
                engines[arm].step(x, y, idx)  # a draw made ahead is joined within the step
                if r >= a.warmup:
                    times[arm].append(time.perf_counter() - t)
                    cpu_times[arm].append(time.process_time() - c)
            order.reverse()
            same = all(torch.equal(u, v) for u, v in zip(models["prefetch"].parameters(),
                                                         models["no-prefetch"].parameters()))
            if not same:
                raise SystemExit(f"round {r}: the two arms' parameters differ")
    rows = {arm: {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "all_s": ts,
                  "cpu_median_s": statistics.median(cpu_times[arm])} for arm, ts in times.items()}
    ratio = rows["prefetch"]["median_s"] / rows["no-prefetch"]["median_s"]
    paired = [u / v for u, v in zip(times["prefetch"], times["no-prefetch"])]
    cpu = cpu_description()
    out = {"model": a.model, "parameters": d, "batch_size": a.batch_size, "grad_path": a.grad_path,
           "optimizer": a.optimizer, "threads": a.threads, "rounds": a.rounds, "cpu": cpu, "torch": torch.__version__,
           "load_1min": os.getloadavg()[0], "command": " ".join(sys.argv), "rows": rows, "ratio_of_medians": ratio,
           "paired_ratio_median": statistics.median(paired), "paired_ratio_min_max": [min(paired), max(paired)],
           "bits_equal_every_round": True}
    print(f"CPU: {cpu['name']} ({cpu['cores']} cores), load {out['load_1min']:.2f}; {a.model}, {d:,} parameters, "
          f"B = {a.batch_size}, {a.grad_path} path, {a.threads} threads, {a.rounds} rounds")
    for arm, r in rows.items():
        print(f"{arm:<12} {1e3 * r['median_s']:9.1f} ms/step  ({1e3 * r['min_s']:.1f}-{1e3 * r['max_s']:.1f}), "
              f"CPU {1e3 * r['cpu_median_s']:.1f} ms/step")
    print(f"prefetch / no-prefetch: {ratio:.3f} (medians); per round {out['paired_ratio_median']:.3f} "
          f"({min(paired):.3f}-{max(paired):.3f}); parameters bit-identical after every round")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
