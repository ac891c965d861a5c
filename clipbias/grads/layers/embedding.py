"""Embeddings: ``nn.Embedding``. Example i's weight gradient has one nonzero row per distinct token it
holds, the sum of its output gradients at that token's positions: norm and sums from those, ``O(L d)`` per
example; ``padding_idx`` rows get no gradient. Ids shared by the whole batch, a ``[1, T]`` input such as
Hugging Face's broadcast ``position_ids``, have their output expanded to the batch, so that each example's
output gradient is its own. ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are refused. Its weight
shared with a Linear or Conv1D (tied input and output embeddings): ``layers.tied``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..precision import sq_norms
from .base import Rule, register, stacked


class Embed:
    """Embedding: example i's weight gradient has one nonzero row per distinct token it holds (the
    sum of its output gradients at that token's positions): those rows give the norm and the sums."""

    def __init__(self, m: nn.Embedding, idx: Tensor, g: Tensor) -> None:
        b, v = g.shape[0], m.num_embeddings
        idx, g = idx.reshape(b, -1), g.reshape(b, idx[0].numel(), -1)
        if m.padding_idx is not None:  # the padding row gets no gradient
            g = g * (idx != m.padding_idx).unsqueeze(-1).to(g.dtype)
        key = (torch.arange(b, device=idx.device).unsqueeze(1) * v + idx).reshape(-1)
        uniq, inv = torch.unique(key, return_inverse=True)
        self.rows = g.new_zeros(len(uniq), g.shape[-1]).index_add_(0, inv, g.reshape(-1, g.shape[-1]))
        self.owner, self.token, self.shape = uniq // v, uniq % v, m.weight.shape
        self.terms = g.shape[1] * g.shape[2] + 1  # an example's positions x width
        self.sq = torch.zeros(b, dtype=torch.float64, device=g.device).index_add_(0, self.owner, sq_norms(self.rows))
        self.tied = False  # a weight shared with a Linear/Conv1D: its sums in float64 (fast._rules_of, layers.tied)

    def cross(self, o: "Embed") -> Tensor:
        """Per example, over its tokens (the same inputs at other weights: the same (example, token) rows)."""
        return self.sq.new_zeros(self.sq.shape).index_add_(0, self.owner, (self.rows * o.rows).sum(1).double())

    def _place(self, token: Tensor, rows: Tensor) -> Tensor:
        return rows.new_zeros(self.shape).index_add_(0, token, rows).reshape(-1)

    def sums(self, S: Tensor) -> list[Tensor]:
        rows = self.rows.double() if self.tied else self.rows  # tied: float64, rounded once with the head's
        S = S.to(rows.dtype)
        return [stacked([self._place(self.token, rows * s[self.owner].unsqueeze(1)) for s in S])]

    def one(self, i: int) -> list[Tensor]:
        mine = self.owner == i
        return [self._place(self.token[mine], self.rows[mine])]

    def combo(self, idx: list[int], w: list[float]) -> list[Tensor]:
        weight = self.rows.new_zeros(len(self.owner))  # each (example, token) row weighted by its example's w
        for i, wk in zip(idx, w):
            weight[self.owner == i] = wk
        mine = weight != 0
        return [self._place(self.token[mine], self.rows[mine] * weight[mine].unsqueeze(1))]


class EmbeddingRule(Rule):
    name = "embedding"
    types = separable = (nn.Embedding,)  # a lookup per token, without max_norm and scale_grad_by_freq

    def why_not(self, m: nn.Module, name: str) -> str | None:
        why = super().why_not(m, name)
        if why is None and (m.max_norm is not None or m.scale_grad_by_freq or m.sparse):
            return (f"module '{name}' (Embedding) uses max_norm (rewrites the weights in the forward pass), "
                    f"scale_grad_by_freq (scales by counts over the whole batch) or sparse gradients")
        return why

    def why_not_separable(self, m: nn.Module) -> str | None:
        if m.max_norm is not None or m.scale_grad_by_freq:
            return "uses max_norm or scale_grad_by_freq (both depend on the batch's tokens)"
        return None

    def batch_rows(self, m: nn.Module, a: Tensor, out: Tensor, b: int) -> tuple[Tensor, Tensor]:
        if b > 1 and a.dim() > 1 and a.shape[0] == 1:
            # the same ids for every example (Hugging Face's broadcast position_ids, token_type_ids): the
            # output expanded to the batch, so that each example's output gradient is its own; broadcasting
            # it later gives the same values (the probe compares the attribution with each example alone)
            a, out = a.expand(b, *a.shape[1:]), out.expand(b, *out.shape[1:])
        return a, out

    def own_reference(self, m: nn.Module, ghost: bool) -> bool:
        return False

    def tie(self, m: nn.Module) -> str:
        return "table"

    def grads(self, m: nn.Module, a: Tensor, g: Tensor, ghost: bool) -> Embed:
        return Embed(m, a, g)


register(EmbeddingRule())
