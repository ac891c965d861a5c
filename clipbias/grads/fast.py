"""The fast path for norm-scaling algorithms: per-example norms and the clipped sum without rows.

When the per-example stage only rescales each gradient by a function of its norm (clip, normalise:
``dpsgd``, ``normalized``, the DiceSGD family, the non-private baselines), the update needs
``sum_i s_i g_i`` and ``||g_i||``, not the ``[b, d]`` matrix of rows. For a layer with input
activations ``a_i`` (``[L, k]``: L positions, k features; L = 1 for a plain Linear) and output
gradients ``b_i`` (``[L, o]``) the per-example weight gradient is ``G_i = b_i^T a_i``, so

* ``||G_i||^2`` is ``||a_i||^2 ||b_i||^2`` when L = 1, and otherwise either ``<a_i a_i^T, b_i b_i^T>``
  (the ghost norm, ``L^2`` per example) or ``||b_i^T a_i||^2`` directly (``o k`` per example),
  whichever is smaller (mixed ghost clipping, Bu et al. 2022);
* ``sum_i s_i G_i = (s * b)^T a`` over all positions: one matrix product (book-keeping, no second
  backward pass).

One ordinary forward and backward of the summed loss give every ``a_i`` (forward hooks) and ``b_i``
(``autograd.grad`` w.r.t. the layer outputs; the summed loss's gradient at example i's output is
example i's, since no module mixes examples: ``check_model``). Supported: ``nn.Linear`` (any input
rank), ``nn.Conv1d``/``nn.Conv2d``/``nn.Conv3d`` (any ``groups``, depthwise included, whose per-example
gradients are always formed, group by group: ``conv_rows``; any padding mode and ``padding="same"``,
the input padded as the layer pads it), weights and biases; Hugging Face's
``transformers.pytorch_utils.Conv1D`` (GPT-2's layers: ``y = x W + b`` with ``W [in, out]``, a Linear
with its weight transposed; that class exactly, with the reviewed ``forward``, ``_reviewed_conv1d``;
transformers is not imported by clipbias); ``nn.Embedding``
(the per-example gradient's nonzero rows are example i's output gradients summed per distinct token:
norm and sum from those, ``O(L d)`` per example; ``padding_idx`` rows get no gradient; ids shared by
the whole batch, a ``[1, T]`` input such as Hugging Face's broadcast ``position_ids``, have their output
expanded to the batch, so that each example's output gradient is its own;
``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are refused); and the affine parameters of
``nn.GroupNorm``, ``nn.LayerNorm``, ``nn.InstanceNorm1d/2d/3d`` (a training forward that tracks running
statistics updates buffers: refused at the step) and ``nn.RMSNorm``, and the weight of Hugging Face's
RMSNorm classes reviewed in ``grads.rms`` (Llama, Qwen2, Qwen3, Mistral; their ``forward`` checked to
be the reviewed one): per-example gradients computed directly from the normalised input, one value
per channel or feature; likewise the weight of ``nn.PReLU`` (one per channel or a single one:
``min(0, x)`` times the output gradient, summed over the channel's positions); and the bare ``cls_token`` and
``position_embeddings`` of Hugging Face's ``ViTEmbeddings`` (its ``forward`` checked: ``grads.vit``), whose
per-example gradients are rows of the output gradient at the embeddings' dropout input. All of these form the
per-example gradients they sum, so their norms are ``sq_norms``' upper bounds on what is summed, whatever the
rounding; only the ghost norm of a
``groups=1`` Linear/Conv over several positions needs its own rounding bound (``ghost_norm_bound``).
A Conv or InstanceNorm given an input without its batch dimension is refused at the step.
A weight shared by an ``nn.Embedding`` and a Linear or Conv1D (a language model's tied input and
output embeddings: GPT-2's ``wte`` and ``lm_head``) has the sum of both uses' per-example gradients:
its squared norm is ``||E_i||^2 + ||G_i||^2 + 2 <E_i, G_i>``, the cross term gathered at example i's
tokens (``_tie_cross``: ``O(b L P d)``, no ``[V, d]`` per example) with a bound on its rounding (the
expansion cancels when the uses' gradients do), and both layers' sums go into the parameter's one
slot. Any other trainable parameter, or weight shared otherwise, makes ``why_unsupported``
say why, and the engine keeps the rows path. Dropout in the engine's step draws row r's masks from
example r's index and the run's key (``clipbias.randomness.forward``), as the rows path does.

Soundness guards (per-layer norms must be per-example norms, and each example's clipped vector
must depend on that example alone, or the sensitivity is wrong): tied parameters other than an
Embedding's weight shared with one Linear/Conv1D, parameters other than a layer's own
``weight``/``bias`` and a layer ``forward`` overridden (by a subclass or on the instance) are refused
when the engine is built; at every step, before any state changes: a user
forward hook on a supported layer, a layer that runs twice or not at all, a layer whose first
dimension is not the batch, a layer output modified in place after the layer ran, and a forward that
updates a buffer (restored) are refused; every trainable parameter must enter the autograd graph
exactly once, inside its own layer's forward (a tied weight: once inside each of its two layers and
nowhere else; exact, structural); and secret random examples'
attributed gradients must equal their own: when the forward is deterministic, ``PROBES`` examples
each run alone (a batch of one; all in one vectorised forward and one backward), and a secret random
combination of their attributed gradients, each scaled to unit norm, must equal the same combination
of their own gradients; when it draws random numbers (dropout), one example run alone (a batch of
one) under the masks it draws in the batch (keyed per example, in the engine's step; rechecked in
float64 where float32 rounding parts them), or, outside the engine's step, recomputed in a batch of
copies of itself under the same draws. A model
whose rows see other examples' data (batch statistics, mixup, cross-example attention) fails these;
a mixing confined to a few examples is caught with probability (examples probed) x (examples
affected) / b per step. Where the model's structure proves that no module mixes examples
(``grads.separable``: torch's per-example layers and activations composed by ``nn.Sequential`` or a
reviewed clipbias model class, no hooks; checked every step) the attribution is exact and the probe
is skipped. The red-team cases are in ``tests/test_fastclip.py``."""

