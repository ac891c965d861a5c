"""Seconds per step of DP fine-tuning at GPT-2 small's size (124M parameters, the DiceSGD paper's
model) on CPU: full fine-tuning vs LoRA, rows vs fast path, against a non-private step.

GPT-2's weights cannot be downloaded here, so the model is ``GPT2LMHeadModel(GPT2Config())`` with
random weights (the same shapes and cost); the sequences are the E2E sample under the byte tokenizer
(ids < 257 of GPT-2's 50,257; ~210 tokens per sequence where GPT-2's own tokenizer gives ~90, so
these steps are ~2x longer than real E2E steps). One arm per process, for its peak memory:

    python benchmarks/gpt2_small.py ARM [--steps 2] [--batch-size 16]   # ARM: nonprivate, full, full-fast, lora, lora-fast
    for a in nonprivate full lora lora-fast; do /usr/bin/time -f "%M KB" python benchmarks/gpt2_small.py $a; done

``--max-length 128 --pad-to 128`` gives every sequence 128 tokens (truncated, then padded), ``--optimizer
adamw`` AdamW in every arm, ``--fixed-batch`` batches of exactly ``--batch-size`` (the first examples of a
shuffled order, the same in every arm; in the DP arms the engine's step is called on them directly, not on
Poisson batches): a per-step comparison at one shape.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.sampling.loader import PoissonLoader
from clipbias.data.text import E2EDataset, LMCollate, byte_tokenizer, read_e2e, sequence_loss

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "e2e_sample.csv"


def model(lora: bool):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    m = GPT2LMHeadModel._from_config(GPT2Config(), attn_implementation="eager")
    if lora:
        from peft import LoraConfig, get_peft_model
        m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["c_attn"],
                                         fan_in_fan_out=True))
    return m


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("arm", choices=("nonprivate", "full", "full-fast", "lora", "lora-fast"))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-physical-batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=320)
    p.add_argument("--pad-to", type=int, default=None)
    p.add_argument("--optimizer", choices=("adam", "adamw"), default="adam")
    p.add_argument("--fixed-batch", action="store_true")
    a = p.parse_args()
    tok = byte_tokenizer()
    data = E2EDataset(read_e2e(SAMPLE), tok, a.max_length)
    collate = LMCollate(tok.pad_token_id, a.pad_to)
    m = model(a.arm.startswith("lora"))
    times, cpu, sizes = [], [], []
    if a.arm == "nonprivate":
        opt = (torch.optim.AdamW if a.optimizer == "adamw" else torch.optim.Adam)(
            [q for q in m.parameters() if q.requires_grad], lr=1e-4)
        g = torch.Generator().manual_seed(0)
        for _ in range(a.steps + 1):
            b = collate([data[int(i)] for i in torch.randperm(len(data), generator=g)[:a.batch_size]])
            labels = b.pop("labels")
            t, c = time.perf_counter(), time.process_time()
            sequence_loss(m(**b), labels).sum().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            sizes.append(len(labels))
        note = "full fine-tuning, one backward of the summed loss"
    else:
        eng = DPEngine(m, "dice", n=len(data), batch_size=a.batch_size, steps=a.steps + 1, noise_multiplier=1.0,
                       config=AlgoConfig(lr=1e-4, clip=1.0, optimizer=a.optimizer), loss_fn=sequence_loss,
                       max_physical_batch=a.max_physical_batch, noise_seed=0,
                       grad_path="fast" if a.arm.endswith("-fast") else "rows")
        note = eng.grad_path_note
        if a.fixed_batch:
            g = torch.Generator().manual_seed(0)
            batches = []
            for _ in range(a.steps + 1):
                idx = torch.randperm(len(data), generator=g)[:a.batch_size]
                b = collate([data[int(i)] for i in idx])
                batches.append((b, b.pop("labels"), idx))
        else:
            batches = PoissonLoader(eng, data, collate_fn=collate).epoch()
        for x, y, idx in batches:
            t, c = time.perf_counter(), time.process_time()
            eng.step(x, y, idx)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            sizes.append(len(idx))
    res = {"arm": a.arm, "parameters": sum(q.numel() for q in m.parameters()),
           "trainable": sum(q.numel() for q in m.parameters() if q.requires_grad), "batch_size": a.batch_size,
           "s_per_example_after_first": sum(times[1:]) / max(sum(sizes[1:]), 1), "batch_sizes": sizes,
           "s_per_step_after_first": sum(times[1:]) / max(len(times) - 1, 1), "first_step_s": times[0],
           "cpu_s_per_step_after_first": sum(cpu[1:]) / max(len(cpu) - 1, 1),
           "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "path": note,
           "threads": torch.get_num_threads(),
           "sequence_length": a.pad_to, "optimizer": a.optimizer, "fixed_batch": a.fixed_batch}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
