"""Differentially private fine-tuning of GPT-2 on E2E NLG (the DiceSGD paper's NLP task), any algorithm.

    python examples/gpt2_e2e.py --tiny                                     # a random 2-layer GPT-2, no weights
    python examples/gpt2_e2e.py --model-dir DIR --train trainset.csv --valid devset.csv --algo dice --epsilon 3

``--tiny`` builds a small random GPT-2 configuration and the byte-level tokenizer of
``clipbias.data.text`` (nothing to download); ``--model-dir`` loads ``GPT2LMHeadModel`` weights and their
tokenizer from a local directory (``save_pretrained`` layout; nothing is downloaded). ``--lora R``
trains rank-R LoRA adapters (peft) on the attention projections over a frozen base: only trainable
parameters get per-example gradients. The data are E2E CSV files (``mr,ref``); the default
``examples/data/e2e_sample.csv`` is a small synthetic stand-in written by the project.

Privacy: the sequences of the training file are the private examples. Each step is a Poisson sample
(``clipbias.loader.PoissonLoader`` over the map-style ``E2EDataset``, DataLoader ``--workers``); each
example's gradient (its loss summed over its reference tokens) is clipped; the accounting is
clipbias's (``--algo dice``: the sound error-feedback bound, not the DiceSGD paper's refuted one).
The tokenizer is public (byte-level, or the pre-trained one) and the validation file is only read
to report perplexity. Needs ``pip install 'clipbias[hf]'`` (scripts/setup.sh installs it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from clipbias import algorithms
from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.engine.loop import run_steps
from clipbias.errors import ClipbiasError, ConfigError
from clipbias.sampling.loader import PoissonLoader
from clipbias.data.text import E2EDataset, LMCollate, byte_tokenizer, read_e2e, sequence_loss, token_count

SAMPLE = Path(__file__).resolve().parent / "data" / "e2e_sample.csv"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example: python examples/gpt2_e2e.py --tiny --algo dice --epsilon 3")
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--tiny", action="store_true", help="a random 2-layer GPT-2 (width 64) with the byte tokenizer")
    m.add_argument("--model-dir", metavar="DIR", help="local GPT-2 weights and tokenizer (save_pretrained layout)")
    p.add_argument("--train", default=str(SAMPLE), metavar="CSV", help="E2E training file (default: the sample)")
    p.add_argument("--valid", metavar="CSV", help="E2E validation file (default: the last 20%% of --train, "
                                                   "which is then not trained on)")
    p.add_argument("--algo", default="dice", help="clipbias algorithm (default dice; dpsgd, normalized, "
                                                  "dice-adam, p-avg, inner-outer, perturb, sgd, ...)")
    p.add_argument("--epsilon", type=float, default=3.0, help="target epsilon; the noise is calibrated (default 3)")
    p.add_argument("--noise-multiplier", type=float, help="use this noise multiplier instead of --epsilon")
    p.add_argument("--delta", type=float, help="delta (default: 1/(10 N), N = training sequences)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training file (default 3)")
    p.add_argument("--batch-size", type=float, default=16, help="expected Poisson batch size B (default 16)")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate (default 2e-3)")
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="adam",
                   help="base optimizer (default adam, as in the papers' GPT-2 runs; dice-adam brings its own)")
    p.add_argument("--clip", type=float, default=1.0, help="per-example clipping norm C (default 1)")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="train rank-R LoRA adapters on the attention "
                                                                     "projections only (default 0: every weight)")
    p.add_argument("--max-length", type=int, default=320, help="tokens per sequence (default 320: the byte "
                                                               "tokenizer's E2E lengths; GPT-2's are ~90)")
    p.add_argument("--pad-to", choices=("longest", "max-length"), default="longest",
                   help="pad each batch to its longest sequence (default: sound for GPT-2, whose causal attention "
                        "with right padding ignores the padding; tested) or to --max-length (sound for any model)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (default 0)")
    p.add_argument("--max-physical-batch", type=int, default=8, help="examples per vmap call (memory only)")
    p.add_argument("--grad-path", choices=("rows", "fast", "auto"), default="auto",
                   help="per-example gradients: rows (torch.func) or fast (book-keeping, no rows; full fine-tuning and --lora)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model initialisation (public)")
    p.add_argument("--reproducible-noise", action="store_true", help="derive the secret streams from --seed "
                                                                     "(tests; the guarantee then needs it secret)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no per-epoch lines")
    return p.parse_args(argv)


def build(args: argparse.Namespace):
    """(model, tokenizer): a random tiny GPT-2 with the byte tokenizer, or local weights."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    torch.manual_seed(args.seed)
    if args.tiny:
        tok = byte_tokenizer()
        eos = tok.convert_tokens_to_ids(tok.eos_token)
        cfg = GPT2Config(vocab_size=len(tok), n_positions=args.max_length, n_embd=64, n_layer=2, n_head=2,
                         bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
        # eager attention: transformers' causal-mask code then runs inside torch.func.vmap (under SDPA it tests
        # the mask's values, and the rows path computes the examples one at a time)
        model = GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    else:
        d = Path(args.model_dir)
        if not (d / "config.json").is_file():
            raise ConfigError(f"--model-dir {d}: no config.json there; point it at a directory written by "
                              f"GPT2LMHeadModel.save_pretrained (config.json, model.safetensors) and the "
                              f"tokenizer's save_pretrained (tokenizer.json or vocab.json + merges.txt)")
        tok = AutoTokenizer.from_pretrained(d)
        model = GPT2LMHeadModel.from_pretrained(d, attn_implementation="eager")
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    if args.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                                 target_modules=["c_attn"], fan_in_fan_out=True))
    return model.to(args.device), tok