from __future__ import annotations

import contextlib
import secrets
import sys
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..data import batch
from ..data.batch import Batch
from ..errors import ConfigError, PathRefusal
from ..randomness import forward
from . import precision
from .precision import exact32, full_float32, sq_norms, unit_roundoff
from .precision import gamma as _gamma
from . import rms, separable, vit
from .conv_rows import conv_weight_rows, input_rows
from .fast_checks import MIN_PROBE_NORM, MIXED_RTOL, PROBES, RuntimeChecks, _trainable  # noqa: F401  (the API's names)
from .fast_losses import PerExampleLosses
from .formed import FormedRows
from .rows import LossFn, ParamLayout, check_model, cross_entropy

_INSTANCE = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
_NORMS = (nn.GroupNorm, nn.LayerNorm, *_INSTANCE, *rms.TORCH_RMSNORM)
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_PER_CHANNEL = (*_NORMS, nn.PReLU)  # the layers of _Affine: one value per channel or feature
_SUPPORTED = (nn.Linear, *_CONV, nn.Embedding, *_PER_CHANNEL)


def _supported(m: nn.Module) -> bool:
    """A layer with a fast-path rule: one of ``_SUPPORTED``, a reviewed Hugging Face RMSNorm class
    (``grads.rms``), transformers' ``Conv1D`` or ``ViTEmbeddings`` (``grads.vit``; their forward checked by
    ``why_unsupported``)."""
    return isinstance(m, _SUPPORTED) or rms.hf_class(m) or _is_conv1d(m) or vit.hf_class(m)


def rule_kind(m: nn.Module) -> str | None:
    """The name of the layer class whose fast-path rule ``m`` would take, looked up along its class's
    bases (so that a class FSDP derives from a layer still counts), or None: the engine's check that
    no ``fully_shard`` unit is itself such a layer."""
    for c in type(m).__mro__:
        if c in _SUPPORTED or (c.__module__, c.__qualname__) in rms.REVIEWED | vit.REVIEWED or \
                (c.__module__, c.__name__) == (_CONV1D_MODULE, _CONV1D_NAME):
            return c.__name__
    return None


def _is_norm(m: nn.Module) -> bool:
    """A layer whose rule is ``_Affine``."""
    return isinstance(m, _PER_CHANNEL) or rms.hf_class(m)


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


def _is_conv1d(m: nn.Module) -> bool:
    """Whether ``m`` is exactly transformers' ``Conv1D`` (its class, not a subclass; transformers is not
    imported here: a model holding one has imported it)."""
    mod = sys.modules.get(_CONV1D_MODULE)
    return mod is not None and type(m) is getattr(mod, _CONV1D_NAME, None)


def _is_matrix(m: nn.Module) -> bool:
    """A layer whose weight gradient is ``g^T a`` (``_Matrix``): Linear, Conv, transformers' Conv1D."""
    return isinstance(m, (nn.Linear, *_CONV)) or _is_conv1d(m)


def _why_not_tied(uses: list[tuple[str, str, nn.Module]]) -> str | None:
    """None when a parameter's uses ``(module name, parameter name, module)`` are ones whose per-example
    gradients' cross term the fast path bounds (``_tie_cross``): one ``nn.Embedding``'s weight and one
    Linear's (or ``Conv1D``'s) weight of the same shape, e.g. GPT-2's ``wte`` and ``lm_head``."""
    names = " and ".join(f"'{n}' ({type(m).__name__})" for n, _, m in uses)
    if len({id(m) for _, _, m in uses}) < len(uses):  # one module under two names: it may run twice
        return f"one module registered under several names: {names} (tied weights: it may run more than once)"
    emb = [u for u in uses if isinstance(u[2], nn.Embedding)]
    mat = [u for u in uses if isinstance(u[2], nn.Linear) or _is_conv1d(u[2])]
    if len(uses) == 2 and len(emb) == 1 and len(mat) == 1 and all(pn == "weight" for _, pn, _ in uses):
        return None
    return (f"parameter shared by modules {names} (tied weights): the fast path bounds a tied parameter's "
            f"per-example norm only for the weight of one Embedding shared with one Linear or Conv1D "
            f"(a language model's tied input and output embeddings)")


def why_unsupported(model: nn.Module) -> str | None:
    """None when every trainable parameter belongs to a supported layer, else the reason."""
    owners: dict[int, list] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                owners.setdefault(id(p), []).append((name, pname, m))
    for uses in owners.values():
        # a tied parameter's per-example gradient is the sum of its uses': per-layer norms would understate
        # it (and with it the sensitivity) unless the uses' cross terms are added (_tie_cross)
        why = _why_not_tied(uses) if len(uses) > 1 else None
        if why is not None:
            return why
    for name, m in model.named_modules():
        if not any(p.requires_grad for p in m.parameters(recurse=False)):
            continue
        if _is_conv1d(m):
            if "forward" in m.__dict__ or not rms.same_code(type(m).forward, _reviewed_conv1d):
                return f"module '{name}' (Conv1D): its forward is not the reviewed transformers Conv1D.forward"
        elif rms.hf_class(m):
            why = rms.why_not_hf(m)
            if why is not None:
                return f"module '{name}': {why}"
        elif vit.hf_class(m):  # its own parameters, shapes and forward: grads.vit
            why = vit.why_not(m)
            if why is not None:
                return f"module '{name}': {why}"
            continue
        elif not isinstance(m, _SUPPORTED):
            return f"module '{name}' ({type(m).__name__}) has trainable parameters and no fast-path rule"
        else:
            base = next(c for c in _SUPPORTED if isinstance(m, c))
            if type(m).forward is not base.forward or "forward" in m.__dict__:  # the rules assume the standard one
                return f"module '{name}' ({type(m).__name__}) overrides {base.__name__}.forward"
        own = {n for n, p in m.named_parameters(recurse=False) if p.requires_grad}
        if not own <= {"weight", "bias"}:  # e.g. weight_norm's weight_g / weight_v
            return f"module '{name}' ({type(m).__name__}) has parameters {sorted(own)} besides weight and bias"
        if isinstance(m, _CONV) and m.padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            return f"module '{name}' ({type(m).__name__}) uses padding_mode={m.padding_mode!r}"
        if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.scale_grad_by_freq or m.sparse):
            return (f"module '{name}' (Embedding) uses max_norm (rewrites the weights in the forward pass), "
                    f"scale_grad_by_freq (scales by counts over the whole batch) or sparse gradients")
    return None


