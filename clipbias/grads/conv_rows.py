"""Per-example weight gradients of a convolution, by whichever of three exact kernels is fastest here.

Example i's weight gradient of a ``Conv1d``/``Conv2d`` (``groups=1``, zero padding) is the
correlation of its input with its output gradient. Three computations give it, equal up to the
order of float additions, and which is fastest depends on the shapes, the backend and the CPU
(measured on one AMD EPYC with AVX-512, B = 256: 1.2-3.3 ms for the Tramer & Boneh cnn's first
layer, 1.0-10.6 ms for its second):

* ``unfold``: ``F.unfold`` (im2col) then one batched product ``g_i [o, L] @ a_i [L, k]``;
* ``grouped``: the convolution's own weight-gradient kernel with the batch folded into the channels
  and ``groups = b`` (``aten.convolution_backward``), one group per example;
* ``dilated``: a forward convolution of the input (channels as batch) with the output gradients as
  the kernel, dilated by the stride, ``groups = b`` (the stride becomes the dilation and back).

``conv_weight_rows`` times each once per layer shape, batch size (to a power of two), dtype, device,
thread count and memory layout (the first call; ``CHOICE_ROUNDS`` interleaved runs each, tens of
milliseconds), on public stand-in data in the batch's layout, and keeps the fastest whose result
agrees with ``unfold``'s to 1e-4 relative: a backend that computed something else is never used, and
the private batch plays no part in the choice. The result is the per-example
gradient itself, from which the fast path takes both the norm and the clipped sum, so which kernel
ran does not enter the clipping bound.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["conv_weight_rows", "input_rows", "unfold_input", "KERNELS"]


def _as_2d(m: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor, tuple, tuple, tuple, tuple]:
    """A Conv1d as a Conv2d of height 1: (input, output gradient, kernel, stride, padding, dilation)."""
    if isinstance(m, nn.Conv1d):
        return (a.unsqueeze(2), g.unsqueeze(2), (1, *m.kernel_size), (1, *m.stride), (0, *m.padding),
                (1, *m.dilation))
    return a, g, tuple(m.kernel_size), tuple(m.stride), tuple(m.padding), tuple(m.dilation)


def unfold_input(m: nn.Module, a: Tensor) -> Tensor:
    """A convolution's input as ``[b, c * prod(kernel), L]`` columns (im2col; a Conv1d as a Conv2d of height 1)."""
    a, _, k, s, p, d = _as_2d(m, a, a)
    return F.unfold(a, k, d, p, s)


def input_rows(m: nn.Module, a: Tensor) -> Tensor:
    """``unfold_input(m, a).transpose(1, 2)`` made contiguous, ``[b, L, c * prod(kernel)]``: the same
    values, gathered by one copy of a strided view of the (zero-padded) input. ``F.unfold`` took 2.0 ms
    for the cnn's first input at B = 256 (AVX-512) and 1.5 ms for its second, this 0.75 and 1.1 ms. On
    an NCHW input with many channels the copy itself can be the slower (resnet20-gn's 64-channel layer
    at B = 512: 14.7 against 7.7 ms), but the ghost norm's Gram products over contiguous rows gain more
    (31.8 against 34.2 ms for both)."""
    a, _, k, s, p, d = _as_2d(m, a, a)
    if any(p):
        a = F.pad(a, (p[1], p[1], p[0], p[0]))
    b, c, h, w = a.shape
    oh, ow = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1, (w - d[1] * (k[1] - 1) - 1) // s[1] + 1
    sb, sc, sh, sw = a.stride()
    view = a.as_strided((b, oh, ow, c, k[0], k[1]), (sb, sh * s[0], sw * s[1], sc, sh * d[0], sw * d[1]),
                        a.storage_offset())
    return view.reshape(b, oh * ow, c * k[0] * k[1])


def _unfold(m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
    return torch.bmm(g.flatten(2), unfold_input(m, a).transpose(1, 2))


def _grouped(m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
    a, g, k, s, p, d = _as_2d(m, a, g)
    b, c, o = a.shape[0], a.shape[1], g.shape[1]
    w = a.new_empty((b * o, c, *k))  # only its shape is read
    gw = torch.ops.aten.convolution_backward(g.reshape(1, b * o, *g.shape[2:]), a.reshape(1, b * c, *a.shape[2:]), w,
                                             None, list(s), list(p), list(d), False, [0, 0], b,
                                             [False, True, False])[1]
    return gw.reshape(b, o, c * k[0] * k[1])


def _dilated(m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
    a, g, k, s, p, d = _as_2d(m, a, g)
    b, c, o = a.shape[0], a.shape[1], g.shape[1]
    # out[c, i*o + q, y, x] = sum_{h,w} g[i, q, h, w] a_pad[i, c, d*y + s*h, d*x + s*w]: rows 0..k of it
    out = F.conv2d(a.transpose(0, 1), g.reshape(b * o, 1, *g.shape[2:]), None, d, p, s, b)
    out = out[:, :, :k[0], :k[1]].reshape(c, b, o, k[0] * k[1])
    return out.permute(1, 2, 0, 3).reshape(b, o, c * k[0] * k[1])


KERNELS: dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    "unfold": _unfold, "grouped": _grouped, "dilated": _dilated}
"""The exact kernels, by name; ``unfold`` is the reference the others are checked against."""

_CHOICE: dict[tuple, str] = {}


def _bucket(b: int) -> int:
    """The batch size rounded up to a power of two: Poisson batches vary in size every step, and the
    fastest kernel does not change within a factor of two."""
    return 1 << max(0, (b - 1).bit_length())


def _key(m: nn.Module, a: Tensor, g: Tensor) -> tuple:
    return (type(m), _bucket(a.shape[0]), tuple(a.shape[1:]), tuple(g.shape[1:]), tuple(m.kernel_size),
            tuple(m.stride), tuple(m.padding), tuple(m.dilation), a.dtype, a.device, torch.get_num_threads(),
            a.is_contiguous(), g.is_contiguous())  # the layouts (channels-last or not): the speeds depend on them


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
    if real.dim() == 4 and not real.is_contiguous() and real.is_contiguous(memory_format=torch.channels_last):
        return stand_in.contiguous(memory_format=torch.channels_last)
    return stand_in
