"""Central symmetry of per-example gradients (Chen et al. Figs. 1-2): random 2-D Gaussian projections
and the energy-distance symmetry score with its sign-flip null (the definition is in the docstring
of ``clipbias.analysis.diagnostics``). NOT private: reads raw per-example gradients."""

from __future__ import annotations

import math

import torch
from torch import Tensor

def _check_rows(g: Tensor) -> Tensor:
    if g.dim() != 2 or g.shape[0] < 1:
        raise ValueError(f"expected per-example gradients of shape [n, d] with n >= 1, got {tuple(g.shape)}")
    return g.double()



def random_projections(g: Tensor, k: int = 8, generator: torch.Generator | None = None,
                       center: bool = False) -> Tensor:
    """``[k, n, 2]``: the rows of ``g`` projected by k random Gaussian matrices ``P_j`` (``[d, 2]``,
    i.i.d. N(0, 1/d) entries) as in Chen et al. Section 4. ``center`` subtracts the mean first.

    A centrally symmetric distribution stays symmetric under every linear projection.
    """
    g = _check_rows(g)
    if center:
        g = g - g.mean(0)
    d = g.shape[1]
    gen = generator or torch.Generator().manual_seed(0)
    out = torch.empty(k, g.shape[0], 2, dtype=torch.float64)
    for j in range(k):  # one [d, 2] matrix at a time: memory O(d), not O(k d)
        p = torch.randn(d, 2, generator=gen, dtype=torch.float64) / math.sqrt(d)
        out[j] = g @ p
    return out


def _centered_gram(y: Tensor) -> Tensor:
    y = y - y.mean(0)
    return y @ y.T


def _asymmetry_from_gram(gc: Tensor) -> float:
    """Asymmetry from the Gram matrix of *centred* points (n x n work, any dimension)."""
    sq = gc.diagonal()
    base = sq[:, None] + sq[None, :]
    s_plus = float((base + 2 * gc).clamp_min(0).sqrt().mean())
    s_minus = float((base - 2 * gc).clamp_min(0).sqrt().mean())
    if s_plus <= 1e-300:
        return 0.0  # all points equal: trivially symmetric
    return math.sqrt(min(1.0, max(0.0, (s_plus - s_minus) / s_plus)))


def _asymmetry_direct(y: Tensor) -> float:
    y = y - y.mean(0)
    mode = "donot_use_mm_for_euclid_dist"  # exact differences: a symmetric set scores 1 to ~1e-8
    s_plus = float(torch.cdist(y, -y, compute_mode=mode).mean())
    s_minus = float(torch.cdist(y, y, compute_mode=mode).mean())
    if s_plus <= 1e-300:
        return 0.0
    return math.sqrt(min(1.0, max(0.0, (s_plus - s_minus) / s_plus)))


def asymmetry(points: Tensor) -> float:
    """``sqrt((S+ - S-) / S+)`` in [0, 1]: 0 iff the point set is centrally symmetric about its mean
    (normalised energy distance between the points and their reflection; see the module docstring).

    Low dimension (<= 64, e.g. the 2-D projections): exact pairwise differences. Higher dimension:
    through the n x n Gram matrix (O(n^2 d) once), whose cancellation limits the precision of the
    score to about 1e-5.
    """
    y = _check_rows(points.reshape(points.shape[0], -1))
    if y.shape[1] <= 64:
        return _asymmetry_direct(y)
    return _asymmetry_from_gram(_centered_gram(y))


def symmetry_score(points: Tensor) -> float:
    """``1 - asymmetry(points)``: 1 for a centrally symmetric point set (see the module docstring)."""
    return 1.0 - asymmetry(points)


def symmetry_null(points: Tensor, draws: int = 5, generator: torch.Generator | None = None) -> float:
    """Mean symmetry score of the centred points with i.i.d. random signs: what a sample of the
    same size from an exactly symmetric distribution (same radial profile) scores."""
    y = _check_rows(points.reshape(points.shape[0], -1))
    return _null_from_gram(_centered_gram(y), draws, generator)


def _null_from_gram(gc: Tensor, draws: int, generator: torch.Generator | None) -> float:
    gen = generator or torch.Generator().manual_seed(0)
    n = gc.shape[0]
    h = torch.eye(n, dtype=gc.dtype) - 1.0 / n  # re-centring after the sign flip
    scores = []
    for _ in range(draws):
        s = torch.randint(0, 2, (n,), generator=gen).to(gc.dtype) * 2 - 1
        g2 = h @ (s[:, None] * gc * s[None, :]) @ h
        scores.append(1.0 - _asymmetry_from_gram(g2))
    return sum(scores) / len(scores)


def projection_symmetry(g: Tensor, k: int = 8, generator: torch.Generator | None = None,
                        full_dim: bool = True) -> dict:
    """k random 2-D projections of the per-example gradients with their symmetry scores.

    Returns ``projections`` ([k, n, 2], uncentred, for plotting), per-projection ``scores``, their
    mean, ``null`` (the sign-flip reference, averaged over the projections) and, if ``full_dim``,
    the score of the unprojected d-dimensional point set.
    """
    gen = generator or torch.Generator().manual_seed(0)
    proj = random_projections(g, k, gen)
    scores = [symmetry_score(p) for p in proj]
    nulls = [symmetry_null(p, 3, gen) for p in proj]
    out = {"projections": proj, "scores": scores, "mean_score": sum(scores) / k,
           "min_score": min(scores), "null": sum(nulls) / k}
    if full_dim:
        gc = _centered_gram(_check_rows(g))
        out["full_dim_score"] = 1.0 - _asymmetry_from_gram(gc)
        out["full_dim_null"] = _null_from_gram(gc, 3, gen)
    return out