def _trainable_pair(m: nn.Module) -> tuple[bool, bool]:
    """Whether the layer's weight, its bias, is a trainable parameter (an RMSNorm has no bias)."""
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    return isinstance(w, Tensor) and w.requires_grad, isinstance(b, Tensor) and b.requires_grad


FORMED_BYTES = 256 * 2**20
"""The per-example weight gradients a micro-batch forms, at most, over all its layers (``ghost_plan``):
a layer over several positions takes the ghost norm only where forming its ``b o k`` floats would
pass this budget and ``L^2 <= o k``. Formed rows cost fewer operations than the ghost norm's float64
bound and sums (and are exact rows): on the CPU the cnn's fast step at B = 1024 took 62 ms with its
second convolution's 32 MB formed against 86 ms on the ghost norm, resnet20-gn's at B = 128 129
against 210 ms (docs/results.md). The budget keeps a language model's large layers on the ghost
norm, where forming them would hold gigabytes."""


WIDE_BLOCK_BYTES = 64 * 2**20
"""The float64 sums of a ghost layer convert this much of its output gradients at a time."""

CACHED_BLOCK_BYTES = 2 * 2**20
"""A one-position layer's float64 squared norms and sums convert this much of its inputs at a time:
a block that stays in the cache, instead of a float64 copy of the whole input written to memory and
read back (the step's largest cost on ScatterNet + linear at B = 2048)."""


def _stacked(rows: list[Tensor]) -> Tensor:
    """``torch.stack(rows)``, without copying a single row (a GPT head's sum is 154 MB)."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)


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
    gk, go = _gamma(k, u), _gamma(o, u)
    coef = gk + go + gk * go + 2 * _gamma(L * L + 1, 2.0 ** -53)
    tiny = 2.0 ** -1022 if a.dtype == torch.float64 else 2.0 ** -126  # bfloat16 has float32's range
    return sq.clamp_min(0) + 2 * (coef * U.square() + tiny * (k * sg.square() + o * sa.square()))


class _Matrix:
    """Linear/Conv: example i's weight gradient is ``g_i^T a_i`` over its L positions (rows
    ``a [b, L, k]``, ``g [b, L, o]``). L = 1: ``||a_i||^2 ||g_i||^2``. Otherwise the per-example
    gradient ``G_i`` formed, its norm taken and the sums made from it (what the rows path does), or,
    where ``G_i`` for the micro-batch would pass the budget (``ghost_plan``) and ``L^2 <= o k``, the ghost
    norm with its rounding bound (``ghost_norm_bound``: an upper bound on the true norm, so a
    clipped contribution is at most C however its positions cancel) and the sums as one float64
    product ``(s * g)^T a`` over (example, position) pairs: float64, so that an example whose
    position terms are large and cancel (bounded by the clip: ``s_i U_i <= C / sqrt(coef)``) cannot
    round other examples' terms away (in float32 one changed the released sum by 8.15 C).

    transformers' ``Conv1D`` (``y = x W + b``, ``W [k, o]``) is a Linear with its weight transposed
    (``t``): the same norms, and its weight's pieces laid out ``[k, o]`` (``a_i^T g_i``)."""

    def __init__(self, m: nn.Module, a: Tensor, g: Tensor, ghost: bool) -> None:
        b, conv = g.shape[0], isinstance(m, _CONV)
        L, k, o = _sizes(m, a, g)
        if not conv:
            a, g = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
        self.t = _is_conv1d(m)
        self.w, self.bias = m.weight.requires_grad, m.bias is not None and m.bias.requires_grad
        grouped = conv and m.groups > 1  # groups (depthwise too): the per-example gradient formed, group by group
        self.ghost = ghost and L > 1 and L * L <= o * k and not grouped
        formed = (L > 1 or grouped) and not self.ghost
        # the longest float64 sum behind sq and cross (DiSK's combination bounds its rounding with it)
        self.terms = (o * k if formed else k + o if L == 1 else L * L + k + o) + o + 1
        self.pe: Tensor | None = None
        if formed:  # the per-example weight gradient, kept for the sums
            self.pe = conv_weight_rows(m, a, g) if conv else \
                torch.bmm(a.transpose(1, 2), g) if self.t else torch.bmm(g.transpose(1, 2), a)
            if conv:
                a, g = None, g.flatten(2).transpose(1, 2)
            sq = sq_norms(self.pe)
        else:
            if conv:
                a, g = input_rows(m, a), g.flatten(2).transpose(1, 2)
            if L == 1:  # in float64: in float32 ||a||^2 underflows for |a_j| <= 2^-75 while g a^T does not
                sq = _wide_sq(a) * g.double().square().sum((1, 2))
            else:  # the ghost norm: an upper bound on the true norm, whatever the rounding
                sq = ghost_norm_bound(a, g)
        self.a, self.g = a, g
        self.tied = False  # a weight shared with an Embedding: its sums in float64 (_rules_of, _tie_cross)
        self.sq = (sq * self.w) + (sq_norms(g.sum(1)) if self.bias else 0)

    def sums(self, S: Tensor) -> list[Tensor]:
        """``[n, numel]`` per parameter: ``sum_i S[j, i] grad_i`` for every row j of ``S [n, b]``."""
        out, dt = [], self.g.dtype
        if self.w:
            if self.pe is not None and self.tied:  # float64: see _tie_cross's last paragraph
                out.append(S.double() @ self.pe.flatten(1).double())
            elif self.pe is not None:
                out.append(S.to(dt) @ self.pe.flatten(1))
            elif self.ghost:  # float64: see the class docstring
                out.append(_stacked([self._wide_sum(s) for s in S]))
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

    def cross(self, o: "_Matrix") -> Tensor:
        """``<G_i, G'_i>`` per example, ``o`` the same layer's rule on the same examples at other weights
        (same shapes, so the same choice of ghost norm or per-example gradient as ``sq``)."""
        if self.pe is not None:
            w = (self.pe * o.pe).sum((1, 2))
        elif self.a.shape[1] == 1:
            w = (self.a * o.a).sum((1, 2)) * (self.g * o.g).sum((1, 2))
        else:  # sum over position pairs of (a_l . a'_m)(g_l . g'_m): DiSK's rules are float64 throughout
            w = (torch.bmm(self.a, o.a.transpose(1, 2)) * torch.bmm(self.g, o.g.transpose(1, 2))).sum((1, 2))
        return w * self.w + ((self.g.sum(1) * o.g.sum(1)).sum(1) if self.bias else 0)


