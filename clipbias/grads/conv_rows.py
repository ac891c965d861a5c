"""Per-example weight gradients of a convolution, by whichever of three exact kernels is fastest here.

Example i's weight gradient of a ``Conv1d``/``Conv2d``/``Conv3d`` is the correlation of its
(padded) input with its output gradient; with ``groups`` > 1 (depthwise: ``groups`` = input
channels), the correlation of each group's input channels with the same group's output gradients.
A padding other than plain zeros (``padding_mode`` "reflect", "replicate", "circular";
``padding="same"``) is applied to the input first, as the layer's forward applies it (``_as_nd``).
Four computations give it, equal up to the order of float additions, and which is fastest depends
on the shapes, the backend and the CPU (measured on one AMD EPYC with AVX-512, B = 256: 1.2-3.3 ms
for the Tramer & Boneh cnn's first layer, 1.0-10.6 ms for its second):

* ``unfold``: im2col (``F.unfold``; ``input_rows`` for a Conv3d) then one batched product
  ``g_i [o, L] @ a_i [L, k]``, per group;
* ``rows``: the same product on ``input_rows`` (a copy of a strided view of the padded input, already
  ``[b, L, c k]``; ``F.unfold``'s im2col took 5 ms a step of the cnn's 20 under a profiler);
* ``grouped``: the convolution's own weight-gradient kernel with the batch folded into the channels
  and ``groups = b * groups`` (``aten.convolution_backward``), one group per example and layer group;
* ``dilated`` (``groups=1`` only): a forward convolution of the input (channels as batch) with the
  output gradients as the kernel, dilated by the stride, ``groups = b`` (the stride becomes the
  dilation and back).

``conv_weight_rows`` times each once per layer shape, batch size (to a power of two), dtype, device,
thread count and memory layout (the first call; ``CHOICE_ROUNDS`` interleaved runs each, tens of
milliseconds), on public stand-in data in the batch's layout, and keeps the fastest whose result
agrees with ``unfold``'s to 1e-4 relative: a backend that computed something else is never used, and
the private batch plays no part in the choice. The result is the per-example
gradient itself, from which the fast path takes both the norm and the clipped sum, so which kernel
ran does not enter the clipping bound.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["conv_weight_rows", "input_rows", "unfold_input", "KERNELS"]


def _as_nd(m: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor, tuple, tuple, tuple, tuple]:
    """(input, output gradient, kernel, stride, padding, dilation) of a convolution as a Conv2d or
    Conv3d (a Conv1d as a Conv2d of height 1). A padding that is not plain zeros on both sides (a
    ``padding_mode`` of "reflect", "replicate" or "circular", or ``padding="same"``) is applied to the
    input here as the layer's forward applies it (``F.pad`` by ``_reversed_padding_repeated_twice``),
    and the padding returned is then 0."""
    p = tuple(m.padding) if not isinstance(m.padding, str) else (0,) * len(m.kernel_size)
    if m.padding_mode != "zeros" or isinstance(m.padding, str):
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        a = F.pad(a, m._reversed_padding_repeated_twice, mode=mode)
        p = (0,) * len(m.kernel_size)
    if isinstance(m, nn.Conv1d):
        return (a.unsqueeze(2), g.unsqueeze(2), (1, *m.kernel_size), (1, *m.stride), (0, *p), (1, *m.dilation))
    return a, g, tuple(m.kernel_size), tuple(m.stride), p, tuple(m.dilation)


def unfold_input(m: nn.Module, a: Tensor) -> Tensor:
    """A convolution's input as ``[b, c * prod(kernel), L]`` columns (im2col; a Conv1d as a Conv2d of
    height 1; a Conv3d's from ``input_rows``: ``F.unfold`` takes 4-D inputs only)."""
    if isinstance(m, nn.Conv3d):
        return input_rows(m, a).transpose(1, 2)
    a, _, k, s, p, d = _as_nd(m, a, a)
    return F.unfold(a, k, d, p, s)


