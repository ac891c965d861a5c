"""Full float32 arithmetic where the sensitivity depends on it.

torch lets float32 matrix products run in TF32 (10-bit mantissa) or bfloat16 passes
(``torch.set_float32_matmul_precision("high" | "medium")``, ``torch.backends.cuda.matmul.allow_tf32``)
and runs cuDNN convolutions in TF32 by default. A clipped sum ``s @ rows`` computed that way rounds
each row by up to 2^-11 (2^-8) before its clip factor meets it, so one example could contribute
``C (1 + 2^-11)``: the clipped sums, and the fast path's norms and probes, run inside
``full_float32()``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from ..errors import ConfigError


def _precision_leaves() -> list:
    """torch >= 2.9's per-backend float32 precision settings that decide float32 matrix products and
    convolutions (``fp32_precision``: "ieee", "tf32", "bf16" or "none" = inherit); [] before 2.9."""
    b = torch.backends
    leaves = [b.cuda.matmul, b.cudnn.conv, b.mkldnn.matmul, b.mkldnn.conv]
    return leaves if all(hasattr(x, "fp32_precision") for x in leaves) else []


def _legacy() -> tuple | None:
    """The legacy settings (matmul precision, cuDNN's allow_tf32), or None where torch refuses to
    read them (torch >= 2.9 after a mix of legacy and per-backend settings)."""
    try:
        return torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    except RuntimeError:
        return None


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """float32 matrix products and convolutions at float32's own unit roundoff (2^-24) inside (CUDA
    and cuDNN without TF32, oneDNN on the CPU without bfloat16 passes); the caller's settings
    restored after, whatever happens inside.

    Through the legacy setters where torch can read them, so that code inside (a model, a loss,
    ``torch.backends.cudnn.flags``) can still read them: per-backend settings ("ieee") make torch
    >= 2.9 refuse legacy reads. A per-backend leaf still reduced after that (inherited from a global
    "tf32"/"bf16", or the legacy settings unreadable to begin with) is set to "ieee" itself."""
    legacy, leaves = _legacy(), _precision_leaves()
    saved = [x.fp32_precision for x in leaves]
    try:
        if legacy is not None:
            torch.set_float32_matmul_precision("highest")
            torch.backends.cudnn.allow_tf32 = False
        for x in leaves:
            if x.fp32_precision not in ("ieee", "none"):
                x.fp32_precision = "ieee"
        yield
    finally:
        for x, v in zip(leaves, saved):
            if x.fp32_precision != v:
                x.fp32_precision = v
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy[0])
            torch.backends.cudnn.allow_tf32 = legacy[1]


NORM_BLOCK = 256
"""Squared norms are summed in float32 over blocks of this many entries, then in float64."""


def unit_roundoff(t: Tensor) -> float:
    """The unit roundoff of ``t``'s dtype: 2^-53 for float64, 2^-24 for float32 (products computed
    inside ``full_float32`` run at float32's own precision)."""
    return 2.0 ** -53 if t.dtype == torch.float64 else 2.0 ** -24


def gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: a sum of n products computed in any order (blocked,
    pairwise, FMA) is within ``gamma_n`` times the sum of the products' magnitudes."""
    if n * u >= 0.5:
        raise ConfigError(f"--grad-path fast: a sum of {n} products at unit roundoff {u:g} has no useful "
                          f"rounding bound; use --grad-path rows")
    return n * u / (1 - n * u)


def sq_norms(t: Tensor) -> Tensor:
    """Upper bounds, in float64, on the squared L2 norms of ``t``'s rows (dim 0; every other dim
    reduced): what clip factors are computed from.

    Why not ``torch.linalg.vector_norm``: in float32 it underestimates long rows systematically on
    the CPU (its accumulation error grows with the row's length: -2.6e-5 relative at 10^6 entries,
    -6e-4 at 10^7, -2.6e-3 at 3 x 10^7), and an underestimated norm makes the clip factor too large:
    the example contributes more than C. Here each block of ``NORM_BLOCK`` entries is summed in
    float32 (relative error below ``gamma_{NORM_BLOCK + 1}`` in any summation order, the square root
    adding u / 2), the blocks' squares in float64 (exact products, error ``gamma64_{d / NORM_BLOCK}``),
    and the result is enlarged by ``1 + 2 gamma_{NORM_BLOCK + 2} + 2 gamma64_{blocks + 1}`` (3.1e-5 in
    float32, 6e-14 in float64 for rows up to 2^16 blocks) plus ``d 2^-126`` for squares that
    underflow (flushed to zero on some hardware). The bound is what the rounding allows in the worst
    case; the cost is a clip smaller by a few parts in 10^5."""
    b = t.shape[0]
    f = t.reshape(b, math.prod(t.shape[1:]))  # (b, -1) is ambiguous for b = 0
    if not f.is_floating_point() or f.element_size() < 4:
        f = f.float()
    d = f.shape[1]
    u, tiny = unit_roundoff(f), (2.0 ** -1022 if f.dtype == torch.float64 else 2.0 ** -126)
    main = d - d % NORM_BLOCK
    sq = torch.zeros(b, dtype=torch.float64, device=f.device)
    if main:
        sq += torch.linalg.vector_norm(f[:, :main].reshape(b, main // NORM_BLOCK, NORM_BLOCK), dim=2).double() \
            .square().sum(1)
    if d > main:
        sq += torch.linalg.vector_norm(f[:, main:], dim=1).double().square()
    blocks = -(-d // NORM_BLOCK)  # the float64 sum of the blocks' squares adds gamma64_{blocks + 1}
    return sq * (1 + 2 * gamma(NORM_BLOCK + 2, u) + 2 * gamma(blocks + 1, 2.0 ** -53)) + d * tiny


def row_norms(t: Tensor) -> Tensor:
    """``sqrt(sq_norms(t))``: upper bounds on the L2 norms of ``t``'s rows, float64."""
    return sq_norms(t).sqrt()


def last_norms(g: Tensor, keepdim: bool = False) -> Tensor:
    """``row_norms`` along the last axis of ``g [..., d]`` (float64, shape ``g.shape[:-1]``)."""
    d = g.shape[-1] if g.dim() else 1
    lead = g.shape[:-1]
    n = row_norms(g.reshape(-1, d)) if d else torch.zeros(lead.numel(), dtype=torch.float64, device=g.device)
    n = n.reshape(lead)
    return n.unsqueeze(-1) if keepdim else n
