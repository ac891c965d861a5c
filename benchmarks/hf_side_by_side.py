"""clipbias against Opacus 1.6 on three Hugging Face models at full size (random weights): time per step and peak memory.

Issue 46, item 6 (docs/results.md, "Side by side with Opacus", "Hugging Face models at full size"). Models, built
from their configs (nothing downloaded), eager attention, dropout as the config has it (0.1), in train mode:

* ``gpt2``: ``GPT2LMHeadModel(GPT2Config())`` (124M, tied input/output embeddings), full fine-tuning, causal-LM
  loss on random token ids, B = 8, T = 128, no padding;
* ``bert``: ``BertForSequenceClassification(BertConfig(num_labels=2))`` (BERT-base, 110M), B = 8, T = 128,
  an all-ones ``attention_mask``;
* ``vit``: ``ViTForImageClassification`` at ViT-small's size (width 384, 12 layers, 6 heads, 224x224 images,
  16x16 patches, 10 labels; 22M), B = 8.

Arms, one fresh process each (peak RSS = the process's max RSS): ``nonprivate`` (one backward of the batch's mean
loss, AdamW), ``clipbias`` (``DPEngine(..., "dpsgd", grad_path="auto")``, AdamW; the path auto took is
``engine.grad_path_note``), ``clipbias-fast`` (``grad_path="fast"``), ``clipbias-f32`` (``grad_path="auto"``,
``sum_precision="float32"``), ``opacus-hooks`` and ``opacus-ghost``
(``PrivacyEngine().make_private(..., poisson_sampling=False, grad_sample_mode=...)``, AdamW). Every arm runs the
same fixed batches of exactly B examples (step s takes examples 8s..8s+7 of one seeded random data set): no
Poisson sampling, so all arms do the same work. clipbias's engine is called as ``engine.step(x, y, indices)`` on
them (indices not drawn by its sampler: the run's epsilon is uncertified, which a speed measurement does not
use). The per-example loss is the mean token cross-entropy of a sequence (GPT-2) or the cross-entropy of an
example; the non-private arm and Opacus (``loss_reduction="mean"``) average it over the batch. Explicit
``position_ids`` (``[B, T]``, GPT-2 and BERT) and ``token_type_ids`` (BERT) are passed in every arm: Opacus's
per-sample hooks need an embedding input with the batch dimension.

``--batch-size`` sets B for every arm (default 8; one physical batch of B in every arm, clipbias's
``max_physical_batch`` included). One warm-up step, then ``--steps`` timed steps (median and min reported)::

    PYTHONPATH=.:/tmp/opacus_site python benchmarks/hf_side_by_side.py --models gpt2 bert vit --steps 2 \\
        --out benchmarks/results/side_by_side_opacus/hf_side_by_side_gpt2_bert_vit.json
    PYTHONPATH=.:/tmp/opacus_site python benchmarks/hf_side_by_side.py --models bert --batch-size 32 \
        --arms nonprivate clipbias opacus-ghost --steps 3
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

import torch
from torch import nn

from speed import cpu_description  # benchmarks/speed.py: name, vector extensions, cores

B, T = 8, 128
ARMS = ("nonprivate", "clipbias", "clipbias-fast", "clipbias-f32", "opacus-hooks", "opacus-ghost")


def build(name: str):
    """The model, and per-step (x, y) for ``steps`` fixed batches of B examples."""
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(attn_implementation="eager"))
        vocab = model.config.vocab_size
        make = (lambda n: ({"input_ids": (ids := torch.randint(0, vocab, (n, T))),
                            "position_ids": torch.arange(T).expand(n, T).clone()}, ids))
    elif name == "bert":
        from transformers import BertConfig, BertForSequenceClassification
        model = BertForSequenceClassification(BertConfig(num_labels=2, attn_implementation="eager"))
        vocab = model.config.vocab_size
        make = (lambda n: ({"input_ids": torch.randint(0, vocab, (n, T)),
                            "attention_mask": torch.ones(n, T, dtype=torch.long),
                            "token_type_ids": torch.zeros(n, T, dtype=torch.long),
                            "position_ids": torch.arange(T).expand(n, T).clone()}, torch.randint(0, 2, (n,))))
    else:
        from transformers import ViTConfig, ViTForImageClassification
        model = ViTForImageClassification(ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                                                    intermediate_size=1536, image_size=224, patch_size=16,
                                                    num_labels=10, attn_implementation="eager"))
        make = (lambda n: ({"pixel_values": torch.randn(n, 3, 224, 224)}, torch.randint(0, 10, (n,))))
    return model, make


class Loss(nn.Module):
    """Per-example loss [b] (``reduction="none"``), or its batch mean/sum: Opacus's ghost clipping sets
    ``reduction`` itself; clipbias takes the per-example vector."""

    def __init__(self, lm: bool, reduction: str = "mean") -> None:
        super().__init__()
        self.lm, self.reduction = lm, reduction

    def forward(self, out, y):
        logits = out.logits if hasattr(out, "logits") else out
        if self.lm:
            per = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none").mean(1)
        else:
            per = nn.functional.cross_entropy(logits, y, reduction="none")
        return per if self.reduction == "none" else per.mean() if self.reduction == "mean" else per.sum()


def fixed_batches(make, count: int) -> list:
    """``count`` fixed batches ``(x, y, indices)`` of B examples of one seeded random data set."""
    xs, ys = make(B * count)
    return [({k: v[s * B:(s + 1) * B] for k, v in xs.items()}, ys[s * B:(s + 1) * B],
             torch.arange(s * B, (s + 1) * B)) for s in range(count)]


def engine(model, name: str, steps: int, grad_path: str, sum_precision: str = "float64"):
    """clipbias's arm: ``DPEngine(..., "dpsgd")`` with AdamW, one physical batch of B, per-example losses."""
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine
    return DPEngine(model, "dpsgd", n=B * steps, batch_size=B, steps=steps, noise_multiplier=1.0,
                    config=AlgoConfig(lr=1e-4, clip=1.0, optimizer="adamw"), loss_fn=Loss(name == "gpt2", "none"),
                    max_physical_batch=B, noise_seed=0, grad_path=grad_path, sum_precision=sum_precision)


