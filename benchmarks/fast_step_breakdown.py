"""Where a fast-path step's time goes, phase by phase, against a non-private step of the same model in the
same process (Hugging Face models at full size, random weights, the batches of ``hf_side_by_side.py``).

Each phase's function is wrapped with a wall-clock timer that counts its own time, without the time of the
other phases it calls (a stack of timers), so the phases add up to the step; everything the check calls (its own
forward, backward and rules) counts as the check's:

* ``forward and backward``: ``BookKeeping._backward`` (the batch's forward and one backward to the layer
  outputs, no weight gradients) and the reference sum's parameters where it takes them;
* ``rules: norms``: ``_rules_of`` (every layer's rule: the ghost norms' Gram matrices and rounding bounds, the
  formed per-example gradients, the Embedding's rows);
* ``rules: clipped sums``: every rule's ``sums`` (the ghost layers' float64 ``(s * g)^T a``);
* ``proof``: ``RuntimeChecks.graph_proven`` (the graph proof's look-up of the step's recorded program; on a new
  program its analysis and the first example's recording alone); the recording itself runs in the forward;
* ``check``: ``BookKeeping._check_examples`` (a secret random example run alone under its keyed dropout masks,
  or the probes run alone without dropout, their gradients compared; the float64 recheck where float32 parts
  them);
* ``noise``: ``snapped_gaussian`` (ChaCha20 keystream, float64 Box-Muller, rounding onto the grid);
* ``optimizer``: the base optimizer's ``step`` (AdamW);
* ``other``: the rest of ``DPEngine.step`` (batch handling, clip factors, accounting, bookkeeping).

The non-private step (forward, one backward of the batch's mean loss, AdamW) and the private step alternate on
the same batches, ``--rounds`` times after one warm-up round of each::

    PYTHONPATH=.:benchmarks python benchmarks/fast_step_breakdown.py --models bert gpt2 --rounds 3 \\
        --out benchmarks/results/speed/fast_step_breakdown.json
    PYTHONPATH=.:benchmarks python benchmarks/fast_step_breakdown.py --models cnn --batch-size 256 --rounds 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections import defaultdict

import torch

import hf_side_by_side as hf
from speed import cpu_description

_clock: list = []  # the timers running: [phase, start, time of the phases nested in it]
_spent: dict = defaultdict(float)


def timed(phase: str, fn):
    def wrapper(*args, **kwargs):
        if any(frame[0] == "check" for frame in _clock):  # the check's own forward, backward and rules are its cost
            return fn(*args, **kwargs)
        _clock.append([phase, time.perf_counter(), 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            name, start, nested = _clock.pop()
            took = time.perf_counter() - start
            _spent[name] += took - nested
            if _clock:
                _clock[-1][2] += took
    return wrapper


def instrument() -> None:
    from clipbias.step import noise
    from clipbias.grads import fast, fast_checks
    fast.BookKeeping._backward = timed("forward and backward", fast.BookKeeping._backward)
    fast._rules_of = timed("rules: norms", fast._rules_of)
    from clipbias.grads.layers import RULES
    modules = [fast] + [sys.modules[type(r).__module__] for r in RULES.values()]
    for cls in {c for mod in modules for c in vars(mod).values() if isinstance(c, type) and "sums" in vars(c)}:
        cls.sums = timed("rules: clipped sums", cls.sums)
    fast.BookKeeping._check_examples = timed("check", fast.BookKeeping._check_examples)
    fast_checks.RuntimeChecks.graph_proven = timed("proof", fast_checks.RuntimeChecks.graph_proven)
    noise.snapped_gaussian = timed("noise", noise.snapped_gaussian)
    torch.optim.AdamW.step = timed("optimizer", torch.optim.AdamW.step)
    torch.optim.SGD.step = timed("optimizer", torch.optim.SGD.step)


def _cnn(rounds: int, sum_precision: str):
    """The library's Tramer-Boneh CNN on 28x28 images (random pixels, 10 classes), dpsgd on the fast path with SGD
    (``benchmarks/speed.py``'s ``dpsgd-fast`` arm), and its non-private twin: (model, batches, loss, engine, opt)."""
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine
    from clipbias.models import build_model
    torch.manual_seed(0)
    model, b = build_model("cnn", (1, 28, 28), 10), hf.B
    x, y = torch.randn(b * (rounds + 1), 1, 28, 28), torch.randint(0, 10, (b * (rounds + 1),))
    batches = [(x[s * b:(s + 1) * b], y[s * b:(s + 1) * b], torch.arange(s * b, (s + 1) * b)) for s in range(rounds + 1)]
    eng = DPEngine(model, "dpsgd", n=b * (rounds + 1), batch_size=b, steps=rounds + 1, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.1, clip=1.0), noise_seed=0, grad_path="fast", max_physical_batch=b,
                   sum_precision=sum_precision)
    return model, batches, torch.nn.functional.cross_entropy, eng, torch.optim.SGD(model.parameters(), lr=0.1)


def run(name: str, rounds: int, sum_precision: str = "float64") -> dict:
    if name == "cnn":
        model, batches, plain, eng, opt = _cnn(rounds, sum_precision)
    else:
        model, make = hf.build(name)
        batches = hf.fixed_batches(make, rounds + 1)
        plain = hf.Loss(name == "gpt2")
        eng = hf.engine(model, name, rounds + 1, "fast", sum_precision)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    rows = []
    for r, (x, y, idx) in enumerate(batches):
        t = time.perf_counter()
        opt.zero_grad()
        plain(model(**x) if isinstance(x, dict) else model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        nonprivate = time.perf_counter() - t
        _spent.clear()
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng.step(x, y, idx)
        step = time.perf_counter() - t
        phases = dict(_spent)
        phases["optimizer"] = phases.get("optimizer", 0.0)
        phases["other"] = step - sum(phases.values())
        if r:  # round 0 warms both up
            rows.append({"nonprivate_s": nonprivate, "private_s": step, "phases_s": phases})
    names = sorted({k for row in rows for k in row["phases_s"]})  # (a step that skipped its check has none)
    med = {k: statistics.median(row["phases_s"].get(k, 0.0) for row in rows) for k in names}
    non, pri = (statistics.median(row[k] for row in rows) for k in ("nonprivate_s", "private_s"))
    return {"model": name, "grad_path": eng.grad_path_note, "nonprivate_s_median": non, "private_s_median": pri,
            "ratio": pri / non, "phases_s_median": med, "rounds": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=["gpt2", "bert", "vit", "cnn"], default=["bert"],
                   help="Hugging Face models at full size, or the library's cnn (use --batch-size 256)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="examples per step (default 8)")
    p.add_argument("--sum-precision", choices=["float64", "float32"], default="float64",
                   help="DPEngine(sum_precision=...): the ghost layers' clipped sums (default float64)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    hf.B = a.batch_size
    instrument()
    out = {"cpu": cpu_description(), "threads": a.threads, "torch": torch.__version__, "batch_size": hf.B, "sum_precision": a.sum_precision,
           "seq_len": hf.T, "command": " ".join(sys.argv), "models": []}
    for name in a.models:
        res = run(name, a.rounds, a.sum_precision)
        out["models"].append(res)
        print(f"{name}: non-private {res['nonprivate_s_median'] * 1e3:.1f} ms, private "
              f"{res['private_s_median'] * 1e3:.1f} ms ({res['ratio']:.2f}x)", flush=True)
        for k, v in sorted(res["phases_s_median"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:24s} {v * 1e3:9.1f} ms  {v / res['private_s_median']:5.1%}  "
                  f"{v / res['nonprivate_s_median']:.2f}x non-private", flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
