"""The adversary's statistics against banded noise (``clipbias.algorithms.bands``).

The optimizer receives ``g = v + C^{-1} std Z``; ``y = C g`` (``releases``) recovers the releases
``y_t = sum_{k < b} c_k v_{t-k} + std Z_t``, whose noise is independent across steps (post-processing:
the adversary can always compute it). A contribution ``a`` of a canary at step j reaches
``y_j .. y_{j+b-1}`` with weights ``c_0 .. c_{b-1}`` (fewer at the end of training), so its sufficient
statistic is the block projection ``w_j = sum_k c_k y_{j+k}`` (``block_projections``), of variance
``n_j std^2`` with ``n_j = sum_{k: j+k < T} c_k^2`` (1 for a whole block). The blocks of one class
``j = l mod b`` are disjoint: given the class, the w_j are independent.

* ``matched_sum``: the linear test for a persistent shift with signs s: ``(C s)^T y / (std ||C s||)``,
  exactly N(0, 1) for a noise-only run (the generalisation of the summed projection);
* ``class_llr``: per class l, the log-likelihood ratio of the canary's blocks,
  ``sum_{j = l mod b} log(1 - p + p exp((a_j w_j - a_j^2 n_j / 2) / std^2))`` at the step's rate p = b q
  (the subsampled Gaussian of the accounting, one block per participation);
* ``mixture_llr``: the canary's class unknown (the sampler's secret draw, uniform): the log of the
  class-averaged likelihood ratio, the Neyman-Pearson statistic of D vs D' = D + canary.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def _as_2d(x: Tensor) -> Tensor:
    x = torch.as_tensor(x, dtype=torch.float64)
    return x.unsqueeze(1) if x.dim() == 1 else x


def releases(g: Tensor, coefs) -> Tensor:
    """``y = C g`` (T x m, float64): ``y_t = sum_{k < b, k <= t} c_k g_{t-k}``, the releases from the
    updates the optimizer received."""
    g = _as_2d(g)
    y = torch.zeros_like(g)
    for k, c in enumerate(coefs):
        if k < len(g):
            y[k:] += c * g[:len(g) - k]
    return y


def block_projections(y: Tensor, coefs) -> tuple[Tensor, Tensor]:
    """(w, n): ``w_j = sum_{k: j+k < T} c_k y_{j+k}`` (T x m) and ``n_j = sum_{k: j+k < T} c_k^2`` (T)."""
    y = _as_2d(y)
    T = len(y)
    w, n = torch.zeros_like(y), torch.zeros(T, dtype=torch.float64)
    for k, c in enumerate(coefs):
        if k < T:
            w[:T - k] += c * y[k:]
            n[:T - k] += c * c
    return w, n


def matched_sum(y: Tensor, signs, coefs, std: float) -> Tensor:
    """``(C s)^T y / (std ||C s||)`` per column of y: N(0, 1) under y = std Z."""
    s = torch.as_tensor(np.asarray(signs, dtype=np.float64))
    cs = releases(s, coefs)[:, 0]
    return (cs.unsqueeze(1) * _as_2d(y)).sum(0) / (std * float(cs.norm()))


def _block_llr(w: Tensor, n: Tensor, a: Tensor, std: float, rate: float) -> Tensor:
    z = (a * w - a * a * n / 2) / std ** 2
    base = torch.full_like(z, math.log1p(-rate) if rate < 1 else -math.inf)
    return torch.logaddexp(base, z + math.log(rate))


def class_llr(y: Tensor, contribution, coefs, std: float, rate: float, bands: int) -> Tensor:
    """(b x m) the log-likelihood ratio of the canary's participation blocks for each class l: its
    contribution ``contribution[j]`` (a scalar, a T vector or T x m) at each step j = l mod b it may
    join (probability ``rate``)."""
    w, n = block_projections(y, coefs)
    a = torch.as_tensor(contribution, dtype=torch.float64)
    a = a.reshape(-1, 1) if a.dim() == 1 else a
    llr = _block_llr(w, n.unsqueeze(1), a, std, rate)  # T x m
    out = torch.zeros(bands, llr.shape[1], dtype=torch.float64)
    for cls in range(bands):
        out[cls] = llr[cls::bands].sum(0)
    return out


def mixture_llr(per_class: Tensor) -> Tensor:
    """The log of the class-averaged likelihood ratio (the class uniform and unknown)."""
    return torch.logsumexp(per_class, 0) - math.log(len(per_class))


def null_moments(T: int, coefs, std: float, contribution: float, rate: float, bands: int,
                 cls: int | None = None) -> tuple[float, float]:
    """Mean and standard deviation of a class's ``class_llr`` under y = std Z (Gauss-Hermite per block,
    the blocks independent), for the contribution of constant magnitude ``contribution``: of class
    ``cls``, or averaged over the classes (means) and their variances (``cls`` None). A fixed scale
    that puts the statistics on the audit's threshold grid; it does not change which test is run."""
    x, wts = np.polynomial.hermite_e.hermegauss(80)
    wts = wts / wts.sum()
    _, n = block_projections(torch.zeros(T, 1), coefs)
    means, varis = np.zeros(bands), np.zeros(bands)
    for j in range(T):
        nj = float(n[j])
        # w_j ~ N(0, n_j std^2)
        llr = _block_llr(torch.from_numpy(x * std * math.sqrt(nj)), torch.tensor(nj), torch.tensor(contribution),
                         std, rate).numpy()
        m = float(wts @ llr)
        means[j % bands] += m
        varis[j % bands] += float(wts @ (llr - m) ** 2)
    if cls is not None:
        return float(means[cls]), float(math.sqrt(varis[cls]))
    return float(means.mean()), float(math.sqrt(varis.mean()))