class _Affine(FormedRows):
    """GroupNorm/LayerNorm/InstanceNorm/RMSNorm/PReLU: the per-example gradients of the affine weight and
    bias are small (one value per channel or normalised feature): computed directly from the
    normalised input (an InstanceNorm's from the statistics its forward uses: the example's own in
    training or without running statistics, the constant running ones in evaluation; a Hugging Face
    RMSNorm's normalised in float32 and cast back, as its forward does: ``grads.rms``). A PReLU's
    ``y = max(0, x) + w min(0, x)`` has ``dy/dw = min(0, x)``: its "normalised input", summed over
    each channel's positions (channels on dimension 1; one weight: over everything)."""

    def __init__(self, m: nn.Module, a: Tensor, g: Tensor) -> None:
        b = a.shape[0]
        if isinstance(m, nn.GroupNorm):
            xhat, dims = F.group_norm(a, m.num_groups, eps=m.eps), tuple(range(2, a.dim()))
        elif isinstance(m, _INSTANCE):
            own = m.training or not m.track_running_stats  # the forward's use_input_stats
            xhat = F.instance_norm(a, None if own else m.running_mean, None if own else m.running_var,
                                   use_input_stats=own, eps=m.eps)
            dims = tuple(range(2, a.dim()))
        elif isinstance(m, nn.LayerNorm):
            xhat = F.layer_norm(a, m.normalized_shape, eps=m.eps)
            dims = tuple(range(1, a.dim() - len(m.normalized_shape)))  # leading positions
        elif isinstance(m, nn.PReLU):  # F.prelu refuses C > 1 weights unless dimension 1 has C channels
            xhat, dims = a.clamp(max=0), tuple(range(1 if m.weight.numel() == 1 else 2, a.dim()))
        else:
            n = rms.trailing(m)
            if tuple(m.weight.shape) != tuple(a.shape[a.dim() - n:]) or a.dim() <= n:
                raise ConfigError(f"grad_path=\"fast\": a {type(m).__name__} layer's weight {tuple(m.weight.shape)} "
                                  f"does not match the trailing dimensions of its input {tuple(a.shape)}; use "
                                  f"grad_path=\"rows\"")
            xhat, dims = rms.normalised(m, a), tuple(range(1, a.dim() - n))
        parts = []
        weight, bias = _trainable_pair(m)
        if weight:
            parts.append(((xhat * g).sum(dims) if dims else xhat * g).reshape(b, -1))
        if bias:
            parts.append((g.sum(dims) if dims else g).reshape(b, -1))
        self.form(parts)


class _Embed:
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
        self.tied = False  # a weight shared with a Linear/Conv1D: its sums in float64 (_rules_of, _tie_cross)

    def cross(self, o: "_Embed") -> Tensor:
        """Per example, over its tokens (the same inputs at other weights: the same (example, token) rows)."""
        return self.sq.new_zeros(self.sq.shape).index_add_(0, self.owner, (self.rows * o.rows).sum(1).double())

    def _place(self, token: Tensor, rows: Tensor) -> Tensor:
        return rows.new_zeros(self.shape).index_add_(0, token, rows).reshape(-1)

    def sums(self, S: Tensor) -> list[Tensor]:
        rows = self.rows.double() if self.tied else self.rows  # tied: float64, rounded once with the head's
        S = S.to(rows.dtype)
        return [_stacked([self._place(self.token, rows * s[self.owner].unsqueeze(1)) for s in S])]

    def one(self, i: int) -> list[Tensor]:
        mine = self.owner == i
        return [self._place(self.token[mine], self.rows[mine])]

    def combo(self, idx: list[int], w: list[float]) -> list[Tensor]:
        weight = self.rows.new_zeros(len(self.owner))  # each (example, token) row weighted by its example's w
        for i, wk in zip(idx, w):
            weight[self.owner == i] = wk
        mine = weight != 0
        return [self._place(self.token[mine], self.rows[mine] * weight[mine].unsqueeze(1))]


