"""Linear layers: ``nn.Linear`` (any input rank) and transformers' ``Conv1D`` (GPT-2's layers: ``y = x W + b``
with ``W [in, out]``, a Linear with its weight transposed; that class exactly, with the reviewed ``forward``;
transformers is not imported by clipbias), weights and biases.

For a layer with input activations ``a_i`` (``[L, k]``: L positions, k features; L = 1 for a plain Linear)
and output gradients ``b_i`` (``[L, o]``) the per-example weight gradient is ``G_i = b_i^T a_i``, so

* ``||G_i||^2`` is ``||a_i||^2 ||b_i||^2`` when L = 1, and otherwise either ``<a_i a_i^T, b_i b_i^T>``
  (the ghost norm, ``L^2`` per example) or ``||b_i^T a_i||^2`` directly (``o k`` per example),
  whichever is smaller (mixed ghost clipping, Bu et al. 2022) within the budget of formed rows
  (``fast.FORMED_BYTES``);
* ``sum_i s_i G_i = (s * b)^T a`` over all positions: one matrix product (book-keeping, no second
  backward pass).

Only the ghost norm needs its own rounding bound (``ghost_norm_bound``): the other branches form what
they sum. ``Matrix`` is the rule's arithmetic, shared with the convolutions (``layers.conv``)."""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor, nn

from .. import rms
from ..precision import SUM32_ETA, SUM32_RHO_MAX, full_float32, ghost_coef, sq_norms, sum32_abs, sum32_delta, \
    sum32_rho, unit_roundoff
from ..precision import gamma as _gamma
from .base import Rule, register, stacked, weight_and_bias_only

WIDE_BLOCK_BYTES = 64 * 2**20
"""The float64 sums of a ghost layer convert this much of its output gradients at a time."""

SUM32_BLOCK_BYTES = 64 * 2**20
"""The float32 route of a ghost layer's sums (``Matrix._f32_sums``) forms at most this many bytes of
per-example gradients at a time (a block of examples, or of one example's output rows)."""

SUM32_BLOCK_EXAMPLES = 8
"""... and sums at most this many examples' pieces in float32 (``precision.sum32_residual``)."""

SUM32_OVERFLOW = 2.0 ** 100
"""On the float32 route an example whose ``U_i = sum_l |a_l||g_l|`` in a layer reaches this (its float32
gradient could overflow) contributes nothing to that layer's sum: a decision on its own values (no real
activation times gradient comes near 1e30; the float64 route sums it)."""

CACHED_BLOCK_BYTES = 2 * 2**20
"""A one-position layer's float64 squared norms and sums convert this much of its inputs at a time:
a block that stays in the cache, instead of a float64 copy of the whole input written to memory and
read back (the step's largest cost on ScatterNet + linear at B = 2048)."""


