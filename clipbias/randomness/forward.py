"""Keyed forward randomness: the dropout masks of the private forward pass, per example, from the run's key.

While ``DPEngine`` computes a step's gradients it holds ``keyed(key, step)``, and each forward pass
of the model in it runs under a ``torch.overrides.TorchFunctionMode`` (``one_pass``) that draws every dropout mask (``torch.nn.functional.dropout``,
``dropout1d/2d/3d``, ``alpha_dropout``, ``feature_alpha_dropout``, ``torch.dropout``,
``torch.feature_dropout``, ``torch.native_dropout`` and the in-place forms: what ``nn.Dropout`` and
its kind, and Hugging Face's eager attention, call; and the attention-weight mask of
``F.scaled_dot_product_attention`` with ``dropout_p > 0``, which is then computed in its math form:
Hugging Face's default SDPA attention; and the dropout inside ``F.multi_head_attention_forward``, the composite of
``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``, whose body runs under the mode: ``_composite``)
from the ChaCha20 keystream: call c of a forward pass (its c-th
keyed dropout call, from 0) draws example i's mask from its own stream, at the address
``(Purpose.FORWARD_CALL, step + 2^32 c, i)`` (``key.forward_call_step``), from block 0. An element is kept
when its 32-bit word is below ``floor((1 - p) 2^32)`` (a keep rate within 2^-32 below 1 - p), and
which word an element reads depends on its coordinates only (``layout``), not on the padded sizes:

* a per-example shape ``(d1, d2)`` (hidden states ``[L, d]``; one or no dimension likewise): row-major,
  word ``c1 d2 + c2``, which does not depend on ``d1``;
* ``(*lead, a, b)``, 3 dimensions or more (attention weights ``[H, Lq, Lk]``, both padded): word
  ``S(c_a, c_b) P + linear(lead)``, with ``P`` the product of ``lead`` and ``S`` Szudzik's pairing
  (``S(a, b) = b^2 + a`` if ``a < b``, else ``a^2 + a + b``; the pairs with ``max(a, b) < n`` fill
  ``[0, n^2)``), which depends on neither ``a`` nor ``b``: the call reads ``P max(a, b)^2`` words at most.

The dimensions this assumes fixed (``fixed``: ``d2``; ``lead``) and the number of keyed calls per forward
are recorded at the run's first forward (the engine's record, ``keyed(..., layouts)``) and a forward that
differs is refused (``ConfigError``: e.g. dropout on a channel-first ``[d, L]`` sequence padded per
batch). So example i's mask at an element is a function of the key, the step, i, the call number and the
element's coordinates only: the same whatever its position in the batch, whichever other examples are
present and whatever length the batch is padded to, on the rows path and the fast path, on every rank
and device, and again on resume (nothing to save). Right padding (a collate that pads to the batch's
longest example, as Hugging Face's do) then leaves an example's masks on its real positions unchanged
(benchmarks/redteam/session/dropout_padding.py: 1.11 C before, 0 now). Left padding shifts an example's
coordinates by the padded length: its masks then move with the longest example in the batch, which the
guard cannot see; with dropout on, pad on the right (or to a fixed length).

Any other random operation the forward calls (``torch.rand``, ``randn``, ``randint``, ``bernoulli``,
``multinomial``, ``normal``, ``Tensor.uniform_``, ``rrelu`` in training, ``gumbel_softmax``, ...) is
refused (``ConfigError``), and a forward that moved torch's, Python's or numpy's global generator
anyway (a draw inside a function that does not pass through the mode) is refused after the fact
(``check_generators``): those generators are public functions of ``--seed`` and assign their draws by
position.

Which rows belong to which example: ``examples(ids)`` around the forwards of a micro-batch (the code
that slices it knows the indices; ``None``: a step without indices, whose random forward is refused).
Within it each forward pass is ``one_pass(position)``: the rows path (``FuncGradients``, one example
per ``vmap`` call) passes the example's position in ``ids`` as a batched 0-d tensor, and a dropout
input is that example's whole (its per-example shape without the leading 1 of the batch of one the rows
path makes, as on the fast path); the batched forward (fast path) passes none, and row r of a dropout
input is example ``ids[r]`` (an input whose first dimension is not the micro-batch is refused).
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import threading
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import ConfigError, PathRefusal
from .chacha import BLOCK_BYTES, MAX_BLOCKS
from .draws import int_list, stream
from .key import Purpose, SecretKey, forward_call_step

_from_numpy = torch.from_numpy  # bound at import: a model that replaces torch.from_numpy does not make the masks
_WORD_BYTES = 4
_SELU_ALPHA = 1.7580993408473766  # torch's alpha_dropout constant
_local = threading.local()


class KeyedForward(TorchFunctionMode):
    """The mode of ``keyed``: dropout from the keystream, every other random operation refused."""

    def __init__(self, key: SecretKey, step: int, layouts: dict | None = None, refusal: str | None = None,
                 listen: tuple | None = None) -> None:
        super().__init__()
        self.key, self.step = key, int(step)
        self.refusal = refusal  # why this step may draw no mask (a left-padded batch), or None
        self.listen = listen  # (functions, callback(func, args)): the state guard's watch of the forward's calls
        self.layouts = {} if layouts is None else layouts  # the run's record for the layout guard
        self.ids: list[int] | None = None
        self.position: Tensor | None = None
        self.calls = 0   # keyed dropout calls of the current forward pass
        self.made: dict[int, tuple] = {}  # the masks made in the current pass: id -> (mask, call, p) (``mask_of``)
        self.inside = False  # within a forward pass (the mode is pushed)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.listen is not None and func in self.listen[0]:
            self.listen[1](func, args)
        rule = _RULES.get(func)
        if rule is not None:
            return rule(self, *args, **kwargs)
        name = _RANDOM.get(func) or _seeded(func, args, kwargs)
        if name is not None and _draws(func, args, kwargs):
            raise ConfigError(f"the model's forward pass calls {name}, a random draw from torch's generator, whose "
                              f"state is a public function of the seed and whose draws go by batch position: the "
                              f"DP guarantee would not hold. In the private forward pass only dropout "
                              f"({_DROPOUT_NAMES}) is drawn, from the run's secret key per example; remove the "
                              f"draw (or the module's randomness: module.eval()), or draw it before the model")
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ masks
    def _rows(self) -> list[int]:
        if self.refusal is not None:  # every keyed mask passes here: the signal that the forward draws one
            raise ConfigError(self.refusal)
        if self.ids is None:
            raise ConfigError("the model's forward pass draws dropout masks, and this step has no example indices: "
                              "the masks are keyed by each example's index, not its batch position. Pass the "
                              "indices: engine.step(x, y, indices) with indices = engine.sampler.sample() (or "
                              "switch the model's dropout off: model.eval() or p = 0)")
        return self.ids

    def _keep(self, per_example: tuple[int, ...], p: float, device: torch.device) -> Tensor:
        """``[len(ids), *per_example]`` bool, True where kept: row r from example ``ids[r]``'s keystream of
        this call (``(Purpose.FORWARD_CALL, (step, call), ids[r])``), laid out by ``layout``."""
        ids = self._rows()
        call, self.calls = self.calls, self.calls + 1
        self._check_layout(call, per_example)
        words, pairs = layout(per_example)
        nbytes = _WORD_BYTES * words
        if -(-nbytes // BLOCK_BYTES) > MAX_BLOCKS:
            raise ConfigError(f"dropout call {call} of the forward pass (per-example shape {list(per_example)}) needs "
                              f"more than {MAX_BLOCKS * BLOCK_BYTES >> 30} GiB of keystream per example")
        field = forward_call_step(self.step, call)
        threshold = np.uint32(min(int((1.0 - p) * 2.0 ** 32), 2 ** 32 - 1))
        m = math.prod(per_example)
        keep = np.empty((len(ids), m), dtype=bool)
        first: dict[int, int] = {}  # an example present twice (a counterfactual batch) is drawn once
        for r, i in enumerate(ids):
            if i in first:
                keep[r] = keep[first[i]]
                continue
            first[i] = r
            _gather(stream(self.key, Purpose.FORWARD_CALL, field, i, nbytes).view("<u4") < threshold, per_example,
                    pairs, keep[r])
        with _disable_current_modes():  # (made outside any dispatch mode: a recording sees it first where it is read)
            made = _from_numpy(keep)
        self.made[id(made)] = (made, call, float(p))  # (the graph proof's: ``mask_of``)
        return made.view(len(ids), *per_example).to(device)

    def _check_layout(self, call: int, per_example: tuple[int, ...]) -> None:
        """Refuse a dropout call whose fixed dimensions (``fixed``) differ from those of the same call at
        the run's first forward that made it: the layout would then move an example's masks."""
        sig = fixed(per_example)
        seen = self.layouts.setdefault("call", {}).setdefault(call, (sig, per_example))
        if seen[0] != sig:
            raise ConfigError(
                f"dropout call {call} of the model's forward pass has per-example shape {list(per_example)}, where an "
                f"earlier forward of this run had {list(seen[1])}: dropout on an input whose layout changes between "
                f"batches (e.g. a channel-first sequence padded per batch). The keyed masks are laid out so that only "
                f"the sequence dimensions (the first of a 1- or 2-d input, the last two of a higher one) may vary; "
                f"pad to a fixed length, or use a batch-first (sequence, features) layout")

    def check_calls(self) -> None:
        """At the end of a forward pass with examples: refuse a number of keyed dropout calls different
        from the run's first such forward (call c is keyed by its number c)."""
        if not self.ids or self.calls == 0:  # no masks drawn (an empty batch, dropout switched off): nothing keyed
            return
        first = self.layouts.setdefault("calls", self.calls)
        if first != self.calls:
            raise ConfigError(f"the model's forward pass made {self.calls} keyed dropout calls, where the run's first "
                              f"made {first}: each call's masks are keyed by its number in the pass, so the number "
                              f"must not depend on the batch (e.g. on its padded length)")

    def _mask(self, noise_shape: tuple[int, ...], p: float, device: torch.device) -> Tensor:
        """The keep mask of a dropout input whose noise has ``noise_shape`` (the input's shape, or its
        first two dimensions for a feature dropout)."""
        if self.position is not None:  # rows path: the whole (logical) input is the one example's
            # a leading 1 is the batch dimension the rows path adds (batch.unsqueeze): the example's shape
            # without it, as on the fast path
            single = len(noise_shape) > 0 and noise_shape[0] == 1
            keep = self._keep(tuple(noise_shape[1:]) if single else noise_shape, p, device)
            keep = keep.view(keep.shape[0], *noise_shape)
            return torch.index_select(keep, 0, self.position.reshape(1)).squeeze(0)
        if _transform_level() is not None:
            raise ConfigError("the model draws dropout masks inside a torch.func transform (vmap) that clipbias does "
                              "not key per example; compute per-example gradients with clipbias (FuncGradients) or "
                              "switch the model's dropout off (model.eval() or p = 0)")
        b = len(self._rows())
        if not noise_shape or noise_shape[0] != b:
            raise PathRefusal("fast", f"a dropout input of shape {list(noise_shape)} in a batched forward of {b} "
                              f"examples: masks are keyed per example by the first dimension, which must be the batch "
                              f"(batch-first layout); use `grad_path='rows'`")
        return self._keep(tuple(noise_shape[1:]), p, device)

    def dropout(self, input: Tensor, p: float, train: bool, *, feature: bool = False, alpha: bool = False,
                inplace: bool = False) -> Tensor:
        """ATen's ``_dropout_impl`` with the keyed mask: ``input * mask / (1 - p)``; alpha dropout's
        affine form (``alpha_dropout``)."""
        if feature and input.dim() < 2:
            raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
        if p == 1:
            return input.mul_(0) if inplace else input * torch.zeros((), dtype=input.dtype, device=input.device)
        shape = tuple(input.shape[:2]) + (1,) * (input.dim() - 2) if feature else tuple(input.shape)
        noise = self._mask(shape, p, input.device).to(input.dtype)
        if alpha:
            a = 1.0 / math.sqrt((_SELU_ALPHA ** 2 * p + 1) * (1 - p))
            shift = (noise - 1) * (_SELU_ALPHA * a) + _SELU_ALPHA * a * p
            noise = noise * a
        else:
            noise = noise / (1 - p)
        out = input.mul_(noise) if inplace else input * noise
        return out.add_(shift) if alpha else out


