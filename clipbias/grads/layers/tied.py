"""A weight shared by two layers (tied weights): one ``nn.Embedding``'s weight and one Linear's (or ``Conv1D``'s)
of the same shape, a language model's tied input and output embeddings (GPT-2's ``wte`` and ``lm_head``). The
parameter's per-example gradient is the sum of both uses': its squared norm is ``||E_i||^2 + ||G_i||^2 + 2
<E_i, G_i>``, the cross term gathered at example i's tokens (``tie_cross``: ``O(b L P d)``, no ``[V, d]`` per
example) with a bound on its rounding (the expansion cancels when the uses' gradients do), and both layers'
sums go into the parameter's one slot. The two sides are the rules' ``tie``: ``"table"`` and ``"matrix"``.
Any other sharing is refused (``why_not_tied``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..precision import gamma as _gamma
from .base import RULES
from .embedding import Embed
from .linear import Matrix


def _side(m: nn.Module) -> str | None:
    """The side of a tie layer ``m`` takes (its rule's ``tie``), or None."""
    rule = RULES.rule_for(m)
    return None if rule is None else rule.tie(m)


def why_not_tied(uses: list[tuple[str, str, nn.Module]]) -> str | None:
    """None when a parameter's uses ``(module name, parameter name, module)`` are ones whose per-example
    gradients' cross term the fast path bounds (``tie_cross``): one ``nn.Embedding``'s weight and one
    Linear's (or ``Conv1D``'s) weight of the same shape, e.g. GPT-2's ``wte`` and ``lm_head``."""
    names = " and ".join(f"'{n}' ({type(m).__name__})" for n, _, m in uses)
    if len({id(m) for _, _, m in uses}) < len(uses):  # one module under two names: it may run twice
        return f"one module registered under several names: {names} (tied weights: it may run more than once)"
    emb = [u for u in uses if _side(u[2]) == "table"]
    mat = [u for u in uses if _side(u[2]) == "matrix"]
    if len(uses) == 2 and len(emb) == 1 and len(mat) == 1 and all(pn == "weight" for _, pn, _ in uses):
        return None
    return (f"parameter shared by modules {names} (tied weights): the fast path bounds a tied parameter's "
            f"per-example norm only for the weight of one Embedding shared with one Linear or Conv1D "
            f"(a language model's tied input and output embeddings)")


def tie_cross(emb: Embed, mat: Matrix) -> Tensor:
    """``2 <E_i, G_i>`` plus a bound on its rounding, per example ``[b]``: ``E_i`` an Embedding's
    per-example weight gradient (``emb.rows``: one row per distinct token t of example i), ``G_i`` the
    per-example weight gradient of a Linear (``g_i^T a_i``, ``[V, d]``) or Conv1D (``a_i^T g_i``) sharing
    the weight (``mat``), from the same backward. Only E's nonzero rows meet G, so
    ``<E_i, G_i> = sum_t E_i[t] . (sum_l g_i[l, t] a_i[l])``: the head's output gradients gathered at
    example i's token columns, ``O(b L P d)`` for P distinct tokens an example, no ``[V, d]`` per example.
    Where the Linear's rule formed ``G_i`` (``mat.pe``: what its sums release) the cross term is taken
    from ``G_i``'s rows at the tokens instead, ``O(b P d)``, with ``M_i = sum_t ||G_i[t]|| ||E_i[t]||``
    and ``n = d + P + 3``.

    The expansion ``||E||^2 + ||G||^2 + 2 <E, G>`` cancels when the two uses' gradients nearly cancel
    (an input can be crafted so), and its rounding could then exceed the true norm. The cross term is
    computed in float64 from the float32 (or float64) values, exact as products; with
    ``M_i = sum_{t, l} |g_i[l, t]| ||a_i[l]|| ||E_i[t]||`` (computed, float64), every dot product
    ``a_i[l] . E_i[t]`` is within ``gamma_d ||a_i[l]|| ||E_i[t]||`` and the sum of the ``L P`` products
    adds ``gamma_{L P + 1}`` of their magnitudes, so the computed cross term is within
    ``gamma_n M_i`` of the true one (``n = d + L P + 3``, unit roundoff ``2^-53``). The rules' ``sq``
    are upper bounds (``sq_norms``, ``ghost_norm_bound``) or float64 sums within ``gamma_n`` of them
    (a one-position layer: ``n >= k + 2 o + 1 = terms``), so the true squared norm of ``E_i + G_i``
    is at most ``sq_E + sq_G + 2 cross + gamma_n (sq_E + sq_G + 2 M_i)``, with n the largest of these
    counts; the margin is taken twice over for the terms of second order (the computed ``M_i``
    and ``sq`` themselves rounded). ``sq_G`` may hold the Linear's bias too: a larger margin.

    The bound lets a cancelling example's two uses each be ``~C / sqrt(margin)`` (about 180 C in
    float32, where ``sq_norms``' enlargement dominates) after clipping; summed in float32 with the
    other examples' gradients each addition at that magnitude rounds another example's term by up to
    half an ulp (removing such an example moved the others' float32 embedding sum by 1.96 C at
    B = 2^18: benchmarks/redteam/session/tied_absorb.py). So the tied weight's sums, both uses', are
    float64 (``tied``), added, and rounded once to the weight's precision (``fast.BookKeeping._ordered``)."""
    a, g = (mat.g, mat.a) if mat.t else (mat.a, mat.g)  # g's last dimension indexes the table's rows
    b, L, d = a.shape
    owner = emb.owner
    counts = torch.bincount(owner, minlength=b)
    pos = torch.arange(len(owner), device=owner.device) - (counts.cumsum(0) - counts)[owner]  # rank within example
    P = int(counts.max()) if len(owner) else 0
    R = torch.zeros(b, P, d, dtype=torch.float64, device=a.device)
    R[owner, pos] = emb.rows.double()
    tok = torch.zeros(b, P, dtype=torch.long, device=a.device)  # absent rows: token 0 against a zero row
    tok[owner, pos] = emb.token
    if mat.pe is not None:  # the formed per-example gradients (what the sums release): their rows at the tokens
        rows = mat.pe.gather(1, tok.unsqueeze(2).expand(b, P, d)).double()  # [b, P, d]
        cross = (rows * R).sum((1, 2))
        mag = (torch.linalg.vector_norm(rows, dim=2) * torch.linalg.vector_norm(R, dim=2)).sum(1)
        n = max(emb.terms, mat.terms, d + P + 3)
        return 2 * cross + 2 * _gamma(n, 2.0 ** -53) * (emb.sq + mat.sq + 2 * mag)
    gt = g.gather(2, tok.unsqueeze(1).expand(b, L, P)).double()  # [b, L, P]: g_i[l, t]
    ad = a.double()
    cross = (torch.bmm(ad, R.transpose(1, 2)) * gt).sum((1, 2))
    mag = (torch.linalg.vector_norm(ad, dim=2).unsqueeze(2) * torch.linalg.vector_norm(R, dim=2).unsqueeze(1)
           * gt.abs()).sum((1, 2))
    n = max(emb.terms, mat.terms, d + L * P + 3)
    return 2 * cross + 2 * _gamma(n, 2.0 ** -53) * (emb.sq + mat.sq + 2 * mag)
