"""Text data for DP fine-tuning of a causal language model on E2E NLG (Novikova et al. 2017).

The E2E task maps a meaning representation (``mr``: ``name[The Eagle], food[French], ...``) to a
restaurant description (``ref``). Following Li et al. 2021 ("Large language models can be strong
differentially private learners"), which the DiceSGD paper follows, an example is the text
``mr + " ||" + " " + ref + <eos>`` and the loss is on the reference tokens only.

Per-example losses are *summed* over each sequence (:func:`sequence_loss`, shape ``[b]``) so a
DP engine clips each example's whole gradient; perplexity is ``exp(sum(losses) / sum(token_count))``.
Batches are padded on the right: with a causal model the real tokens never attend to the padding,
so an example's loss does not depend on the other examples of its batch.

``transformers`` and ``tokenizers`` are imported only inside :func:`byte_tokenizer`, so this module
imports without them.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from .catalog import DataFormatError, DataNotFoundError
from ..errors import ConfigError, require

__all__ = ["E2EDataset", "EOS", "IGNORE", "LMCollate", "SEP", "byte_tokenizer", "lm_collate", "prompt",
           "read_e2e", "sequence_loss", "token_count"]

E2E_URL = "https://github.com/tuetschek/e2e-dataset"
EOS = "<|endoftext|>"
"""The one special token (GPT-2's): end of text, also used as beginning of text and padding."""
SEP = " ||"
"""Separates the meaning representation from the reference (Li et al. 2021)."""
IGNORE = -100
"""Label of the positions without loss (prompt, padding): ``cross_entropy``'s default ignore_index."""


def read_e2e(path: str | Path) -> list[tuple[str, str]]:
    """The ``(mr, ref)`` pairs of an E2E CSV file (utf-8, a header row naming ``mr`` and ``ref``;
    other columns are ignored). Raises :class:`DataNotFoundError` for a missing file and
    :class:`DataFormatError` (naming the file and line) for a missing column, an empty file or an
    empty ``mr`` / ``ref``."""
    path = Path(path)
    if not path.is_file():
        raise DataNotFoundError(f"E2E file not found: {path}. Download the E2E NLG data set from {E2E_URL} "
                                "(trainset.csv, devset.csv, testset_w_refs.csv) and pass the path of one of "
                                "its CSV files; examples/data/e2e_sample.csv is a small synthetic stand-in")
    pairs = []
    try:
        with open(path, encoding="utf-8-sig", newline="") as fh:  # -sig: a leading BOM is not part of "mr"
            reader = csv.DictReader(fh)
            if reader.fieldnames is None:
                raise DataFormatError(f"{path}: the file is empty; an E2E CSV starts with a header row "
                                      "naming the columns mr and ref")
            missing = [c for c in ("mr", "ref") if c not in reader.fieldnames]
            if missing:
                raise DataFormatError(f"{path}, line 1: the header lacks the column(s) {', '.join(missing)} "
                                      f"(it has {', '.join(reader.fieldnames) or 'none'}); an E2E CSV has "
                                      "the columns mr and ref")
            for row in reader:
                mr, ref = (row.get("mr") or "").strip(), (row.get("ref") or "").strip()
                for name, value in (("mr", mr), ("ref", ref)):
                    if not value:
                        raise DataFormatError(f"{path}, line {reader.line_num}: empty {name}; every row "
                                              "needs a meaning representation (mr) and a reference (ref)")
                pairs.append((mr, ref))
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataFormatError(f"{path}: not a utf-8 CSV file ({type(e).__name__}: {e}); save it as "
                              "utf-8 CSV with a header row mr,ref") from e
    if not pairs:
        raise DataFormatError(f"{path}: the header has no rows after it; the file holds no examples")
    return pairs


def byte_tokenizer() -> Any:
    """A byte-level tokenizer (a ``transformers.PreTrainedTokenizerFast``) that depends on no data.

    Its vocabulary is the 256 byte-level symbols (``tokenizers.pre_tokenizers.ByteLevel.alphabet()``
    sorted, ids 0..255), one token per utf-8 byte with no merges, plus ``<|endoftext|>`` (id 256)
    as eos, bos and pad: 257 tokens, and any string round-trips. Being fixed in advance it is
    public, which matters for privacy: a tokenizer trained on the private data (its merges, its
    vocabulary) would leak that data outside the DP guarantee. (GPT-2's pretrained tokenizer is
    public too; this one needs no download.)
    """
    require("tokenizers", "byte_tokenizer")
    require("transformers", "byte_tokenizer")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   clean_up_tokenization_spaces=False)


