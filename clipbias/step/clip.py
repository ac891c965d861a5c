"""Bounding the rows: clipping (``Clip``: g_i * min(1, C / ||g_i||)) and normalisation (``Normalize``:
g_i / (||g_i|| + gamma)), with the per-row factors they multiply by (``clip_scale``, ``normalize_scale``,
``safe_factor``) and the row operations (``clip_rows``, ``normalize_rows``, ``scale_rows``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from ..grads.precision import last_norms
from .stage import PerSample, StepContext


def safe_factor(norms: Tensor, factor: Tensor) -> Tensor:
    """A per-row factor as the rows may use it: 0 where it is below float32's smallest normal number
    or the row's norm is not finite.

    A subnormal float32 factor carries up to 100 % rounding (a row of norm 1 contributed 1.96 C at
    C = 0.51 * 2^-149, adaptive clipping drove C there; a single-parameter row of norm 3.4e38 at
    C = 1e-6 contributed 1.20 C); a normal one at most 2^-24. A factor of 0 is always within the
    bound (the row contributes nothing), and so is the zero row a non-finite norm gets (``inf * 0``
    would be NaN). Both cases are data-dependent roundings below the bound, not refusals."""
    ok = torch.isfinite(norms) & (factor >= torch.finfo(torch.float32).tiny)
    return torch.where(ok, factor, torch.zeros_like(factor))


TINY_CLIP = 1e-30
"""Below this clip a clipped row's entries would be float32 subnormals, whose rounding (2^-149 each,
not relative) can exceed the clip itself: clipped rows then contribute 0, rows within the clip
themselves (adaptive clipping can drive its clip there when every gradient is 0)."""


def clip_scale(norms: Tensor, c: float) -> Tensor:
    """min(1, C / ||g_i||): the factor ``clip_rows`` multiplies each row by (``safe_factor``)."""
    factor = torch.clamp(c / norms.clamp_min(1e-30), max=1.0)
    if c < TINY_CLIP:
        factor = (factor >= 1).to(factor.dtype)
    return safe_factor(norms, factor)


def normalize_scale(norms: Tensor, gamma: float) -> Tensor:
    """1 / (||g_i|| + gamma): the factor ``normalize_rows`` multiplies each row by (``safe_factor``)."""
    return safe_factor(norms, 1.0 / (norms + gamma))


def scale_rows(g: Tensor, factor: Tensor) -> Tensor:
    """``g * factor`` per row (factors from ``clip_scale``/``normalize_scale``): a row with a non-finite
    norm has factor 0, and its infinite entries' ``inf * 0 = NaN`` become 0 (one pass, in place)."""
    return (g * factor.to(g.dtype)).nan_to_num_(nan=0.0)


def clip_rows(g: Tensor, c: float) -> Tensor:
    """clip(g_i, C) = g_i * min(1, C / ||g_i||) along the last axis (global L2 norm over all
    parameters): each row of ``[..., b, d]``, or one vector ``[d]``."""
    return scale_rows(g, clip_scale(last_norms(g, keepdim=True), c))


def normalize_rows(g: Tensor, gamma: float) -> Tensor:
    """g_i / (||g_i|| + gamma): automatic clipping (Bu et al. 2022); every row has norm < 1."""
    # an infinite entry: inf / inf = NaN -> 0
    return (g / (last_norms(g, keepdim=True) + gamma).to(g.dtype)).nan_to_num_(nan=0.0)



class Clip(PerSample):
    def __init__(self, c: float) -> None:
        if not c > 0:
            raise ConfigError(f"clip norm must be > 0, got {c!r}")
        self.c = self.bound = float(c)

    def __call__(self, g: Tensor, ctx: StepContext) -> Tensor:
        return clip_rows(g, self.c)

    def scale(self, norms: Tensor) -> Tensor:
        return clip_scale(norms, self.c)


class Normalize(PerSample):
    def __init__(self, gamma: float = 0.01) -> None:
        if not gamma > 0:
            raise ConfigError(f"`AlgoConfig.gamma` (normalisation stability constant) must be > 0, got {gamma!r}")
        self.gamma, self.bound = float(gamma), 1.0

    def __call__(self, g: Tensor, ctx: StepContext) -> Tensor:
        return normalize_rows(g, self.gamma)

    def scale(self, norms: Tensor) -> Tensor:
        return normalize_scale(norms, self.gamma)
