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
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

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
        raise ConfigError(f"`grad_path='fast'`: a sum of {n} products at unit roundoff {u:g} has no useful "
                          f"rounding bound; use `grad_path='rows'`")
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


# ---------------------------------------------------------------------------- mixed precision (autocast)

HALF = (torch.bfloat16, torch.float16)
"""The 16-bit float types a forward and backward may run in (``DPEngine(autocast=...)``)."""

FLOAT16_LOSS_SCALE = 2.0 ** 8
"""The default loss scale under float16 autocast: output gradients below float16's smallest subnormal
(2^-24) would flush to zero without it; per-example output gradients above 65504 / 256 = 256 overflow
with it (the step then stops on a non-finite gradient: lower ``loss_scale``)."""


@dataclass(frozen=True)
class Mixed:
    """A private step's forward and backward under ``torch.autocast(device_type, dtype)``, the summed
    loss multiplied by ``loss_scale`` (a power of two) before the backward and the gradients divided
    by it after, exactly."""

    device_type: str
    dtype: torch.dtype
    loss_scale: float = 1.0


_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16}


def check_autocast(autocast: "torch.dtype | str | None", loss_scale: float | None) -> tuple | None:
    """``(dtype, loss scale)`` for ``DPEngine(autocast=..., loss_scale=...)``, or None without autocast.
    ``autocast``: ``torch.bfloat16`` / ``torch.float16`` (or their names); ``loss_scale``: a power of two
    (dividing by it is exact), default 1 under bfloat16 (float32's range) and ``FLOAT16_LOSS_SCALE`` under
    float16."""
    if autocast is None or autocast is False:
        if loss_scale is not None:
            raise ConfigError(f"loss_scale={loss_scale!r} applies to an autocast step: give autocast=torch.float16 "
                              f"(or torch.bfloat16) too")
        return None
    dtype = _DTYPES.get(autocast.lower()) if isinstance(autocast, str) else autocast
    if dtype not in HALF:
        raise ConfigError(f"autocast must be torch.bfloat16 or torch.float16 (the dtype the forward and backward "
                          f"run in; parameters, norms and sums stay float32), got {autocast!r}")
    if loss_scale is None:
        loss_scale = FLOAT16_LOSS_SCALE if dtype == torch.float16 else 1.0
    ok = isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and math.isfinite(loss_scale) \
        and loss_scale > 0 and math.frexp(loss_scale)[0] == 0.5 and 2.0 ** -64 <= loss_scale <= 2.0 ** 64
    if not ok:
        raise ConfigError(f"loss_scale must be a power of two between 2^-64 and 2^64 (the gradients are divided "
                          f"by it, exactly), got {loss_scale!r}")
    return dtype, float(loss_scale)


_local = threading.local()


@contextlib.contextmanager
def mixed(spec: Mixed | None) -> Iterator[None]:
    """The scope of one private step's gradient computations: inside it ``forward_autocast()`` enters
    ``spec``'s autocast around each model forward and ``loss_scale()`` is its scale. Autocast itself is
    not entered here: the clip factors and the sums across examples, computed in the same scope
    outside the forwards, stay in float32."""
    before = getattr(_local, "spec", None)
    _local.spec = spec
    try:
        yield
    finally:
        _local.spec = before


def active_mixed() -> Mixed | None:
    return getattr(_local, "spec", None)


class _NormsInFloat32(TorchFunctionMode):
    """Layer and instance norms of a 16-bit input computed in float32 (CUDA's autocast runs layer norm
    in float32 everywhere). The CPU's autocast leaves them in bfloat16, and their backward under
    ``torch.func.vmap`` (the rows path) fails on the mixed bfloat16 input and float32 weight (torch 2.13)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _WIDENED_NORMS and args and isinstance(args[0], Tensor) and args[0].dtype in HALF:
            args = (args[0].float(), *args[1:])
        return func(*args, **(kwargs or {}))


_WIDENED_NORMS = (torch.nn.functional.layer_norm, torch.layer_norm, torch.nn.functional.instance_norm,
                  torch.instance_norm)


@contextlib.contextmanager
def forward_autocast(norms32: bool = False) -> Iterator[None]:
    """``torch.autocast`` for a model forward inside ``mixed(spec)`` (nothing outside it); ``norms32``:
    with layer and instance norms in float32 (``_NormsInFloat32``: the rows path, under ``vmap``). The fast path
    enters no function mode: one would void ``grads.separable``'s proof that the model is per-example."""
    spec = active_mixed()
    if spec is None:
        yield
        return
    with torch.autocast(spec.device_type, dtype=spec.dtype), \
            (_NormsInFloat32() if norms32 else contextlib.nullcontext()):
        yield


def loss_scale() -> float:
    """The loss scale of the enclosing ``mixed`` scope (1 outside one)."""
    spec = active_mixed()
    return 1.0 if spec is None else spec.loss_scale


def exact32(t: Tensor, scale: float = 1.0) -> Tensor:
    """A bfloat16 / float16 tensor widened to float32 (exact: both are subsets of float32) and divided
    by ``scale`` (a power of two: exact but where the quotient falls below float32's normal range); any
    other tensor as it is (divided by ``scale`` where it is not 1)."""
    if t.dtype in HALF:
        t = t.float()
    return t if scale == 1.0 or not t.is_floating_point() else t / scale


# ---------------------------------------------------------------------------- float32 clipped sums