@torch.no_grad()
def perplexity(model, data: E2EDataset, collate: LMCollate, device: str, batch: int = 16) -> tuple[float, float]:
    """(mean loss per reference token, perplexity) on ``data``."""
    model.eval()
    total = tokens = 0.0
    try:
        for s in range(0, len(data), batch):
            b = collate([data[i] for i in range(s, min(s + batch, len(data)))])
            b = {k: v.to(device) for k, v in b.items()}
            labels = b.pop("labels")
            total += float(sequence_loss(model(**b), labels).sum())
            tokens += float(token_count(labels).sum())
    finally:
        model.train()
    mean = total / max(tokens, 1.0)
    return mean, math.exp(min(mean, 700.0))


def run(args: argparse.Namespace) -> dict:
    """Train, report per epoch, return the results (epsilon, losses, perplexities)."""
    if args.algo not in algorithms.ALGORITHMS:
        raise ConfigError(f"--algo {args.algo!r} is not an algorithm; choose one of {', '.join(algorithms.ALGORITHMS)}")
    pairs = read_e2e(args.train)
    if args.valid:
        train_pairs, valid_pairs = pairs, read_e2e(args.valid)
    else:
        cut = max(1, int(round(0.8 * len(pairs))))
        train_pairs, valid_pairs = pairs[:cut], pairs[cut:] or pairs[:1]
    model, tok = build(args)
    pad = tok.pad_token_id
    collate = LMCollate(pad, args.max_length if args.pad_to == "max-length" else None)
    train, valid = (E2EDataset(p, tok, args.max_length) for p in (train_pairs, valid_pairs))
    n = len(train)
    delta = args.delta if args.delta is not None else 1.0 / (10 * n)
    algo = algorithms.get(args.algo)
    optimizer = None if args.algo == "dice-adam" else args.optimizer
    engine = DPEngine(model, args.algo, n=n, batch_size=args.batch_size, epochs=args.epochs,
                      epsilon=None if args.noise_multiplier is not None or not algo.private else args.epsilon,
                      noise_multiplier=args.noise_multiplier if algo.private else None, delta=delta,
                      config=AlgoConfig(lr=args.lr, clip=args.clip, optimizer=optimizer),
                      loss_fn=sequence_loss, max_physical_batch=args.max_physical_batch, grad_path=args.grad_path,
                      noise_seed=args.seed if args.reproducible_noise else None)
    loader = PoissonLoader(engine, train, collate_fn=collate, num_workers=args.workers)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head = {"model": "tiny GPT-2" if args.tiny else args.model_dir, "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": trainable, "train_sequences": n, "valid_sequences": len(valid), "algo": args.algo,
            "noise_multiplier": engine.noise_multiplier, "sample_rate": engine.sample_rate,
            "steps": engine.total_steps, "delta": delta, "grad_path": engine.grad_path_note}
    log = None if args.quiet else sys.stderr if args.json else sys.stdout  # --json keeps stdout for the JSON
    if log:
        print(" ".join(f"{k}={v}" for k, v in head.items()), file=log, flush=True)
    history, t0 = [], time.perf_counter()
    _, ppl0 = perplexity(model, valid, LMCollate(pad), args.device)
    for epoch in range(args.epochs):
        t = time.perf_counter()
        loss = _epoch(engine, loader, epoch, args.epochs, log)
        val_loss, ppl = perplexity(model, valid, LMCollate(pad), args.device)
        rep = engine.privacy()
        history.append({"epoch": epoch + 1, "train_loss_per_sequence": loss, "valid_loss_per_token": val_loss,
                        "valid_perplexity": ppl, "epsilon": rep.epsilon, "epoch_time_s": time.perf_counter() - t})
        if log:
            print(f"epoch {epoch + 1}/{args.epochs}: train loss/sequence {loss:.2f}, valid loss/token {val_loss:.3f}, "
                  f"perplexity {ppl:.2f}, epsilon {rep.epsilon:.3f}, {time.perf_counter() - t:.1f} s", file=log,
                  flush=True)
    rep = engine.privacy()
    return {**head, "initial_valid_perplexity": ppl0, "history": history, "valid_perplexity": history[-1]["valid_perplexity"],
            "epsilon": rep.epsilon, "certified": rep.certified, "caveats": list(rep.caveats),
            "accountant": rep.accountant, "basis": rep.basis, "wall_time_s": time.perf_counter() - t0}


def _epoch(engine: DPEngine, loader: PoissonLoader, epoch: int, epochs: int, log) -> float:
    """One epoch of Poisson steps (``engine.train_epoch``), with a progress bar of its steps on ``log``
    (stderr when the lines go to stderr) unless ``log`` is None; returns the mean loss per sequence."""
    if log is None:
        return engine.train_epoch(loader)
    from tqdm.auto import tqdm
    bar = tqdm(total=len(engine.sampler), desc=f"epoch {epoch + 1}/{epochs}", unit="step", leave=False,
               file=sys.stderr)

    def after(_engine: DPEngine, losses: torch.Tensor) -> None:
        bar.update(1)
        if len(losses):
            bar.set_postfix(loss=f"{float(losses.mean()):.3g}", refresh=False)
    try:
        total, count = run_steps(engine, loader, None, len(engine.sampler), after=after)  # as train_epoch
    finally:
        bar.close()
    return total / max(count, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        res = run(args)
    except (ClipbiasError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"valid perplexity {res['initial_valid_perplexity']:.2f} -> {res['valid_perplexity']:.2f}; "
              f"epsilon {res['epsilon']:.3f} at delta {res['delta']:.2g} ({res['accountant']}, certified: "
              f"{str(res['certified']).lower()}; {res['basis']})"
              + "".join(f"\nNOT certified: {c}" for c in res["caveats"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
