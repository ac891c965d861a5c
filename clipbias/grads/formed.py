"""``FormedRows``: the shared half of the fast-path rules that form each example's gradient rows
(``grads.layers.base.PerChannel``, ``grads.layers.vit.Tokens``): their squared norms are ``sq_norms``' upper bounds on the
very rows that are summed, and the sums, one example's row, a weighted combination and the cross term
with another point's rows (DiSK) are read off the rows."""

from __future__ import annotations

import torch
from torch import Tensor

from .precision import sq_norms


class FormedRows:
    """A rule holding ``rows``, one ``[b, k]`` tensor per parameter; ``sq`` and ``terms`` follow from them."""

    rows: list[Tensor]

    def form(self, rows: list[Tensor]) -> None:
        """Keep ``rows`` and their squared norms (``sq``) and summand count (``terms``)."""
        self.rows = rows
        self.sq = sum(sq_norms(r) for r in rows)
        self.terms = sum(r.shape[1] for r in rows) + 1

    def sums(self, S: Tensor) -> list[Tensor]:
        return [S.to(r.dtype) @ r for r in self.rows]

    def one(self, i: int) -> list[Tensor]:
        return [r[i] for r in self.rows]

    def combo(self, idx: list[int], w: list[float]) -> list[Tensor]:
        return [torch.tensor(w, dtype=r.dtype, device=r.device) @ r[idx] for r in self.rows]

    def cross(self, o: "FormedRows") -> Tensor:
        return sum((r * s).sum(1) for r, s in zip(self.rows, o.rows))