SUM_PRECISIONS = ("float64", "float32")
"""``sum_precision``: how the fast path computes the clipped sums of its ghost-norm layers. "float64" (the
default): one float64 product over the (example, position) pairs, rounded once. "float32": every example's
weight gradient formed in float32 (a batched product, a block of examples at a time) and the examples' pieces
summed in float32, at the price of a sensitivity ``C (1 + SUM32_DELTA)`` that the noise is scaled to
(``float32_sum_route``; the proof: docs/privacy.md, "Float32 clipped sums")."""

SUM32_DELTA = 2.0 ** -10
"""The sensitivity inflation a run with ``sum_precision="float32"`` accounts for: every example's released
contribution has norm at most ``C (1 + SUM32_DELTA)`` (9.8e-4; its noise std is ``z C (1 + SUM32_DELTA)``).
A ghost layer whose shapes would need more (``sum32_rho``) keeps its float64 sum in that micro-batch."""

SUM32_ETA = 2.0 ** -30
"""The share of ``SUM32_DELTA`` left to underflow (absolute rounding errors below float32's normal range):
an example's factor is capped at ``SUM32_ETA C / A`` (``A``: ``sum32_abs`` over the float32 layers), a cap
that binds only for a clip below ~1e-23 or a gradient norm below ~1e-23 under normalisation."""

_TINY32 = 2.0 ** -126
_U32, _U64 = 2.0 ** -24, 2.0 ** -53


def ghost_coef(L: int, k: int, o: int, u: float) -> float:
    """The ghost norm's rounding coefficient ``gamma_k + gamma_o + gamma_k gamma_o + 2 gamma64_{L^2+1}``
    (``layers.linear.ghost_norm_bound`` adds ``2 coef U_i^2`` to its bound), ``u`` the Grams' unit roundoff."""
    gk, go = gamma(k, u), gamma(o, u)
    return gk + go + gk * go + 2 * gamma(L * L + 1, _U64)


def sum32_rho(L: int, k: int, o: int) -> float:
    """The relative rounding of a ghost layer's float32 per-example gradients, against the clip: forming
    ``G_i = sum_l y_l x_l^T`` (L positions, any order, FMA or not) errs by at most ``gamma_L U_i`` in Frobenius
    norm (``U_i = sum_l |x_l||y_l|``), and the layer's ghost bound is at least ``2 coef U_i^2``, so the error is
    at most ``gamma_L / sqrt(2 coef)`` times the example's bound norm; ``2^-63`` more for subnormal inputs read
    as zero (covered by the bound's ``2^-126`` term). Infinite where ``gamma_L`` has no bound."""
    if L * _U32 >= 0.5:
        return math.inf
    return gamma(L, _U32) / math.sqrt(2 * ghost_coef(L, k, o, _U32)) + 2.0 ** -63


def sum32_abs(L: int, k: int, o: int) -> float:
    """The absolute rounding of one example's float32 gradient of a ghost layer from results below float32's
    normal range (flushed to zero, or subnormal): at most ``2^-126`` per product and per addition, ``2 L`` of
    them per entry, grown by ``1 + gamma_L``, over ``o k`` entries (Frobenius norm)."""
    return 2 * L * (1 + gamma(L, _U32)) * _TINY32 * math.sqrt(o * k)


def sum32_delta(rho: float, eta: float = SUM32_ETA) -> float:
    """The inflation ``delta`` with ``||contribution|| <= C (1 + delta)`` for a step whose float32 layers have
    relative rounding at most ``rho`` (``sum32_rho``) and absolute rounding at most ``eta C`` (the factor
    cap): the exact contribution ``<= C``, plus ``rho C``, plus ``eta C``, all times ``1 + 2^-24 + 2^-50`` for
    the rounding of the factor itself (its float64 division, then its float32 cast)."""
    return (1 + _U32 + 2.0 ** -50) * (1 + rho + eta) - 1


SUM32_RHO_MAX = (1 + SUM32_DELTA) / (1 + _U32 + 2.0 ** -50) - 1 - SUM32_ETA
"""The largest ``sum32_rho`` of a layer on the float32 route: ``sum32_delta(SUM32_RHO_MAX) = SUM32_DELTA``
(up to the float64 rounding of this expression, 1e-19)."""


def sum32_residual(m: int, block: int = 8) -> float:
    """How far, relative to ``C (1 + delta)``, the float32 route's sum across a micro-batch of ``m`` examples can
    move beyond example i's own piece: each of ``D``'s and ``D'``'s releases is within ``gamma_c`` (a float32 sum
    of at most ``c = min(m, block)`` pieces, ``layers.linear.SUM32_BLOCK_EXAMPLES``), ``gamma64_m`` (the blocks
    added in float64) and ``u`` (rounded once to float32) of the sum of at most m pieces' norms, so at most
    ``2 m (gamma_c + gamma64_m + u)``: 1.1e-5 at m = 8, 5.5e-4 at m = 512 (the float64 route: ``2 m u``)."""
    return 2 * m * (gamma(min(m, block), _U32) + gamma(m, _U64) + _U32)


def check_sum_precision(p: str) -> str:
    """``p`` if it is one of ``SUM_PRECISIONS``, else a ConfigError."""
    if p not in SUM_PRECISIONS:
        raise ConfigError(f"sum_precision must be one of {', '.join(SUM_PRECISIONS)}, got {p!r}")
    return p