def input_rows(m: nn.Module, a: Tensor) -> Tensor:
    """``unfold_input(m, a).transpose(1, 2)`` made contiguous, ``[b, L, c * prod(kernel)]``: the same
    values, gathered by one copy of a strided view of the (zero-padded) input. ``F.unfold`` took 2.0 ms
    for the cnn's first input at B = 256 (AVX-512) and 1.5 ms for its second, this 0.75 and 1.1 ms. On
    an NCHW input with many channels the copy itself can be the slower (resnet20-gn's 64-channel layer
    at B = 512: 14.7 against 7.7 ms), but the ghost norm's Gram products over contiguous rows gain more
    (31.8 against 34.2 ms for both). Conv3d too (three spatial dimensions)."""
    a, _, k, s, p, d = _as_nd(m, a, a)
    if any(p):
        a = F.pad(a, tuple(x for q in reversed(p) for x in (q, q)))
    b, c, *size = a.shape
    out = [(n - d[j] * (k[j] - 1) - 1) // s[j] + 1 for j, n in enumerate(size)]
    sb, sc, *ss = a.stride()
    view = a.as_strided((b, *out, c, *k), (sb, *(x * y for x, y in zip(ss, s)), sc, *(x * y for x, y in zip(ss, d))),
                        a.storage_offset())
    return view.reshape(b, math.prod(out), c * math.prod(k))


def _unfold(m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
    """im2col and one batched product per group (``groups`` > 1: example i's rows of group j are the
    products of its output channels in j with its input channels in j)."""
    G, b, o = m.groups, g.shape[0], g.shape[1]
    cols = unfold_input(m, a)
    if G == 1:
        return torch.bmm(g.flatten(2), cols.transpose(1, 2))
    gg = g.flatten(2).reshape(b * G, o // G, -1)                  # [b G, o / G, L]
    cc = cols.reshape(b * G, cols.shape[1] // G, -1)              # [b G, c / G * prod(kernel), L]
    return torch.bmm(gg, cc.transpose(1, 2)).reshape(b, o, -1)


def _rows(m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
    """``unfold``'s product on ``input_rows`` (one copy of a strided view of the input, ``[b, L, c k]``: no im2col,
    and the product's second operand contiguous as it reads it), per group."""
    G, b, o = m.groups, g.shape[0], g.shape[1]
    rows = input_rows(m, a)
    if G == 1:
        return torch.bmm(g.flatten(2), rows)
    L = rows.shape[1]
    gg = g.flatten(2).reshape(b * G, o // G, -1)                               # [b G, o / G, L]
    cc = rows.reshape(b, L, G, -1).transpose(1, 2).reshape(b * G, L, -1)       # [b G, L, c / G * prod(kernel)]
    return torch.bmm(gg, cc).reshape(b, o, -1)


def _grouped(m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
    a, g, k, s, p, d = _as_nd(m, a, g)
    b, c, o, G = a.shape[0], a.shape[1], g.shape[1], m.groups
    w = a.new_empty((b * o, c // G, *k))  # only its shape is read
    gw = torch.ops.aten.convolution_backward(g.reshape(1, b * o, *g.shape[2:]), a.reshape(1, b * c, *a.shape[2:]), w,
                                             None, list(s), list(p), list(d), False, [0] * len(k), b * G,
                                             [False, True, False])[1]
    return gw.reshape(b, o, c // G * math.prod(k))


def _dilated(m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
    if m.groups != 1:  # it would compute every channel pair, groups times the work: not a candidate (_choose)
        raise RuntimeError("the dilated kernel takes groups=1 only")
    a, g, k, s, p, d = _as_nd(m, a, g)
    b, c, o = a.shape[0], a.shape[1], g.shape[1]
    conv = F.conv2d if len(k) == 2 else F.conv3d
    # out[c, i*o + q, y, x] = sum_{h,w} g[i, q, h, w] a_pad[i, c, d*y + s*h, d*x + s*w]: rows 0..k of it
    out = conv(a.transpose(0, 1), g.reshape(b * o, 1, *g.shape[2:]), None, d, p, s, b)
    out = out[(slice(None), slice(None), *(slice(0, q) for q in k))].reshape(c, b, o, math.prod(k))
    return out.permute(1, 2, 0, 3).reshape(b, o, c * math.prod(k))


KERNELS: dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    "unfold": _unfold, "rows": _rows, "grouped": _grouped, "dilated": _dilated}
"""The exact kernels, by name; ``unfold`` is the reference the others are checked against."""

_CHOICE: dict[tuple, str] = {}


def _bucket(b: int) -> int:
    """The batch size rounded up to a power of two: Poisson batches vary in size every step, and the
    fastest kernel does not change within a factor of two."""
    return 1 << max(0, (b - 1).bit_length())


def _key(m: nn.Module, a: Tensor, g: Tensor) -> tuple:
    return (type(m), _bucket(a.shape[0]), tuple(a.shape[1:]), tuple(g.shape[1:]), tuple(m.kernel_size),
            tuple(m.stride), m.padding, m.padding_mode, m.groups, tuple(m.dilation), a.dtype, a.device,
            torch.get_num_threads(), a.is_contiguous(), g.is_contiguous())  # the layouts: the speeds depend on them


CHOICE_ROUNDS = 9
"""Timed runs of each candidate kernel when one is chosen, interleaved round by round: with the best of
two runs each, timed one kernel after the other, a neighbouring process's load picked im2col (2.6x
slower) for the cnn's second layer in 2 of 6 fresh processes on 2 cores with one of them busy."""


def _time(f: Callable[[nn.Module, Tensor, Tensor], Tensor], m: nn.Module, a: Tensor, g: Tensor) -> float:
    """Seconds for one run of ``f(m, a, g)`` (the caller has run it once untimed)."""
    sync = torch.cuda.synchronize if a.device.type == "cuda" else (lambda *_: None)
    sync(a.device)
    t = time.perf_counter()
    f(m, a, g)
    sync(a.device)
    return time.perf_counter() - t


def conv_weight_rows(m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
    """``[b, o, c * prod(kernel)]``: example i's gradient of ``m.weight`` (flattened as ``m.weight[o]``),
    from the layer's input ``a`` and output gradient ``g``, by the fastest agreeing kernel."""
    if a.dtype != g.dtype:  # e.g. a float32 input and a bfloat16 output gradient: one dtype, exactly widened
        dt = torch.promote_types(a.dtype, g.dtype)
        a, g = a.to(dt), g.to(dt)
    key = _key(m, a, g)
    name = _CHOICE.get(key)
    if name is None:
        name = _CHOICE[key] = _choose(m, a, g)
    return KERNELS[name](m, a, g)


def _choose(m: nn.Module, a: Tensor, g: Tensor) -> str:
    """The fastest kernel on these shapes whose result agrees with ``unfold``'s, timed on public
    stand-ins (normal draws of a fixed seed at the bucketed batch size), not on the batch: which
    kernel runs, and so the rounding of the result, must not depend on the private data (a
    subnormal input can slow a kernel down)."""
    gen = torch.Generator(a.device).manual_seed(0)
    b = _bucket(a.shape[0])
    a, g = (_layout_of(t, torch.randn((b, *t.shape[1:]), generator=gen, device=t.device, dtype=t.dtype)) for t in (a, g))
    ref = _unfold(m, a, g)  # also the untimed first run of unfold
    scale = float(torch.linalg.vector_norm(ref.float())) + 1e-30
    candidates = {"unfold": _unfold}
    for name, f in KERNELS.items():
        if name == "unfold":
            continue
        try:
            got = f(m, a, g)  # the untimed first run (a backend builds its primitive here)
        except RuntimeError:  # a backend without that kernel for these shapes or this dtype
            continue
        if got.shape != ref.shape or float(torch.linalg.vector_norm((got - ref).float())) > 1e-4 * scale:
            continue
        candidates[name] = f
    best_t = dict.fromkeys(candidates, float("inf"))
    for _ in range(CHOICE_ROUNDS):  # round by round, so that a neighbour's load hits every kernel alike
        for name, f in candidates.items():
            best_t[name] = min(best_t[name], _time(f, m, a, g))
    return min(best_t, key=best_t.__getitem__)  # the first of equals: unfold before the others


def _layout_of(real: Tensor, stand_in: Tensor) -> Tensor:
    """``stand_in`` in ``real``'s memory layout (channels-last or contiguous): the kernels' speed depends
    on it."""
    last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(real.dim())
    if last is not None and not real.is_contiguous() and real.is_contiguous(memory_format=last):
        return stand_in.contiguous(memory_format=last)
    return stand_in