def ghost_norm_bound(a: Tensor, g: Tensor) -> Tensor:
    """An upper bound on ``||g_i^T a_i||^2`` per example, from the ghost norm (rows ``a [b, L, k]``,
    ``g [b, L, o]``): ``<A A^T, G G^T>`` with the Gram matrices in ``a``'s precision and their
    elementwise products summed in float64, plus a bound on every rounding error.

    The ghost norm is a sum over position pairs whose terms cancel when an example's positions
    contribute opposite gradients; the computed value can then be far below the true norm (an input
    crafted so got a clipped contribution of 2.42 C in float32), so clipping by it is unsound. With
    ``u`` the unit roundoff of the Gram products (``unit_roundoff``), every Gram entry is within
    ``gamma_k |a_l||a_m|`` (resp. ``gamma_o |g_l||g_m|``) of the true one; their products are exact in
    float64 and the float64 sum of ``L^2`` of them adds ``gamma64_{L^2}`` of the magnitudes; so with
    ``U_i = sum_l |a_l||g_l|`` the true squared norm is at most the computed one plus
    ``(gamma_k + gamma_o + gamma_k gamma_o + 2 gamma64_{L^2}) U_i^2``. Products below the smallest
    normal float (flushed to zero where the hardware does) add at most ``2^-126`` each, i.e.
    ``2^-126 (k (sum_l |g_l|)^2 + o (sum_l |a_l|)^2)``. ``U_i`` and those sums are computed from
    float32 norms (relative error below ``gamma_{k+2}``, ``gamma_{o+2}``) and enlarged by that. The
    bound is taken twice over: a margin for the terms of second order."""
    L, k, o = a.shape[1], a.shape[2], g.shape[2]
    if a.dtype != torch.float64:  # bfloat16 activations (autocast) widen exactly to float32
        a, g = a.float(), g.float()
    u = unit_roundoff(a)
    with full_float32():  # the Grams at float32's own precision whatever TF32 / matmul precision say
        sq = (torch.bmm(a, a.transpose(1, 2)).double() * torch.bmm(g, g.transpose(1, 2)).double()).sum((1, 2))
    na, ng = torch.linalg.vector_norm(a, dim=2).double(), torch.linalg.vector_norm(g, dim=2).double()
    grow = (1 + _gamma(k + 2, u)) * (1 + _gamma(o + 2, u)) * (1 + _gamma(L + 1, 2.0 ** -53))
    U, sa, sg = (na * ng).sum(1) * grow, na.sum(1) * grow, ng.sum(1) * grow
    coef = ghost_coef(L, k, o, u)  # (the float32 sums' route reads the same coefficient: sum32_rho)
    tiny = 2.0 ** -1022 if a.dtype == torch.float64 else 2.0 ** -126  # bfloat16 has float32's range
    return sq.clamp_min(0) + 2 * (coef * U.square() + tiny * (k * sg.square() + o * sa.square()))