def prompt(mr: str) -> str:
    """The text a model continues to generate the reference of ``mr``: ``mr + " ||"``."""
    return mr + SEP


class E2EDataset(torch.utils.data.Dataset):
    """E2E pairs as causal-LM examples: item ``i`` is ``{"input_ids", "labels"}`` (long, same length).

    ``input_ids`` = tokens(``prompt(mr)``) + tokens(``" " + ref``) + [eos], truncated to
    ``max_length``; ``labels`` equal ``input_ids`` except :data:`IGNORE` on the prompt, so the loss
    is on the reference (and eos) only; an example whose prompt fills ``max_length`` has no target
    token (loss 0). Tokenised lazily in ``__getitem__``; picklable, for DataLoader workers, as long
    as the tokenizer is (Hugging Face tokenizers are). ``max_length`` counts tokens: 64 suits GPT-2's
    BPE; with :func:`byte_tokenizer` (one token per byte) E2E examples need ~256-384.
    """

    def __init__(self, pairs: Sequence[tuple[str, str]], tokenizer: Any, max_length: int = 64):
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ConfigError(f"max_length must be a positive integer, got {max_length!r}")
        if tokenizer.eos_token_id is None:
            raise ConfigError("the tokenizer has no eos token; set tokenizer.eos_token (GPT-2's is <|endoftext|>)")
        self.pairs, self.tokenizer, self.max_length = list(pairs), tokenizer, max_length

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        mr, ref = self.pairs[i]
        enc = self.tokenizer.encode
        head = enc(prompt(mr), add_special_tokens=False)
        ids = (head + enc(" " + ref, add_special_tokens=False) + [self.tokenizer.eos_token_id])[:self.max_length]
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = input_ids.clone()
        labels[:len(head)] = IGNORE
        return {"input_ids": input_ids, "labels": labels}


def lm_collate(items: Sequence[dict[str, Tensor]], pad_id: int, length: int | None = None) -> dict[str, Tensor]:
    """Stack :class:`E2EDataset` items, padded on the right to the batch's longest (or to ``length``):
    ``input_ids`` (padded with ``pad_id``), ``attention_mask`` (1 real, 0 padding) and ``labels``
    (padded with :data:`IGNORE`), each ``[b, T]`` long. Padded to the batch's longest, ``T`` depends on
    the other examples of the batch: sound for DP only with a model that ignores padding (a causal
    model with right padding: its real tokens never see the padding, so ``attention_mask`` changes no
    loss; tested for GPT-2). ``length`` pads every batch to the same ``T`` (items must not be longer),
    which needs no such assumption."""
    ids = [it["input_ids"] for it in items]
    longest = max(len(t) for t in ids)
    if length is not None and longest > length:
        raise ConfigError(f"an item has {longest} tokens, more than the padding length {length}; truncate the "
                          f"items to it (E2EDataset max_length)")
    T = longest if length is None else length

    def pad(ts: list[Tensor], value: int) -> Tensor:
        return torch.stack([torch.nn.functional.pad(t, (0, T - len(t)), value=value) for t in ts])
    return {"input_ids": pad(ids, pad_id), "attention_mask": pad([torch.ones_like(t) for t in ids], 0),
            "labels": pad([it["labels"] for it in items], IGNORE)}


class LMCollate:
    """:func:`lm_collate` with a fixed ``pad_id`` (and ``length``), as a picklable ``collate_fn``
    (a lambda is not)."""

    def __init__(self, pad_id: int, length: int | None = None):
        self.pad_id, self.length = pad_id, length

    def __call__(self, items: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
        return lm_collate(items, self.pad_id, self.length)


def sequence_loss(out: Any, labels: Tensor) -> Tensor:
    """Per-example causal-LM loss, shape ``[b]``: token cross-entropy of ``logits[:, t]`` predicting
    ``labels[:, t + 1]``, summed over each sequence; :data:`IGNORE` labels add nothing (a sequence
    without target tokens has loss 0). ``out`` is the logits ``[b, T, V]`` or a model output with
    ``.logits``. No data-dependent control flow: it runs inside ``torch.func.vmap``."""
    logits = out.logits if hasattr(out, "logits") else out
    tok = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:],
                                            ignore_index=IGNORE, reduction="none")
    return tok.sum(dim=1)


def token_count(labels: Tensor) -> Tensor:
    """Number of target tokens per example, shape ``[b]`` (the positions :func:`sequence_loss` sums)."""
    return (labels[:, 1:] != IGNORE).sum(dim=1)
