"""Red team, keyed dropout: is an example's dropout mask independent of the batch it sits in?  Masks are
keyed by (key, step, example index) but laid out over the example's *padded* shape, and each call's
keystream starts after the previous call's blocks: so with dynamic padding (a collate that pads to
the batch's longest example) the longest example's presence changes every other example's masks.
Tiny GPT-2, right padding with its attention mask (which docs/privacy.md calls padding-safe), dropout
0.1 (hidden and SDPA attention), fast path.  Measured: the clipped sum of 8 short examples padded to
12 tokens vs the same 8 padded to 20 (as when a long example joins the batch), same key, step and
indices, in units of C; with dropout off, the same comparison (should be ~0).  Before the fix: 1.11 C on both
paths.  Fixed (each call its own stream, each element's word by its coordinates): 0.000 C."""
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
import transformers  # noqa: E402

from clipbias.config import AlgoConfig  # noqa: E402
from clipbias.data.text import sequence_loss  # noqa: E402
from clipbias.engine import DPEngine  # noqa: E402

C, N = 0.05, 8


def gpt2(dropout):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=32, bos_token_id=100,
                                  eos_token_id=100, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").train()


def batch(ids, lengths, width):
    x = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros_like(x)
    for r, (t, n) in enumerate(zip(ids, lengths)):
        x[r, :n], mask[r, :n] = t[:n], 1
    y = x.masked_fill(mask == 0, -100)
    return {"input_ids": x, "attention_mask": mask}, y


def clipped_sum(dropout, width, path="fast", rows=None):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (N, 20), generator=g)
    lengths = [12, 11, 10, 12, 9, 12, 8, 12]
    rows = list(range(N)) if rows is None else rows
    ids, lengths = ids[rows], [lengths[r] for r in rows]
    eng = DPEngine(gpt2(dropout), "dpsgd", n=64, batch_size=N, steps=2, noise_multiplier=1.0, accountant="rdp",
                   loss_fn=sequence_loss, grad_path=path, config=AlgoConfig(lr=0.1, clip=C), noise_seed=3)
    got, finish = [], eng.pipeline.finish
    eng.pipeline.finish = lambda p, r: (got.append(p.detach().clone()), finish(p, r))[1]
    x, y = batch(ids, lengths, width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # indices of our choosing: uncertified, fine for a measurement
        eng.step(x, y, torch.tensor(rows))
    return got[0].double()


def main(path="fast"):
    out = {}
    for p in (0.0, 0.1):
        a, b = clipped_sum(p, 12, path), clipped_sum(p, 20, path)
        out[p] = float((a - b).norm()) / C
        print(f"{path} path, dropout {p}: padding 12 -> 20 moves the 8 examples' clipped sum by {out[p]:.3f} C "
              f"(their sum itself: {float(a.norm()) / C:.2f} C)")
    # at a fixed width: batch size and order do not move an example's masks (sum of parts = sum of the whole)
    whole = clipped_sum(0.1, 12, path)
    parts = clipped_sum(0.1, 12, path, [4, 0, 2, 1, 3]) + clipped_sum(0.1, 12, path, [7, 5, 6])
    out["split"] = float((whole - parts).norm()) / C
    print(f"{path} path, dropout 0.1, width 12: 8 examples at once vs split 5 + 3 in other orders: {out['split']:.2e} C")
    return out


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fast")