def opacus_private(which: str, model, opt, crit, n: int, b: int) -> tuple:
    """Opacus's ``make_private`` for the arm ``which`` (``opacus-hooks`` or ``opacus-ghost``), fixed batches of
    ``b`` over ``n`` rows: the (model, optimizer, criterion) the arm steps with."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset
    mode = "ghost" if which == "opacus-ghost" else "hooks"
    loader = DataLoader(TensorDataset(torch.zeros(n)), batch_size=b)
    got = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                       max_grad_norm=1.0, criterion=crit, grad_sample_mode=mode,
                                       poisson_sampling=False)
    return (got[0], got[1], got[2]) if mode == "ghost" else (got[0], got[1], crit)


def arm(name: str, which: str, steps: int) -> dict:
    model, make = build(name)
    model.train()
    n = B * (steps + 1)
    batches = fixed_batches(make, steps + 1)
    crit = Loss(name == "gpt2")
    note = None
    if which.startswith("clipbias"):
        eng = engine(model, name, steps + 1, "fast" if which == "clipbias-fast" else "auto",
                     "float32" if which == "clipbias-f32" else "float64")

        def step(x, y, idx):
            eng.step(x, y, idx)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if which.startswith("opacus"):
            model, opt, crit = opacus_private(which, model, opt, crit, n, B)

        def step(x, y, idx):
            opt.zero_grad()
            crit(model(**x), y).backward()
            opt.step()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y, idx in batches:
            t = time.perf_counter()
            step(x, y, idx)
            times.append(time.perf_counter() - t)
    if which.startswith("clipbias"):
        note = eng.grad_path_note
    timed = sorted(times[1:])
    return {"model": name, "arm": which, "batch_size": B, "seq_len": T if name != "vit" else None,
            "parameters": sum(p.numel() for p in model.parameters()), "timed_steps": len(timed),
            "s_per_step_median": timed[len(timed) // 2] if len(timed) % 2 else sum(timed[len(timed) // 2 - 1:
                                                                                         len(timed) // 2 + 1]) / 2,
            "s_per_step_min": timed[0], "warmup_s": times[0], "s_per_step_all": times,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_after_build_mb": base_rss / 1024, "grad_path_note": note}


def main() -> None:
    global B
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=["gpt2", "bert", "vit"], default=["gpt2", "bert", "vit"])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="examples per step in every arm (default 8)")
    p.add_argument("--arm", nargs=3, metavar=("MODEL", "WHICH", "STEPS"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    B = a.batch_size
    if a.arm:
        print(json.dumps(arm(a.arm[0], a.arm[1], int(a.arm[2]))))
        return
    rows = []
    result = {"cpu": cpu_description(), "threads": a.threads, "torch": torch.__version__, "batch_size": B,
              "seq_len": T, "steps": a.steps, "command": " ".join(sys.argv), "rows": rows}
    for name in a.models:
        for which in a.arms:
            t = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--threads", str(a.threads), "--batch-size", str(B),
                                  "--arm", name, which, str(a.steps)], capture_output=True, text=True)
            if out.returncode:
                lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
                err = next((ln for ln in reversed(lines) if "Error" in ln.split(":")[0]), lines[-1] if lines else "?")
                rows.append({"model": name, "arm": which, "error": err})
            else:
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            rows[-1]["process_wall_s"] = time.perf_counter() - t
            print(json.dumps(rows[-1]), flush=True)
            if a.out:  # after every arm, so an interrupted run keeps what it measured
                with open(a.out, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
