"""A GPT-2-style causal transformer language model, built only from layers the fast path supports.

Token and position embeddings, pre-LayerNorm blocks (fused q/k/v ``Linear``, causal
attention, output projection, a 4x GELU MLP), a final LayerNorm and a
language-model head, as in GPT-2 (Radford et al. 2019), with one deliberate difference: the head is
**not tied** to the token embedding. A tied weight is one parameter used by two layers, whose
per-example gradient is the sum of both uses; per-layer norms would understate it, so the fast path
refuses tied weights (``clipbias.grads.fast``). Positions are looked up per example (``[b, t]``), so
every layer sees one row per example in dimension 0.

The default configuration (vocabulary 50257, width 512, 4 layers, 8 heads, context 64) has 64.5M
parameters: the scale of ``benchmarks/gpt_scale.py``. Random initialisation (normal, std 0.02).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import ConfigError


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP, both residual."""

    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ConfigError(f"width {width} must be a multiple of heads {heads}")
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: Tensor) -> Tensor:
        b, t, w = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        # causal attention written out: vmap (the rows path) has no batching rule for the fused CPU kernel
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(w // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v  # [b, heads, t, w / heads]
        h = h + self.proj(att.transpose(1, 2).reshape(b, t, w))
        return h + self.out(F.gelu(self.fc(self.ln2(h)), approximate="tanh"))


class GPT(nn.Module):
    """``forward(tokens [b, t]) -> logits [b, t, vocab]``; ``t`` at most ``context``."""

    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, vocab: int = 50257, context: int = 64, width: int = 512, layers: int = 4,
                 heads: int = 8) -> None:
        super().__init__()
        self.vocab, self.context = vocab, context
        self.input_shape = (context,)
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        b, t = tokens.shape
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens is longer than the context of {self.context}")
        pos = torch.arange(t, device=tokens.device).repeat(b, 1)  # contiguous: hook libraries (Opacus) view it
        return self.head(self.ln_f(self.blocks(self.wte(tokens) + self.wpe(pos))))


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Next-token cross-entropy of a batch, summed over the non-padding tokens (``targets ==
    ignore_index`` is padding) and divided by the sequence length (a public constant, so a fully
    padded sequence has loss 0, not NaN). Per example, pass a batch of one: the engine's ``loss_fn``."""
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="sum")
    return ce / targets.shape[-1]