def _szudzik(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Szudzik's pairing of non-negative integers: ``b^2 + a`` if ``a < b``, else ``a^2 + a + b``; the
    pairs with ``max(a, b) < n`` fill exactly ``[0, n^2)``."""
    return np.where(a < b, b * b + a, a * a + a + b)


def fixed(per_example: tuple[int, ...]) -> tuple:
    """The dimensions ``layout`` assumes do not change between batches: none for 0 or 1 dimensions,
    the last of 2, all but the last two of 3 or more (with the rank)."""
    k = len(per_example)
    return (k,) if k <= 1 else (k, per_example[1]) if k == 2 else (k, *per_example[:-2])


def layout(per_example: tuple[int, ...]) -> tuple[int, np.ndarray | None]:
    """Where each element of an example's dropout input of shape ``per_example`` reads its word of the
    call's keystream: ``(words, pairs)``, ``words`` the stream's length used. Up to 2 dimensions
    ``(d1, d2)``: row-major, word ``c1 d2 + c2``, which does not depend on ``d1`` (``pairs`` None: the
    element's own C-order position); 3 or more ``(*lead, a, b)``: word ``S(c_a, c_b) P + linear(lead)``
    (``S``: Szudzik's pairing, ``P``: the product of ``lead``; ``pairs``: ``S`` over ``[a, b]``), which
    depends on neither ``a`` nor ``b``. With the dimensions of ``fixed`` fixed, an element's word is a
    function of its coordinates alone."""
    k = len(per_example)
    if k <= 2:
        return math.prod(per_example), None
    P, a, b = math.prod(per_example[:-2]), per_example[-2], per_example[-1]
    if P * a * b == 0:
        return 0, np.zeros((a, b), dtype=np.int64)
    pairs = _pairs(a, b)
    return (int(pairs.max()) + 1) * P, pairs


@functools.lru_cache(maxsize=16)
def _pairs(a: int, b: int) -> np.ndarray:
    """Szudzik's pairing of ``[0, a) x [0, b)`` (read-only; int32 where it fits: 4 MB at 1024 x 1024)."""
    n = max(a, b)
    dt = np.int32 if n * n < 2 ** 31 else np.int64
    out = _szudzik(np.arange(a, dtype=dt)[:, None], np.arange(b, dtype=dt)[None, :])
    out.setflags(write=False)
    return out


def _gather(bits: np.ndarray, per_example: tuple[int, ...], pairs: np.ndarray | None, out: np.ndarray) -> None:
    """The keep bits of one example into ``out`` (flat, ``per_example`` in C order) from its call's stream
    bits (``layout``): word ``S P + l`` is column ``S`` of row ``l`` of the stream as ``[-1, P]`` transposed."""
    if pairs is None:
        out[:] = bits
        return
    P = math.prod(per_example[:-2])
    if out.size == 0:
        return
    rows = np.ascontiguousarray(bits.reshape(-1, P).T) if P > 1 else bits.reshape(1, -1)
    np.take(rows, pairs.reshape(-1), axis=1, out=out.reshape(P, pairs.size))


def _transform_level():
    """The current torch.func transform level, or None outside any (private functorch API; None where absent)."""
    get = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)
    return get() if get is not None else None


# ---------------------------------------------------------------- the dropout family
def _aten(feature: bool, alpha: bool, inplace: bool):
    """A handler for ``torch.[feature_][alpha_]dropout[_](input, p, train)``."""
    def rule(mode: KeyedForward, input: Tensor, p: float, train: bool) -> Tensor:
        if not train or p == 0 or input.numel() == 0:  # ATen returns the input, no draw
            return input
        return mode.dropout(input, p, train, feature=feature, alpha=alpha, inplace=inplace)
    return rule


def _functional(feature: bool, alpha: bool, unbatched_dim: int | None = None, training: bool = True):
    """A handler for ``F.dropout`` and its kind: ``(input, p, training, inplace)``; ``unbatched_dim``: the
    input rank that ``dropout1d`` / ``dropout3d`` take as one example without a batch dimension."""
    def rule(mode: KeyedForward, input: Tensor, p: float = 0.5, training: bool = training,
             inplace: bool = False) -> Tensor:
        if p < 0.0 or p > 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0 or input.numel() == 0:
            return input
        single = unbatched_dim is not None and input.dim() == unbatched_dim
        x = (input.unsqueeze_(0) if inplace else input.unsqueeze(0)) if single else input
        out = mode.dropout(x, p, training, feature=feature, alpha=alpha, inplace=inplace)
        return (out.squeeze_(0) if inplace else out.squeeze(0)) if single else out
    return rule


def _dropout1d(mode: KeyedForward, input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
    if input.dim() not in (2, 3):
        raise RuntimeError(f"dropout1d: Expected 2D or 3D input, but received a {input.dim()}D input")
    return _functional(True, False, unbatched_dim=2)(mode, input, p, training, inplace)


def _sdpa(mode: KeyedForward, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention``: torch's own kernel where it draws nothing (``dropout_p == 0``);
    with attention dropout, the math form torch documents (and its math backend computes),
    ``dropout(softmax(Q K^T scale + bias)) V``, with the attention weights' mask keyed per example like
    any dropout input (row r of the weights is example r of the batched forward; on the rows path the
    whole of them is the one example's). ``bias``: ``attn_mask`` (bool: False is masked out; float:
    added) and the upper-left causal mask of ``is_causal``; a query row with every key masked gets
    zero weights, as in torch's math backend. ``enable_gqa``: the key and value heads repeated to the
    query's."""
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale=scale, **kwargs)
    if not 0.0 < dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    L, S = query.shape[-2], key.shape[-2]
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa and key.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
    scores = query @ key.transpose(-2, -1) * factor
    if is_causal:
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    # a row whose every key is masked: zero weights (torch's math backend), not softmax's NaN
    weights = torch.where(torch.isneginf(scores).all(-1, keepdim=True), torch.zeros((), dtype=weights.dtype,
                                                                                   device=weights.device), weights)
    return mode.dropout(weights, dropout_p, True) @ value


def _native(mode: KeyedForward, input: Tensor, p: float, train: bool | None = None) -> tuple[Tensor, Tensor]:
    if train is False or input.numel() == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    if p == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = mode._mask(tuple(input.shape), p, input.device) if p < 1 else torch.zeros_like(input, dtype=torch.bool)
    return (input * keep.to(input.dtype) / (1 - p) if p < 1 else input * 0), keep


@functools.lru_cache(maxsize=None)
def _unchecked(func):
    """A copy of the Python function ``func`` (a composite of ``torch.nn.functional``) whose own check for a
    torch function mode is off: under the re-entered mode it runs its body instead of handing itself back."""
    import types
    glob = dict(func.__globals__, has_torch_function=lambda *a: False,
                has_torch_function_unary=lambda *a: False, has_torch_function_variadic=lambda *a: False)
    copy = types.FunctionType(func.__code__, glob, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


def _composite(func):
    """The rule of a composite that draws inside (``F.multi_head_attention_forward``, under
    ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``): the mode runs ``func`` with the mode
    switched off, so its inner ``F.dropout`` would draw from torch's generator (refused after the fact). Its body
    runs under the mode instead, so that the dropout (and SDPA's ``dropout_p``) inside are keyed like any other."""
    def rule(mode: KeyedForward, *args, **kwargs):
        with mode:
            return _unchecked(func)(*args, **kwargs)
    return rule


_RULES = {
    F.multi_head_attention_forward: _composite(F.multi_head_attention_forward),
    torch.dropout: _aten(False, False, False), torch.dropout_: _aten(False, False, True),
    torch.feature_dropout: _aten(True, False, False), torch.feature_dropout_: _aten(True, False, True),
    torch.alpha_dropout: _aten(False, True, False), torch.alpha_dropout_: _aten(False, True, True),
    torch.feature_alpha_dropout: _aten(True, True, False), torch.feature_alpha_dropout_: _aten(True, True, True),
    torch.native_dropout: _native,
    F.dropout: _functional(False, False), F.dropout1d: _dropout1d, F.dropout2d: _functional(True, False),
    F.dropout3d: _functional(True, False, unbatched_dim=4),
    F.alpha_dropout: _functional(False, True, training=False),
    F.feature_alpha_dropout: _functional(True, True, training=False),
    F.scaled_dot_product_attention: _sdpa,
}
_DROPOUT_NAMES = "nn.Dropout, Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout and their functions"


# ---------------------------------------------------------------- refused draws
def _named(owner, names: str, prefix: str) -> dict:
    return {getattr(owner, n): prefix + n for n in names.split() if hasattr(owner, n)}


_RANDOM = {
    **_named(torch, "rand rand_like randn randn_like randint randint_like randperm bernoulli multinomial normal "
                    "poisson binomial _standard_gamma _sample_dirichlet rrelu rrelu_", "torch."),
    **_named(torch.Tensor, "uniform_ normal_ bernoulli bernoulli_ random_ exponential_ geometric_ cauchy_ "
                           "log_normal_ multinomial", "Tensor."),
    **_named(F, "rrelu rrelu_ gumbel_softmax", "torch.nn.functional."),
}


def _seeded(func, args: tuple, kwargs: dict) -> str | None:
    """The name of a random draw the list above does not hold: an ATen operator called directly
    (``torch.ops.aten.bernoulli.p``, tagged ``nondeterministic_seeded``), or any call given a
    ``torch.Generator`` (a generator object of the model's own moves no global generator, so the check after
    the pass would not see it)."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        tags = {t for o in func.overloads() for t in getattr(func, o).tags}
    else:
        tags = getattr(func, "tags", ()) if isinstance(func, torch._ops.OpOverload) else ()
    if torch.Tag.nondeterministic_seeded in tags or any(
            isinstance(a, torch.Generator) for a in (*args, *kwargs.values())):
        return getattr(func, "__name__", None) or str(func)
    return None


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether a call of a function of ``_RANDOM`` draws random numbers (rrelu only in training)."""
    if func in (torch.rrelu, torch.rrelu_, F.rrelu, F.rrelu_):
        return bool(args[3] if len(args) > 3 else kwargs.get("training", False))
    return True


# ---------------------------------------------------------------- scopes
def active() -> KeyedForward | None:
    """The keyed mode of the step being computed, or None."""
    return getattr(_local, "mode", None)


def snapshot(device: torch.device | str = "cpu") -> tuple:
    """The states of the public generators a forward could draw from: torch's CPU one (and the CUDA
    one of ``device``), Python's ``random`` and numpy's global one."""
    device = torch.device(device)
    state = np.random.get_state()
    return (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            random.getstate(), state[1].tobytes() + bytes(str(state[2:]), "ascii"))


_FORWARD_REMEDY = ("Only dropout is drawn in the private forward (per example, from the run's secret key); remove the "
                   "draw or move it before the model")


def check_generators(before: tuple, device: torch.device | str = "cpu", where: str = "the model's forward pass",
                     remedy: str = _FORWARD_REMEDY) -> None:
    """Refuse when a public generator moved since ``before`` (``snapshot``): ``where`` drew from it."""
    now = snapshot(device)
    moved = [name for name, a, b in zip(("torch's", "torch's CUDA", "Python's random", "numpy's global"), before, now)
             if not (torch.equal(a, b) if isinstance(a, Tensor) else a == b)]
    if moved:
        raise ConfigError(f"{where} drew random numbers from {moved[0]} generator: its state is a public function of "
                          f"the seed and its draws go by batch position, so the DP guarantee would not hold. {remedy}")


@contextlib.contextmanager
def keyed(key: SecretKey, step: int, device: torch.device | str = "cpu", layouts: dict | None = None,
          refusal: str | None = None, listen: tuple | None = None) -> Iterator[KeyedForward]:
    """The private computation of step ``step``: in its forward passes (``one_pass``) dropout keyed per
    example and other draws refused; on leaving, refused if a public generator moved anywhere in it
    (``check_generators``). ``layouts``: the run's record of its dropout calls' layouts (a dict kept
    by the engine across steps; None: a fresh one, for this scope only). ``refusal``: the error of a
    step on which no mask may be drawn (a left-padded batch: ``engine.checks.padding_refusal``), raised
    at the first mask, whichever operator draws it (a module, ``F.dropout`` in the model's code, SDPA).
    ``listen``: ``(functions, callback)``, ``callback(func, args)`` called before each of ``functions`` the
    forward calls (the state guard's watch of ``.data`` and pointers: ``clipbias.engine.guard``)."""
    if active() is not None:
        raise RuntimeError("keyed forward scopes do not nest")
    mode, before = KeyedForward(key, step, layouts, refusal, listen), snapshot(device)
    _local.mode = mode
    try:
        yield mode
    finally:
        _local.mode = None
    check_generators(before, device)


def mask_of(t: Tensor) -> tuple[int, float] | None:
    """``(call, p)`` where ``t`` is a keyed mask made in the current forward pass (``KeyedForward._keep``: the
    ``[rows, prod(per_example)]`` bool tensor whose row r is example ``ids[r]``'s mask of keyed call ``call``, a
    function of the key, the step, the call and that example alone; ``p`` its rate), else None. The graph proof
    (``clipbias.grads.proof``) takes such a mask as an input of the batch, one row per example."""
    mode = active()
    hit = None if mode is None else mode.made.get(id(t))
    return None if hit is None or hit[0] is not t else (hit[1], hit[2])


@contextlib.contextmanager
def examples(ids: Tensor | Sequence[int] | None) -> Iterator[None]:
    """The forwards inside compute the rows of the examples ``ids`` (in row order; None: unknown)."""
    mode = active()
    if mode is None:
        yield
        return
    saved = mode.ids
    mode.ids = None if ids is None else int_list(ids)
    try:
        yield
    finally:
        mode.ids = saved


@contextlib.contextmanager
def refusing(why: str) -> Iterator[None]:
    """Any keyed dropout mask drawn inside is refused with ``why`` (``ConfigError``): a step whose layout of the
    examples' inputs the masks do not cover (several views of each example)."""
    mode = active()
    if mode is None:
        yield
        return
    saved = mode.refusal
    mode.refusal = why
    try:
        yield
    finally:
        mode.refusal = saved


@contextlib.contextmanager
def same_example(row: int) -> Iterator[None]:
    """Every row is the example of row ``row`` (the fast path's counterfactual batch of its copies)."""
    mode = active()
    ids = mode.ids if mode is not None else None
    with examples(None if ids is None else [ids[row]] * len(ids)):
        yield


@contextlib.contextmanager
def only(row: int) -> Iterator[None]:
    """The forwards inside compute example ``row`` of the current ones alone (the rows path run one
    example at a time, for a model ``vmap`` cannot run)."""
    mode = active()
    ids = mode.ids if mode is not None else None
    with examples(None if ids is None else [ids[row]]):
        yield


class Pass:
    """What ``one_pass`` saw: ``calls``, the keyed dropout calls of the forward."""
    calls = 0


@contextlib.contextmanager
def one_pass(position: Tensor | None = None) -> Iterator[Pass]:
    """One forward pass of the model, under the mode (only the model's own computation: clipbias's
    arithmetic around it is not intercepted); the dropout calls are numbered from 0.
    ``position``: the rows path's position of the (vmapped) example in ``ids``."""
    mode, seen = active(), Pass()
    if mode is None:
        yield seen
        return
    saved = mode.calls, mode.position, mode.inside, mode.made
    mode.calls, mode.position, mode.inside, mode.made = 0, position, True, {}
    try:
        with mode if not saved[2] else contextlib.nullcontext():
            yield seen
        mode.check_calls()
    finally:
        seen.calls = mode.calls
        mode.calls, mode.position, mode.inside, mode.made = saved
