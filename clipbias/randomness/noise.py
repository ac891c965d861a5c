"""The Gaussian noise of a release, rounded once onto a data-independent grid.

``snapped_gaussian(x, std, key, draw)`` returns ``round_g(x + std * Z)``: ``Z`` standard normal from
the secret key (``draws.normals``, float64), the sum taken in float64 and rounded **exactly** (an
error-free two-sum decides the rounding of the exact real sum, no double rounding) to the nearest
multiple of the power of two ``g = noise_grid(std)``, between std / 512 and std / 256.

Why (docs/privacy.md, "Floating-point noise"): the attacks on floating-point DP noise (Mironov 2012;
Jin et al. 2022) read the low-order bits of a released value: a float that the noise could not have
produced around one input but could around its neighbour. The released values here lie on a grid
that depends only on the public std, over 2^36 times coarser than the float64 error of the noise
(at most 2^-45 std), so every grid point near ``x`` is reachable from either neighbour with nearly
the ideal probability, and rounding an (ideal) Gaussian release is post-processing. The rounding
adds a variance of at most g^2 / 12 < 2^-19 std^2.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .draws import _CHUNK_PAIRS, normal_chunks
from .key import Purpose, SecretKey

GRID_BITS = 8


def noise_grid(std: float) -> float:
    """The grid spacing for noise of standard deviation ``std`` > 0: 2^(floor(log2 std) - 8)."""
    _, e = math.frexp(std)  # std = m 2^e, m in [1/2, 1)
    return math.ldexp(1.0, e - 1 - GRID_BITS)


def snap(x: Tensor, s: Tensor, g: float) -> Tensor:
    """``x + s`` (float64) rounded to the nearest multiple of the power of two ``g``, exactly.

    two-sum: x + s = t + err exactly, with t = fl(x + s). k = round(t / g) is exact arithmetic on the
    float t; r = t - k g is exact; only a tie |r| = g / 2 can be decided by err (ties are rare: the
    correction runs only when one occurs). Exact while ulp(x + s) <= g, i.e. |x + s| < 2^52 g (about
    2^44 std): beyond, t itself is a grid point within ulp/2 of the exact sum."""
    t = x + s
    k = t.mul(1.0 / g).round_()
    r = torch.add(t, k, alpha=-g)  # t - k g: k g is exact (g a power of two), so one rounding either way
    if bool((r.abs() == g / 2).any()):
        ties = r.abs() == g / 2
        bp = t - x
        err = (x - (t - bp)) + (s - bp)
        k = k + (ties & (r > 0) & (err > 0)).to(k.dtype) - (ties & (r < 0) & (err < 0)).to(k.dtype)
    return k.mul_(g)


def snapped_gaussian(x: Tensor, std: float, key: SecretKey, draw: int, purpose: int = Purpose.NOISE,
                     dtype: torch.dtype = torch.float64, normals: Tensor | None = None) -> Tensor:
    """``round_g(x + std Z)`` (shape of ``x``, in ``dtype``: float64 by default; a narrower dtype is a
    rounding of the float64 grid value, post-processing), Z from the address ``(purpose, draw, 0)``;
    computed piece by piece of the noise stream.

    ``normals``: Z already drawn (``draws.normals(key, purpose, draw, 0, x.numel(), x.device)``, made ahead
    by ``prefetch.NormalsPrefetch``), scaled in place (it is spent); the same values piece by piece, so the
    same release (every operation here is elementwise)."""
    flat, g = x.reshape(-1), noise_grid(std)
    out = torch.empty(flat.shape, dtype=dtype, device=x.device)
    if normals is None:
        scaled = ((start, z.mul_(std)) for start, z in normal_chunks(key, purpose, draw, 0, flat.numel(), x.device))
    else:
        if normals.shape != flat.shape or normals.dtype != torch.float64 or normals.device != x.device:
            raise ValueError(f"snapped_gaussian: normals drawn ahead must be float64 [{flat.numel()}] on {x.device}, "
                             f"got {normals.dtype} {list(normals.shape)} on {normals.device}")
        n = 2 * _CHUNK_PAIRS  # pieces of the size normal_chunks yields on the CPU
        scaled = ((start, normals[start:start + n].mul_(std)) for start in range(0, flat.numel(), n))
    for start, s in scaled:
        piece = slice(start, start + len(s))
        out[piece] = snap(flat[piece].to(torch.float64), s, g)
    return out.view(x.shape)
