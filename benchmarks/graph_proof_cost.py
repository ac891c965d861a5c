"""Cost of the fast path's per-step probe against the graph proof that replaces it (``clipbias.grads.proof``), on
Hugging Face BERT (random weights, dropout off: ``model.eval()``, an all-ones attention mask), in one process,
arms interleaved, medians of ``--reps``:

* ``nonprivate``: the model's forward and backward of the summed loss (the reference);
* ``probe``: a fast-path step (``BookKeeping``) with the proof off: the probe runs every step;
* ``proof``: a fast-path step with the proof on: the step's forward recorded and found among the proven
  programs, no probe;
* ``neither``: a fast-path step with neither (not sound: the floor both are measured against).

Also the first proven step's extra time (the analysis, and one example run alone). Usage::

    PYTHONPATH=. python benchmarks/graph_proof_cost.py                       # tiny BERT, B = 8, T = 16
    PYTHONPATH=. python benchmarks/graph_proof_cost.py --model base --reps 5  # BERT-base, B = 8, T = 128
    PYTHONPATH=. python benchmarks/graph_proof_cost.py --model base --layers 2 --reps 5  # two of its layers
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F


def build(which: str, b: int, t: int, layers: int | None = None):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    if which == "tiny":
        cfg = BertConfig(vocab_size=50, max_position_embeddings=64, num_labels=2, hidden_size=32,
                         num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    else:
        cfg = BertConfig(num_labels=2, **({"num_hidden_layers": layers} if layers else {}))
    model = BertForSequenceClassification(cfg).eval()
    g = torch.Generator().manual_seed(1)
    x = {"input_ids": torch.randint(2, min(cfg.vocab_size, 1000), (b, t), generator=g),
         "attention_mask": torch.ones(b, t, dtype=torch.long)}
    return model, x, torch.randint(0, 2, (b,), generator=g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "base"), default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq", type=int, default=None, help="tokens per example (default 16 tiny, 128 base)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=None, help="BERT-base's width with this many layers (default 12)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from clipbias.grads import proof
    from clipbias.grads.fast import BookKeeping

    t = a.seq or (16 if a.model == "tiny" else 128)
    model, x, y = build(a.model, a.batch_size, t, a.layers)

    def classify(out, yy):
        return F.cross_entropy(out.logits, yy, reduction="none")
    bk = BookKeeping(model, classify)

    def scale(n):
        return torch.clamp(1.0 / n, max=1.0)
    probe = bk._check_examples

    def arm(name: str) -> float:
        proof.ENABLED = name == "proof"
        bk._check_examples = (lambda *args, **kw: None) if name == "neither" else probe
        start = time.perf_counter()
        if name == "nonprivate":
            model.zero_grad(set_to_none=True)
            classify(model(**x), y).sum().backward()
        else:
            bk(x, y, scale, False)
        return time.perf_counter() - start

    arm("probe")  # the loss's first step (found to return per-example losses), warm-up
    first = arm("proof")
    assert bk._proofs.last is None, bk._proofs.last
    arms = ("nonprivate", "probe", "proof", "neither")
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(a.reps):
        for k in arms:
            times[k].append(arm(k))
    assert bk._proofs.last is None and bk._proofs.analysed == 1
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med["nonprivate"]
    print(f"BERT-{a.model}{f' ({a.layers} layers)' if a.layers else ''} B = {a.batch_size} T = {t}, {a.threads} threads, "
          f"torch {torch.__version__}, {a.reps} reps")
    for k in arms:
        print(f"  {k:10s} median {med[k] * 1e3:9.1f} ms  ({med[k] / ref:.2f}x non-private)")
    print(f"  probe's cost:     {(med['probe'] - med['neither']) / ref:.3f}x a non-private step")
    print(f"  recording's cost: {(med['proof'] - med['neither']) / ref:.3f}x a non-private step")
    print(f"  step with the proof / step with the probe: {med['proof'] / med['probe']:.3f}")
    print(f"  first proven step (analysis, one example alone): {first * 1e3:.1f} ms "
          f"({(first - med['proof']) * 1e3:.1f} ms more than a proven step)")


if __name__ == "__main__":
    main()