class Matrix:
    """Linear, Conv (``layers.conv.ConvGrads``), Conv1D: example i's weight gradient is ``g_i^T a_i`` over its L positions (rows
    ``a [b, L, k]``, ``g [b, L, o]``). L = 1: ``||a_i||^2 ||g_i||^2``. Otherwise the per-example
    gradient ``G_i`` formed, its norm taken and the sums made from it (what the rows path does), or,
    where ``G_i`` for the micro-batch would pass the budget (``fast.ghost_plan``) and ``L^2 <= o k``, the ghost
    norm with its rounding bound (``ghost_norm_bound``: an upper bound on the true norm, so a
    clipped contribution is at most C however its positions cancel) and the sums as one float64
    product ``(s * g)^T a`` over (example, position) pairs: float64, so that an example whose
    position terms are large and cancel (bounded by the clip: ``s_i U_i <= C / sqrt(coef)``) cannot
    round other examples' terms away (in float32 one changed the released sum by 8.15 C).

    transformers' ``Conv1D`` (``y = x W + b``, ``W [k, o]``) is a Linear with its weight transposed
    (``t``, ``Transposed``): the same norms, and its weight's pieces laid out ``[k, o]`` (``a_i^T g_i``)."""

    transposed = False
    """Whether the weight is laid out ``[k, o]`` (transformers' ``Conv1D``)."""

    def __init__(self, m: nn.Module, a: Tensor, g: Tensor, ghost: bool) -> None:
        L, k, o = self.sizes(m, a, g)
        a, g = self.prepare(a, g)
        self.t = self.transposed
        self.w, self.bias = m.weight.requires_grad, m.bias is not None and m.bias.requires_grad
        grouped = self.grouped(m)  # groups (depthwise too): the per-example gradient formed, group by group
        self.ghost = ghost and L > 1 and L * L <= o * k and not grouped
        formed = (L > 1 or grouped) and not self.ghost
        # the longest float64 sum behind sq and cross (DiSK's combination bounds its rounding with it)
        self.terms = (o * k if formed else k + o if L == 1 else L * L + k + o) + o + 1
        self.pe: Tensor | None = None
        if formed:  # the per-example weight gradient, kept for the sums
            self.pe = self.form(m, a, g)
            a, g = self.rows(m, a, g, True)
            sq = sq_norms(self.pe)
        else:
            a, g = self.rows(m, a, g, False)
            if L == 1:  # in float64: in float32 ||a||^2 underflows for |a_j| <= 2^-75 while g a^T does not
                sq = _wide_sq(a) * g.double().square().sum((1, 2))
            else:  # the ghost norm: an upper bound on the true norm, whatever the rounding
                sq = ghost_norm_bound(a, g)
        self.a, self.g = a, g
        self.tied = False  # a weight shared with an Embedding: its sums in float64 (fast._rules_of, layers.tied)
        self.sum32: float | None = None  # the float32 route's factor cap where it sums this layer (float32_sum_route)
        self.sq = (sq * self.w) + (sq_norms(g.sum(1)) if self.bias else 0)

    @staticmethod
    def sizes(m: nn.Module, a: Tensor, g: Tensor) -> tuple[int, int, int]:
        """The layer's (positions L, input features k, outputs o) per example, from its input ``a`` and its
        output (or output gradient) ``g``."""
        return a[0].numel() // a.shape[-1], a.shape[-1], g.shape[-1]

    @staticmethod
    def grouped(m: nn.Module) -> bool:
        """Whether the per-example gradient is always formed, group by group (a grouped convolution)."""
        return False

    @staticmethod
    def prepare(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """The input and output gradient as ``form`` reads them: ``[b, L, k]`` and ``[b, L, o]``."""
        b = g.shape[0]
        return a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])

    def form(self, m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
        """``[b, o, k]`` (``[b, k, o]`` transposed): every example's weight gradient."""
        return torch.bmm(a.transpose(1, 2), g) if self.t else torch.bmm(g.transpose(1, 2), a)

    @staticmethod
    def rows(m: nn.Module, a: Tensor, g: Tensor, formed: bool) -> tuple[Tensor | None, Tensor]:
        """The rows ``a [b, L, k]`` (None where ``formed`` makes them unneeded) and ``g [b, L, o]`` the
        norms and sums read."""
        return a, g

    def sums(self, S: Tensor) -> list[Tensor]:
        """``[n, numel]`` per parameter: ``sum_i S[j, i] grad_i`` for every row j of ``S [n, b]``."""
        out, dt = [], self.g.dtype
        if self.w:
            if self.pe is not None and self.tied:  # float64: see layers.tied.tie_cross's last paragraph
                out.append(S.double() @ self.pe.flatten(1).double())
            elif self.pe is not None:
                out.append(S.to(dt) @ self.pe.flatten(1))
            elif self.ghost and self.sum32 is not None:  # sum_precision="float32" (float32_sum_route)
                out.append(self._f32_sums(S))
            elif self.ghost:  # float64: see the class docstring
                out.append(stacked([self._wide_sum(s) for s in S]))
            else:  # L = 1: one product per example, in float64 and rounded once: in float32 a_ij s_i could
                # round into the subnormals (up to 100 %) before meeting a huge g_i (1.96 C was released)
                out.append(self._one_position_sums(S))
        if self.bias:
            out.append(S.to(dt) @ self.g.sum(1))
        return out

    def _one_position_sums(self, S: Tensor) -> Tensor:
        """``[n, o k]``: ``sum_i S[j, i] g_i^T a_i`` for a one-position layer, every product in float64
        (``s_i g_i`` then times ``a_i``) and summed in float64, each entry rounded once to the layer's
        dtype; ``a`` converted a cached block of examples at a time (``CACHED_BLOCK_BYTES``)."""
        b, k = self.a.shape[0], self.a.shape[-1]
        a = self.a.reshape(b, k)
        gs = torch.cat([(self.g.reshape(b, -1).double() * s.double().view(-1, 1)).t() for s in S])  # [n o, b]
        step = max(1, CACHED_BLOCK_BYTES // (8 * k))
        out = gs.new_zeros(gs.shape[0], k)
        for i in range(0, b, step):  # accumulated in place: no temporary product per block
            out.addmm_(gs[:, i:i + step], a[i:i + step].double())
        if self.t:  # [n, o, k] -> Conv1D's [n, k, o]
            out = out.reshape(len(S), -1, k).transpose(1, 2)
        return out.reshape(len(S), -1).to(torch.float64 if self.tied else self.g.dtype)

    def _wide_sum(self, s: Tensor) -> Tensor:
        """``sum_i s_i g_i^T a_i`` flat, computed in float64 and rounded to the layer's dtype, a block
        of output rows at a time so that the float64 copy of ``g`` stays within ``WIDE_BLOCK_BYTES`` (a
        language model's head has ``b L`` x vocabulary output gradients)."""
        b, L, k = self.a.shape
        g = self.g.reshape(b * L, -1)
        sa = (self.a.double() * s.double().view(-1, 1, 1)).reshape(b * L, k)
        step = max(1, WIDE_BLOCK_BYTES // (8 * b * L))
        dt = torch.float64 if self.tied else self.g.dtype  # a tied weight's: rounded once, with the other use's
        if self.t:  # Conv1D's layout [k, o]
            out = self.g.new_empty(k, g.shape[1], dtype=dt)
            for j in range(0, g.shape[1], step):
                out[:, j:j + step] = sa.t() @ g[:, j:j + step].double()  # rounded once, on assignment
            return out.reshape(-1)
        out = self.g.new_empty(g.shape[1], k, dtype=dt)
        for j in range(0, g.shape[1], step):
            out[j:j + step] = g[:, j:j + step].t().double() @ sa  # rounded once, on assignment
        return out.reshape(-1)

    def _f32_sums(self, S: Tensor) -> Tensor:
        """``[n, numel]``: ``sum_i S[j, i] T_i`` with ``T_i`` example i's weight gradient formed in float32 (a
        batched product over its L positions alone, ``SUM32_BLOCK_BYTES`` at a time) and the examples' pieces
        summed in float32, ``SUM32_BLOCK_EXAMPLES`` at a time, the blocks' sums in float64 and rounded once
        (``sum_precision="float32"``; the proof: docs/privacy.md, "Float32 clipped sums").
        Row 0's factors are capped at ``self.sum32`` (``float32_sum_route``: the underflow share of delta), and an
        example whose ``U_i`` reaches ``SUM32_OVERFLOW`` contributes nothing here (its piece could overflow)."""
        b = self.a.shape[0]
        x, y = (self.a, self.g) if self.t else (self.g, self.a)  # G_i = x_i^T y_i, laid out as the weight
        S32 = S.to(torch.float32, copy=True)  # (the caller's S stays as it is)
        S32[0] = S32[0].clamp(max=self.sum32)
        U = (torch.linalg.vector_norm(self.a, dim=2).double() * torch.linalg.vector_norm(self.g, dim=2).double()).sum(1)
        big = ~(U < SUM32_OVERFLOW)  # (NaN too: such an example's norm is not finite, and the step stops)
        if bool(big.any()):
            x = x.masked_fill(big.view(-1, 1, 1), 0.0)
            S32[:, big] = 0.0
        xt = x.transpose(1, 2).contiguous()  # [b, rows, L]
        rows, cols, n = xt.shape[1], y.shape[2], len(S)
        per = rows * cols * x.element_size()  # one example's gradient
        step = max(1, min(SUM32_BLOCK_EXAMPLES, SUM32_BLOCK_BYTES // per))
        rstep = rows if per <= SUM32_BLOCK_BYTES else max(1, SUM32_BLOCK_BYTES // (cols * x.element_size()))
        # one block of examples: its float32 sum is the release; several: their float32 sums added in float64
        # and rounded once (the sum across examples then rounds within SUM32_BLOCK_EXAMPLES pieces at a time)
        out = x.new_zeros(n, rows, cols, dtype=torch.float32 if b <= step else torch.float64)
        for i in range(0, b, step):  # per example in float32, then summed over the block's examples in float32
            for r in range(0, rows, rstep):
                T = torch.bmm(xt[i:i + step, r:r + rstep], y[i:i + step])  # [c, rt, cols]: T_i, one per example
                out[:, r:r + rstep] += (S32[:, i:i + step] @ T.flatten(1)).view(n, -1, cols)
        return out.reshape(n, -1).to(x.dtype)

    def one(self, i: int) -> list[Tensor]:
        """Example i's gradient, one flat tensor per parameter."""
        w = self.pe[i] if self.pe is not None else self.a[i].t() @ self.g[i] if self.t else self.g[i].t() @ self.a[i]
        return ([w.reshape(-1)] if self.w else []) + ([self.g[i].sum(0)] if self.bias else [])

    def combo(self, idx: list[int], w: list[float]) -> list[Tensor]:
        """``sum_k w[k] (example idx[k]'s gradient)``, one flat tensor per parameter: one product over
        the probes' positions, not one per probe (a GPT head's per-example gradient is 100 MB)."""
        wt = torch.tensor(w, dtype=self.g.dtype, device=self.g.device)
        g = self.g[idx] * wt.view(-1, 1, 1)
        out = []
        if self.w and self.pe is not None:
            out.append(wt @ self.pe[idx].flatten(1))
        elif self.w:
            a, gf = self.a[idx].reshape(-1, self.a.shape[-1]), g.reshape(-1, g.shape[-1])
            out.append((a.t() @ gf if self.t else gf.t() @ a).reshape(-1))
        return out + ([g.sum((0, 1))] if self.bias else [])

    def cross(self, o: "Matrix") -> Tensor:
        """``<G_i, G'_i>`` per example, ``o`` the same layer's rule on the same examples at other weights
        (same shapes, so the same choice of ghost norm or per-example gradient as ``sq``)."""
        if self.pe is not None:
            w = (self.pe * o.pe).sum((1, 2))
        elif self.a.shape[1] == 1:
            w = (self.a * o.a).sum((1, 2)) * (self.g * o.g).sum((1, 2))
        else:  # sum over position pairs of (a_l . a'_m)(g_l . g'_m): DiSK's rules are float64 throughout
            w = (torch.bmm(self.a, o.a.transpose(1, 2)) * torch.bmm(self.g, o.g.transpose(1, 2))).sum((1, 2))
        return w * self.w + ((self.g.sum(1) * o.g.sum(1)).sum(1) if self.bias else 0)


def _wide_sq(a: Tensor) -> Tensor:
    """``[b]`` squared norms of ``a [b, 1, k]``'s rows in float64, a cached block of examples at a time."""
    b, k = a.shape[0], a.shape[-1]
    a = a.reshape(b, k)
    step = max(1, CACHED_BLOCK_BYTES // (8 * k))
    return torch.cat([a[i:i + step].double().square().sum(1) for i in range(0, b, step)])



def float32_sum_route(rules: list, bound: float | None) -> tuple[dict[int, str], float]:
    """``sum_precision="float32"`` for one micro-batch: ``({index: "float32" | "float64"}, delta)`` over the ghost
    layers among ``rules`` (each ``Matrix`` there gets ``sum32`` set, its factor cap, or None), ``delta`` the
    step's proven inflation (``precision.sum32_delta``, at most ``SUM32_DELTA``; 0 where no layer takes float32).

    A ghost layer takes float32 where its weight's sum is its own (not a tied weight's: those stay float64,
    ``layers.tied``), its rows are float32 and ``sum32_rho`` of its shapes is at most ``SUM32_RHO_MAX``: decided
    from the shapes and ``bound`` alone (the per-example bound C of the step's clip or normalisation), never from
    the values. Without a finite positive ``bound`` every layer keeps float64. The factor cap ``SUM32_ETA bound / A``
    (``A``: ``sum32_abs`` over the float32 layers, combined in quadrature) bounds the underflow share."""
    routes, rhos, absolute = {}, [], []
    for j, r in enumerate(rules):
        if isinstance(r, Matrix):
            r.sum32 = None
        if not isinstance(r, Matrix) or not r.ghost or not r.w:
            continue
        _, L, k = r.a.shape
        o = r.g.shape[2]
        rho = sum32_rho(L, k, o)
        ok = bound is not None and math.isfinite(bound) and bound > 0 and not r.tied \
            and r.a.dtype == torch.float32 and r.g.dtype == torch.float32 and rho <= SUM32_RHO_MAX
        routes[j] = "float32" if ok else "float64"
        if ok:
            rhos.append(rho)
            absolute.append(sum32_abs(L, k, o))
    if not rhos:
        return routes, 0.0
    cap = SUM32_ETA * bound / math.sqrt(sum(v * v for v in absolute))
    for j, route in routes.items():
        if route == "float32":
            rules[j].sum32 = cap
    return routes, sum32_delta(max(rhos))


class Transposed(Matrix):
    """transformers' ``Conv1D``: a Linear whose weight is laid out ``[k, o]``."""

    transposed = True


class MatrixRule(Rule):
    """The rule of the layers whose weight gradient is ``g^T a`` (``grads_type``: their ``Matrix``): the
    ghost norm where ``fast.ghost_plan`` says, the reference sum from the formed rows or a one-position
    layer's sums, else from autograd."""

    grads_type: type[Matrix] = Matrix

    def plan(self, m: nn.Module, a: Tensor, out: Tensor) -> tuple[int, bool] | None:
        L, k, o = self.grads_type.sizes(m, a, out)
        grouped = self.grads_type.grouped(m)  # formed always (Matrix)
        if L == 1 and not grouped:
            return None
        size = out.shape[0] * o * k * max(a.element_size(), 4)  # 16-bit inputs are formed in float32 (fast._rule)
        return size, L * L <= o * k and not grouped

    def own_reference(self, m: nn.Module, ghost: bool) -> bool:
        return not ghost

    def grads(self, m: nn.Module, a: Tensor, g: Tensor, ghost: bool) -> Matrix:
        return self.grads_type(m, a, g, ghost)


class LinearRule(MatrixRule):
    name = "linear"
    types = separable = (nn.Linear,)

    def input_dims(self, m: nn.Module) -> tuple[int, int | None]:
        return 2, None  # acts on the last dimension: the batch's must come before it

    def tie(self, m: nn.Module) -> str:
        return "matrix"


_CONV1D_MODULE, _CONV1D_NAME = "transformers.pytorch_utils", "Conv1D"


# The reviewed ``forward`` of Hugging Face's ``Conv1D`` (GPT-2's layers): ``y = x W + b`` over the last
# dimension with ``W`` of shape ``[in, out]``, a Linear with its weight transposed. A Conv1D is accepted
# when its class's ``forward`` has this function's bytecode, constants, names and arguments and reads the
# real ``torch`` (``rms.same_code``), and the instance has no ``forward`` of its own.
def _reviewed_conv1d(self, x):
    size_out = x.size()[:-1] + (self.nf,)
    x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
    x = x.view(size_out)
    return x


class Conv1DRule(MatrixRule):
    """transformers' ``Conv1D``, exactly that class (not a subclass; transformers is not imported here: a model
    holding one has imported it), with ``_reviewed_conv1d``'s bytecode (``rms.same_code``)."""

    name = "conv1d-transformers"
    grads_type = Transposed

    def kind(self, c: type) -> bool:
        return (c.__module__, c.__name__) == (_CONV1D_MODULE, _CONV1D_NAME)

    def claims(self, m: nn.Module) -> bool:
        mod = sys.modules.get(_CONV1D_MODULE)
        return mod is not None and type(m) is getattr(mod, _CONV1D_NAME, None)

    def why_not(self, m: nn.Module, name: str) -> str | None:
        if "forward" in m.__dict__ or not rms.same_code(type(m).forward, _reviewed_conv1d):
            return f"module '{name}' (Conv1D): its forward is not the reviewed transformers Conv1D.forward"
        return weight_and_bias_only(m, name)

    def tie(self, m: nn.Module) -> str:
        return "matrix"


register(LinearRule())
register(Conv1DRule())