def _wide_sq(a: Tensor) -> Tensor:
    """``[b]`` squared norms of ``a [b, 1, k]``'s rows in float64, a cached block of examples at a time."""
    b, k = a.shape[0], a.shape[-1]
    a = a.reshape(b, k)
    step = max(1, CACHED_BLOCK_BYTES // (8 * k))
    return torch.cat([a[i:i + step].double().square().sum(1) for i in range(0, b, step)])


def _sizes(m: nn.Module, a: Tensor, g: Tensor) -> tuple[int, int, int]:
    """A Linear/Conv layer's (positions L, input features k, outputs o) per example, from its input
    ``a`` and its output (or output gradient) ``g``; a convolution's without unfolding."""
    if isinstance(m, _CONV):
        return g[0, 0].numel(), m.weight[0].numel(), g.shape[1]
    return a[0].numel() // a.shape[-1], a.shape[-1], g.shape[-1]


def ghost_plan(layers: list[nn.Module], acts: dict, outs: dict | list) -> set[nn.Module]:
    """The Linear/Conv layers whose rules take the ghost norm in this micro-batch (the others over
    several positions form their per-example gradients): in layer order, a layer with ``L^2 <= o k``
    whose ``b o k`` formed floats would take the layers formed so far past ``FORMED_BYTES``. From
    the shapes alone (``acts``: every layer's input, ``outs``: its output or output gradient, by
    layer or in ``layers``' order)."""
    if not isinstance(outs, dict):
        outs = dict(zip(layers, outs))
    ghost, used = set(), 0
    for m in layers:
        if not _is_matrix(m):
            continue
        a, out = acts[m], outs[m]
        L, k, o = _sizes(m, a, out)
        grouped = isinstance(m, _CONV) and m.groups > 1  # formed always (_Matrix)
        if L == 1 and not grouped:
            continue
        size = out.shape[0] * o * k * max(a.element_size(), 4)  # 16-bit inputs are formed in float32 (_rule)
        if L * L <= o * k and not grouped and used + size > FORMED_BYTES:
            ghost.add(m)
        else:
            used += size
    return ghost


def _own_reference(m: nn.Module, ghost: set) -> bool:
    """Whether a layer's rule gives the reference sum as a nearly free second row of its sums: a norm
    layer, a Linear/Conv that forms its per-example gradients (``_Matrix.pe``), or a one-position
    layer, whose float64 sums convert each cached block of inputs once for both rows (cheaper than
    autograd's float32 weight gradient, which reads the whole input again); ``ghost``: ``ghost_plan``'s."""
    if _is_norm(m) or vit.hf_class(m):
        return True
    if not _is_matrix(m):
        return False
    return m not in ghost


def _rules_of(layers: list[nn.Module], acts: dict, outs: list, plan: set | None = None,
              ties: list[tuple[int, int]] = ()) -> list:
    """Every layer's rule (inputs ``acts``, output gradients ``outs`` in ``layers``' order), each
    Linear/Conv over several positions on formed gradients or the ghost norm as ``ghost_plan`` says
    (``plan``: its answer for these shapes, where the caller has it). ``ties``: pairs (Embedding,
    Linear/Conv1D) of indices into ``layers`` sharing their weight: twice the cross term of their
    per-example gradients and its rounding margin (``_tie_cross``) are added to the Embedding rule's
    ``sq``, so that the rules' summed ``sq`` bounds the squared norm of the tied parameter's summed
    per-example gradient."""
    plan = ghost_plan(layers, acts, outs) if plan is None else plan
    rules = [_rule(m, acts[m], g, m in plan) for m, g in zip(layers, outs)]
    for e, j in ties:
        rules[e].sq = rules[e].sq + _tie_cross(rules[e], rules[j])
        rules[e].tied = rules[j].tied = True  # their weight's sums in float64, added, then rounded once
    return rules


def _tie_cross(emb: "_Embed", mat: "_Matrix") -> Tensor:
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
    float64 (``tied``), added, and rounded once to the weight's precision (``BookKeeping._ordered``)."""
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


def _rule(m: nn.Module, a: Tensor, g: Tensor, ghost: bool):
    # bfloat16 / float16 inputs and output gradients (autocast: DPEngine(autocast=...), or inside the model) widen
    # exactly to float32: every norm, factor and sum below then runs in float32 or float64, as for a float32
    # model (16-bit sums moved the release by 1.27 C at B = 256; float16 squares underflow at 2^-12)
    a, g = exact32(a), exact32(g)
    if vit.hf_class(m):
        return vit.Tokens(m, g)
    if _is_matrix(m):
        return _Matrix(m, a, g, ghost)
    return (_Affine if _is_norm(m) else _Embed)(m, a, g)


class _Combined:
    """One layer's ``c G'_i + (1 - c) G_i`` from its rules at two points on the same examples (DiSK,
    ``clipbias.algorithms.disk``): the squared norm through the cross term, the sums linear in both.

    The expansion ``c^2 ||F||^2 + (1 - c)^2 ||N||^2 + 2 c (1 - c) <F, N>`` cancels when the two
    gradients nearly cancel, and then its rounding can exceed the true norm: an example whose
    combination cancels in one coordinate and leaves 1e-8 of it in another got a computed norm of 0
    and a contribution of 9424 C at DiSK's defaults. Every term is a float64 sum of at most n
    products (``terms``: the longest of either rule), within ``gamma_n`` of the sum of their
    magnitudes, i.e. of ``||F||^2``, ``||N||^2`` and ``||F|| ||N||`` (Cauchy-Schwarz), and the
    combination adds a few roundings more; so the true squared norm is at most the computed one plus
    ``(gamma_n + gamma_8) (|c| ||F|| + |1 - c| ||N||)^2``, with the norms from ``far.sq``, ``near.sq``
    (sums of squares, or a ghost norm's upper bound) and the margin doubled for second-order terms.
    (A ghost rule's own bound already covers its cross term: ``2 coef (c^2 U^2 + (1 - c)^2 U'^2) >=
    4 |c (1 - c)| coef U U'``.)"""

    def __init__(self, far, near, c: float) -> None:
        self.far, self.near, self.c = far, near, c
        sq = c * c * far.sq + (1 - c) ** 2 * near.sq + 2 * c * (1 - c) * far.cross(near)
        n, u = max(far.terms, near.terms), unit_roundoff(far.sq)
        spread = (abs(c) * far.sq.clamp_min(0).sqrt() + abs(1 - c) * near.sq.clamp_min(0).sqrt()).square()
        self.sq = sq.clamp_min(0) + 2 * (_gamma(n, u) + _gamma(8, u)) * spread
        self.terms = n

    def sums(self, S: Tensor) -> list[Tensor]:
        return [self.c * f + (1 - self.c) * n for f, n in zip(self.far.sums(S), self.near.sums(S))]

    def one(self, i: int) -> list[Tensor]:
        return [self.c * f + (1 - self.c) * n for f, n in zip(self.far.one(i), self.near.one(i))]

    def combo(self, idx: list[int], w: list[float]) -> list[Tensor]:
        return [self.c * f + (1 - self.c) * n for f, n in zip(self.far.combo(idx, w), self.near.combo(idx, w))]


class BookKeeping(RuntimeChecks, PerExampleLosses):
    """``(clipped sum, reference sum, losses, norms)`` of a batch for a norm-scaling stage. Its run-time checks
    (``grads.fast_checks``) and per-example losses (``grads.fast_losses``) are inherited."""

    def __init__(self, model: nn.Module, loss_fn: LossFn = cross_entropy) -> None:
        check_model(model)
        reason = why_unsupported(model)
        if reason is not None:
            raise ConfigError(reason)
        self.model, self.loss_fn, self.layout = model, loss_fn, ParamLayout.of(model)
        self.layers = [m for m in model.modules() if _supported(m) and _trainable(m)]
        names = {id(p): n for n, p in model.named_parameters()}
        slot = {n: i for i, n in enumerate(self.layout.names)}
        self.slots = [[slot[names[id(p)]] for p in _trainable(m)] for m in self.layers]
        users: dict[int, list[int]] = {}  # the layers using each parameter (several: a tied weight)
        for j, m in enumerate(self.layers):
            for p in _trainable(m):
                users.setdefault(id(p), []).append(j)
        # (Embedding, Linear/Conv1D) sharing their weight, as why_unsupported allows: their cross term (_tie_cross)
        self.ties = [tuple(sorted(js, key=lambda j: not isinstance(self.layers[j], nn.Embedding)))
                     for js in users.values() if len(js) > 1]
        self._check_rng = secrets.SystemRandom()  # the probes: unpredictable, from the OS CSPRNG
        self._vector_loss: bool | None = None  # does loss_fn return per-example losses? (decided once)
        self.keep_output, self.last_out = False, None  # the step's own forward output (clipbias.PrivacyEngine)
        self._keyed_calls = 0  # keyed dropout calls of the last forward (_backward)

    def __call__(self, x: Batch, y: Batch, scale: Callable[[Tensor], Tensor],
                 reference: bool, at: tuple[Callable, float] | None = None) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """``at = (enter, c)``: the rows are ``c g(point) + (1 - c) g(x_t)`` (DiSK), ``enter()`` a context in
        which the model's weights are at the point: every layer's rules at both points, each point's
        checked as always, combined exactly (``_Combined``, its terms in float64: the expansion of the
        combination's norm cancels, and float32 terms would understate it)."""
        dtype, ref, cheap = None, None, None
        if at is None:  # the reference sum: from the formed rows where a layer has them, else autograd's (below)
            losses, rules, ref = self._rules(x, y, reference=reference)
            # where _rules left a parameter's reference to the rows (None): that layer's sums take a ones row
            cheap = [all(ref[k] is None for k in slots) for slots in self.slots] if reference else None
            reference = False
        else:
            enter, c = at
            wide = c != 1.0
            if wide and self.ties:
                raise ConfigError("grad_path=\"fast\" with DiSK's two points: tied weights (an Embedding sharing its "
                                  "weight with a Linear) have no bound on the cross terms between the points; use "
                                  "grad_path=\"rows\"")
            with enter():
                losses, rules, _ = self._rules(x, y, wide)
            if wide:
                losses, near, _ = self._rules(x, y, wide)
                rules = [_Combined(f, n, c) for f, n in zip(rules, near)]
                dtype = self.layout.params(self.model)[0].dtype
        norms = torch.sqrt(sum(r.sq for r in rules))
        if not bool(torch.isfinite(norms).all()):  # the caller refuses the step, naming the examples
            return torch.zeros(0), None, losses, norms
        two = [reference or bool(cheap and cheap[j]) for j in range(len(rules))]
        S = torch.stack([scale(norms)] + ([torch.ones_like(norms)] if any(two) else []))
        with full_float32():  # TF32 would round the rows to 2^-11 before the clip factors meet them
            pieces = [r.sums(S if t else S[:1]) for r, t in zip(rules, two)]
        proc = self._assemble([[t[0] for t in lp] for lp in pieces])
        if reference:
            ref = self._assemble([[t[1] for t in lp] for lp in pieces])
        elif cheap is not None:  # the formed rows' ones-row where cheap, autograd's gradient elsewhere
            parts = self._ordered([[t[1] for t in lp] if c else [None] * len(lp) for lp, c in zip(pieces, cheap)])
            ref = torch.cat([a if a is not None else b.reshape(-1) for a, b in zip(parts, ref)])
        if dtype is not None:  # the wide rules' sums back to the parameters' precision
            proc, ref = proc.to(dtype), None if ref is None else ref.to(dtype)
        return proc, ref, losses, norms.to(proc.dtype)  # float64 where a ghost norm's bound took part

    def _rules(self, x: Batch, y: Batch, wide: bool = False,
               reference: bool = False) -> tuple[Tensor, list, list | None]:
        """(losses, every layer's rule, reference sums or None) at the model's current weights, the
        examples' attribution checked; ``wide``: the rules computed in float64 from the layers' inputs
        and output gradients. ``reference``: the unclipped sum ``sum_i g_i``, for ghost layers and
        embeddings, from the same backward, as autograd's gradient of the summed loss (one float32
        weight-gradient product per such layer instead of a second book-keeping sum, which on a ghost
        layer runs in float64); the other layers' come from their rules in ``__call__`` (a second row
        of the sums, nearly free: ``_own_reference``), so no weight-gradient product is spent on them. Returned as one
        tensor per parameter in layout order, None where the rows give it. It feeds only error
        feedback's hidden buffer, which the sound DiceSGD bound allows to be anything
        (docs/privacy.md), so its rounding does not enter the guarantee."""
        check_model(self.model)
        _check_running_stats(self.model)
        params = self.layout.params(self.model)
        dev = params[0].device
        keyed = forward.active() is not None  # the engine's step: dropout keyed per example, public draws refused
        rng = forward.snapshot(dev) if keyed else _rng_state(dev)
        buffers = [(b, b._version, b.detach().clone()) for b in self.model.buffers()]
        self._loss_alone = True  # _losses_alone: the summed loss_fn's gradient taken one example at a time
        with full_float32():  # the batch and the probes in the same (full) float32 arithmetic
            try:
                with separable.watch(self.model, known=self.layers) as inputs:  # frozen layers' inputs too
                    losses, acts, grads = self._backward(x, y, params=self._unformed_params if reference else None,
                                                         keep=self.keep_output)
                for m in self.layers:  # the trainable layers' inputs, as the hooks of the backward took them
                    inputs.setdefault(m, []).append(acts[m].dim())
            finally:  # a buffer changed by the forward is restored and refused, whatever else failed
                _check_buffers(self.model, buffers)
            if keyed:
                forward.check_generators(rng, dev)
                stochastic = self._keyed_calls > 0
            else:
                stochastic = not _same_rng(rng, _rng_state(dev))  # dropout (or any other draw) in the forward
            # with the reference, the plan _unformed_params made from the same shapes: the rules and the
            # split of the reference between rules and autograd rest on one decision
            rules = _rules_of(self.layers, {m: _widen(acts[m], wide) for m in self.layers},
                              [_widen(g, wide) for g in grads[:len(self.layers)]],
                              self._plan if reference and not wide else None, self.ties)
            sq = sum(r.sq for r in rules)
            # else the caller refuses the step; a model per-example by construction, under a loss of one
            # example at a time (a loss_fn returning per-example losses may combine them), needs no probe
            own_loss = self.loss_fn is cross_entropy or getattr(self.loss_fn, "per_example", False) \
                or self._vector_loss is False and self._loss_alone
            proven = own_loss and not stochastic and separable.proven(self.model, inputs, batch.leaves(y))
            if bool(torch.isfinite(sq).all()) and not proven:
                self._check_examples(rules, sq, x, y, params, rng if stochastic else None)
        ref = None
        if reference:  # layout order; None for the parameters of layers whose rules give it
            got = dict(zip(map(id, self._unformed), grads[len(self.layers):]))
            ref = [got.get(id(p)) for p in params]
        return losses, rules, ref

    def _unformed_params(self, acts: dict, outs: dict) -> list[Tensor]:
        """After the forward: the trainable parameters of the layers whose rules do not give the
        reference sum themselves (``_own_reference``), which the reference sum takes from autograd; kept
        in ``self._unformed`` (and the ghost plan in ``self._plan``) for ``_rules``."""
        self._plan = plan = ghost_plan(self.layers, acts, outs)
        unformed = [not _own_reference(m, plan) for m in self.layers]
        for e, j in self.ties:  # autograd's reference of a tied weight is both layers': theirs all from it
            unformed[e] = unformed[j] = unformed[e] or unformed[j]
        seen: set[int] = set()
        self._unformed = [p for m, u in zip(self.layers, unformed) if u for p in _trainable(m)
                          if id(p) not in seen and not seen.add(id(p))]
        return self._unformed


    def _backward(self, x: Batch, y: Batch, call: Callable | None = None, check_graph: bool = True,
                  params: list | Callable[[dict, dict], list] | None = None, keep: bool = False) -> tuple:
        """One forward and one backward of the summed loss, to the layer outputs only (no parameter
        gradients unless ``params`` are given: then their gradients follow the layers' in the list):
        the per-example losses (detached), every layer's input and output gradient. Refuses, before
        anything changes, a model the rules would misread. ``call`` runs the model (default: the
        model itself; the float64 recheck passes it widened weights)."""
        acts: dict[nn.Module, Tensor] = {}
        outs: dict[nn.Module, Tensor] = {}
        ins: dict[nn.Module, object] = {}
        versions: dict[nn.Module, int] = {}
        _check_hooks(self.layers)

        def hook(m: nn.Module, inp: tuple, out: Tensor) -> None:
            if m in acts:  # a layer used twice: its per-example gradient sums both uses
                raise PathRefusal("fast", f"`grad_path='fast'`: a {type(m).__name__} layer runs twice in one forward "
                                  f"pass (shared weights); per-layer norms would understate the per-example "
                                  f"gradient. Use `grad_path='rows'`")
            a = inp[0]
            if isinstance(m, nn.Embedding) and b > 1 and a.dim() > 1 and a.shape[0] == 1:
                # the same ids for every example (Hugging Face's broadcast position_ids, token_type_ids): the
                # output expanded to the batch, so that each example's output gradient is its own; broadcasting
                # it later gives the same values (the probe compares the attribution with each example alone)
                a, out = a.expand(b, *a.shape[1:]), out.expand(b, *out.shape[1:])
            acts[m], outs[m], ins[m], versions[m] = a.detach(), out, inp[0].grad_fn, out._version
            return out

        b = batch.size(x)
        handles: list = []
        try:
            for m in self.layers:  # a ViTEmbeddings' output gradient is taken at its dropout's input (grads.vit)
                handles += vit.hooks(m, hook) if vit.hf_class(m) else [m.register_forward_hook(hook)]
            with torch.enable_grad():
                # keyed dropout: row r's masks from example r's index; the step's autocast (DPEngine(autocast=...))
                # around the model's own forward (not the float64 recheck's: ``call``)
                mixed = precision.forward_autocast() if call is None else contextlib.nullcontext()
                with forward.one_pass() as seen, mixed:
                    losses = self._losses(self._kept(batch.call(call or self.model, x), keep), y, b)
                self._keyed_calls = seen.calls
                self._check_layers(acts, outs, b)
                changed = [m for m in self.layers if outs[m]._version != versions[m]]
                if changed:  # the backward would differentiate through the later in-place op
                    raise PathRefusal("fast", f"`grad_path='fast'`: the output of a {type(changed[0]).__name__} layer "
                                      f"is modified in place after the layer ran (ReLU(inplace=True) or h *= c, say); "
                                      f"use the out-of-place operation, or `grad_path='rows'`")
                if check_graph:  # off only for the float64 recheck, whose leaves are copies
                    self._check_graph(losses, outs, ins)
                # the outputs' graph edges, not the outputs: a language model's logits (the head's output,
                # 1.65 GB for a 64M GPT at B = 128) are then freed once the loss has read them, as in a
                # non-private step, instead of being held through the backward
                if callable(params):  # which parameters, decided from the layers' shapes (the reference sum)
                    params = params(acts, outs)
                targets = [_edge(outs.pop(m)) for m in self.layers]
                scale = precision.loss_scale() if call is None else 1.0  # float16: against underflow
                grads = torch.autograd.grad(losses.sum() * scale if scale != 1.0 else losses.sum(),
                                            targets + (params or []))
        finally:
            for h in handles:
                h.remove()
        if scale != 1.0:  # a power of two: divided out exactly (widened to float32 first)
            grads = [exact32(g, scale) for g in grads]
        return exact32(losses.detach()), acts, list(grads)

    def _kept(self, out, keep: bool):
        """``out``, and its detached copy in ``last_out`` when ``keep`` (the step's output, handed to the user's
        loop instead of a second forward; kept only then, so a language model's logits are otherwise freed
        once the loss has read them)."""
        if keep:
            self.last_out = batch.detached(out)
        return out


    def _rules_at(self, acts: dict, grads: list) -> list:
        """Every layer's rule from its inputs ``acts`` and output gradients ``grads`` (``_rules_of``)."""
        return _rules_of(self.layers, acts, grads, ties=self.ties)

    def _assemble(self, per_layer: list[list[Tensor]]) -> Tensor:
        """Per-layer, per-parameter flat pieces concatenated in ``ParamLayout`` order."""
        return torch.cat(self._ordered(per_layer))

    def _ordered(self, per_layer: list[list[Tensor]]) -> list[Tensor]:
        parts: list[Tensor | None] = [None] * len(self.layout.names)
        for slots, pieces in zip(self.slots, per_layer):
            for s, t in zip(slots, pieces):  # a tied parameter: the sum of its layers' pieces
                parts[s] = t if parts[s] is None else parts[s] if t is None else parts[s] + t
        for e, _ in self.ties:  # the tied weight's float64 sums, added above, rounded once to its precision
            s = self.slots[e][0]
            if parts[s] is not None:
                parts[s] = parts[s].to(self.layers[e].weight.dtype)
        return parts


def _edge(t: Tensor):
    """What ``torch.autograd.grad`` needs to return the gradient with respect to ``t`` without
    keeping ``t`` alive: its gradient edge (torch >= 2.2), else ``t`` itself."""
    get = getattr(torch.autograd.graph, "get_gradient_edge", None)
    return get(t) if get is not None else t


def _widen(t: Tensor, wide: bool) -> Tensor:
    """``t`` in float64 where ``wide`` and it holds floating-point values (an embedding's indices stay)."""
    return t.double() if wide and t.is_floating_point() else t


def _rng_state(device: torch.device) -> tuple:
    return (torch.get_rng_state(),) + ((torch.cuda.get_rng_state(device),) if device.type == "cuda" else ())


def _same_rng(a: tuple, b: tuple) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


def _check_hooks(layers: list) -> None:
    """Forward hooks of the user on a supported layer (or global ones) can change its output after
    the layer ran, which the rules would take for the layer's: refused. Pre-hooks are fine (the
    layer sees what they return)."""
    hooked = [m for m in layers if m._forward_hooks] or (layers if nn.modules.module._global_forward_hooks else [])
    if hooked:
        raise PathRefusal("fast", f"`grad_path='fast'`: a forward hook is registered on a {type(hooked[0]).__name__} "
                          f"layer (or globally): it may change the layer's output after the layer ran. Remove it, or "
                          f"use `grad_path='rows'`")


def _check_running_stats(model: nn.Module) -> None:
    """An InstanceNorm tracking running statistics updates them from the batch in a training forward:
    refused before the forward, by name (``_check_buffers`` would refuse any buffer the forward changes)."""
    for name, m in model.named_modules():
        if isinstance(m, _INSTANCE) and m.training and m.track_running_stats:
            raise ConfigError(f"grad_path=\"fast\": module '{name}' ({type(m).__name__}) has track_running_stats=True "
                              f"in training mode: its forward would update running statistics from the private batch, "
                              f"released without noise. Build it with track_running_stats=False (clipbias.fix(model) "
                              f"does), or put the layer in evaluation mode (.eval()) to use its running statistics as "
                              f"constants")


def _check_buffers(model: nn.Module, before: list) -> None:
    """A forward that updates a buffer (a running statistic) computes a statistic of the private
    batch that would be released without noise: restored and refused."""
    changed = [b for b, v, _ in before if b._version != v]
    if changed:
        with torch.no_grad():
            for b, _, copy in before:
                b.copy_(copy)
        names = [n for n, b in model.named_buffers() if any(b is c for c in changed)]
        raise ConfigError(f"`grad_path='fast'`: the forward pass updates buffer(s) {names} from the batch: a statistic "
                          f"of the private data would be released without noise (the DP guarantee does not cover "
                          f"it). Make it a constant, or remove it")


