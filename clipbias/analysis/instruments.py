"""The instruments of ``clipbias.analysis.diagnostics`` on a ``[n, d]`` tensor of per-example
gradients (pure functions; NOT private, see that module): norms, sampling noise, clipping bias,
cosines, noise correlation across iterations, p-averaging, and ``instruments`` (one recording of all
of them). The symmetry instruments are in ``symmetry``."""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

import torch
from torch import Tensor

from ..step import clip_rows
from .symmetry import _check_rows, projection_symmetry

PRIVACY_WARNING = ("NOT differentially private: these diagnostics read the raw per-example gradients "
                   "of the training data; their outputs leak information about individual examples. "
                   "For the developer's own analysis only (or run them on public data); never publish "
                   "them as part of a DP release.")

DEFAULT_PS = (1, 2, 4, 10)
DEFAULT_WINDOWS = (1, 2, 4, 8)


# ----------------------------------------------------------------------------- helpers

def cosine(u: Tensor, v: Tensor) -> float:
    """cos(u, v); 0 when either vector is zero (no direction)."""
    nu, nv = float(u.norm()), float(v.norm())
    if nu == 0 or nv == 0:
        return 0.0
    return float(torch.dot(u.double().flatten(), v.double().flatten()) / (nu * nv))


# ----------------------------------------------------------------------------- norms

def norm_stats(g: Tensor, clip: float, quantiles: Sequence[float] = (0.25, 0.5, 0.75)) -> dict:
    """Per-example norm quantiles, the fraction with ``||g_i|| > clip``, and ``||mean g||``."""
    g = _check_rows(g)
    norms = g.norm(dim=1)
    qs = torch.quantile(norms, torch.tensor(list(quantiles), dtype=norms.dtype))
    out = {f"q{round(q * 100)}": float(v) for q, v in zip(quantiles, qs)}
    out.update(mean_norm=float(norms.mean()), max_norm=float(norms.max()),
               fraction_clipped=float((norms > clip).double().mean()),
               mean_grad_norm=float(g.mean(0).norm()), n=int(g.shape[0]))
    return out


# ----------------------------------------------------------------------------- sampling noise

def sampling_noise(g: Tensor) -> float:
    """Xiao et al. Definition 2.5: ``E_i ||mean g - g_i||^2`` over the rows of ``g``."""
    g = _check_rows(g)
    return float(((g - g.mean(0)) ** 2).sum(1).mean())


def sampling_noise_report(rows: Tensor, clip: float | None = None) -> dict:
    """``tau2`` (Def. 2.5 with the probe mean as grad F), ``tau``, the mean's norm, ``relative`` =
    tau^2 / ||mean||^2, the mean row norm, and the fraction of rows longer than ``clip``: for the rows
    any method clips (``clipped_quantity``)."""
    rows = _check_rows(rows)
    tau2 = sampling_noise(rows)
    mn = float(rows.mean(0).norm())
    norms = rows.norm(dim=1)
    out = {"tau2": tau2, "tau": math.sqrt(tau2), "mean_norm": mn,
           "relative": tau2 / mn**2 if mn > 0 else math.inf, "mean_row_norm": float(norms.mean()),
           "rows": int(rows.shape[0])}
    if clip is not None:
        out["frac_clipped"] = float((norms > clip).double().mean())
    return out


def sampling_noise_stats(g: Tensor, clip: float) -> dict:
    """Sampling noise of the raw and of the clipped per-example gradients; ``tau = sqrt(noise)``."""
    before, after = sampling_noise(g), sampling_noise(clip_rows(_check_rows(g), clip))
    return {"before": before, "after": after, "tau_before": math.sqrt(before),
            "tau_after": math.sqrt(after)}


# ----------------------------------------------------------------------------- clipping bias

def clipping_bias(g: Tensor, clip: float, reference: Tensor | None = None) -> dict:
    """``b = mean_i clip(g_i, C) - mean_i g_i``.

    Returns the vector, its norm, its norm relative to ``||mean g||``, ``cos(b, true gradient)``
    and ``cos(mean clip(g_i), true gradient)``. The true gradient is ``reference`` when given (e.g.
    the full-batch gradient), else ``mean g``.
    """
    g = _check_rows(g)
    mean = g.mean(0)
    clipped_mean = clip_rows(g, clip).mean(0)
    b = clipped_mean - mean
    ref = mean if reference is None else reference.double().flatten()
    mn = float(mean.norm())
    return {"vector": b, "norm": float(b.norm()), "relative_norm": float(b.norm()) / mn if mn > 0 else math.inf,
            "cos_true": cosine(b, ref), "cos_clipped_true": cosine(clipped_mean, ref)}


# ----------------------------------------------------------------------------- cosines

def cosines_to(g: Tensor, reference: Tensor | None = None) -> Tensor:
    """``cos(g_i, reference)`` for every row (reference: the full-batch gradient; default mean g).

    Rows of norm zero get cosine 0.
    """
    g = _check_rows(g)
    ref = g.mean(0) if reference is None else reference.double().flatten()
    rn = ref.norm()
    if rn == 0:
        return torch.zeros(g.shape[0], dtype=torch.float64)
    norms = g.norm(dim=1)
    cos = (g @ ref) / (norms.clamp_min(1e-300) * rn)
    return torch.where(norms > 0, cos, torch.zeros_like(cos)).clamp(-1.0, 1.0)


def cosine_histogram(g: Tensor, reference: Tensor | None = None, bins: int = 40) -> dict:
    """Histogram of ``cos(g_i, full-batch gradient)`` on [-1, 1] (Chen et al. Fig. 3), with its
    mean, median, skewness and the fraction of negative cosines."""
    c = cosines_to(g, reference)
    counts = torch.histc(c, bins=bins, min=-1.0, max=1.0)
    edges = torch.linspace(-1.0, 1.0, bins + 1, dtype=torch.float64)
    sd = float(c.std(unbiased=False)) if c.numel() > 1 else 0.0
    skew = float(((c - c.mean()) ** 3).mean() / sd ** 3) if sd > 0 else 0.0
    return {"edges": edges.tolist(), "counts": [int(v) for v in counts.tolist()], "values": c,
            "mean": float(c.mean()), "median": float(c.median()), "skewness": skew,
            "fraction_negative": float((c < 0).double().mean())}


# ----------------------------------------------------------------------------- noise correlation

def window_noise_norms(xi: Tensor, windows: Sequence[int] = DEFAULT_WINDOWS) -> dict[int, float]:
    """Xiao et al. Fig. 5a: for each window K0, the mean over examples i and window starts k of
    ``|| (1/K0) sum_{l=k}^{k+K0-1} xi_l^(i) ||``; ``xi`` is ``[T, m, d]`` (iteration, example, dim).

    With independent noise of equal norm the value falls like ``1/sqrt(K0)``; with identical noise
    across iterations it stays flat. Windows longer than T are left out.
    """
    if xi.dim() != 3:
        raise ValueError(f"expected sampling noise of shape [T, m, d], got {tuple(xi.shape)}")
    xi = xi.double()
    out = {}
    csum = torch.cat([torch.zeros_like(xi[:1]), xi.cumsum(0)])
    for k0 in windows:
        if k0 < 1 or k0 > xi.shape[0]:
            continue
        means = (csum[k0:] - csum[:-k0]) / k0  # [T - K0 + 1, m, d]
        out[int(k0)] = float(means.norm(dim=2).mean())
    return out


def noise_lag_correlation(xi: Tensor, lag: int = 1) -> float:
    """Pooled correlation ``sum <xi_l, xi_{l+lag}> / sqrt(sum ||xi_l||^2 sum ||xi_{l+lag}||^2)`` over
    examples and iterations (``xi``: ``[T, m, d]``). For AR(1) noise ``xi_l = rho xi_{l-1} + ...`` it
    estimates rho**lag."""
    xi = xi.double()
    if xi.shape[0] <= lag:
        return math.nan
    a, b = xi[:-lag], xi[lag:]
    den = math.sqrt(float((a ** 2).sum()) * float((b ** 2).sum()))
    return float((a * b).sum()) / den if den > 0 else math.nan


class NoiseTracker:
    """Online version of :func:`window_noise_norms` and :func:`noise_lag_correlation` over a run.

    Feed ``observe(xi_l)`` (``[m, d]``, the sampling noise of m tracked examples at iteration l);
    memory is ``max(windows)`` iterations, not the whole run. ``result()`` equals the offline
    functions applied to the stacked sequence.
    """

    def __init__(self, windows: Sequence[int] = DEFAULT_WINDOWS) -> None:
        self.windows = sorted({int(w) for w in windows if int(w) >= 1})
        self.buf: deque[Tensor] = deque(maxlen=max(self.windows))
        self.sums = {k: 0.0 for k in self.windows}
        self.counts = {k: 0 for k in self.windows}
        self.cross = self.sq_first = self.sq_second = 0.0
        self.steps = 0

    def observe(self, xi: Tensor) -> None:
        xi = xi.double()
        if self.buf:
            prev = self.buf[-1]
            self.cross += float((prev * xi).sum())
            self.sq_first += float((prev ** 2).sum())
            self.sq_second += float((xi ** 2).sum())
        self.buf.append(xi)
        self.steps += 1
        recent = list(self.buf)
        for k in self.windows:
            if len(recent) >= k:
                mean = torch.stack(recent[-k:]).mean(0)
                self.sums[k] += float(mean.norm(dim=1).mean())
                self.counts[k] += 1

    def result(self) -> dict:
        norms = {k: self.sums[k] / self.counts[k] for k in self.windows if self.counts[k]}
        base = norms.get(1)
        den = math.sqrt(self.sq_first * self.sq_second)
        return {"iterations": self.steps, "windows": list(norms), "mean_norm": list(norms.values()),
                "ratio_to_k1": [v / base if base else math.nan for v in norms.values()],
                "independent_ratio": [1 / math.sqrt(k) for k in norms],
                "lag1_correlation": self.cross / den if den > 0 else math.nan}


# ----------------------------------------------------------------------------- p-averaging

def p_averaged_clipped(g: Tensor, clip: float, p: int, generator: torch.Generator | None = None) -> Tensor:
    """Randomly group the rows into groups of p (the remainder forms the last group, as in Xiao et
    al. footnote 5), clip each group mean at ``clip`` and average the clipped group means."""
    g = _check_rows(g)
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    gen = generator or torch.Generator().manual_seed(0)
    n = g.shape[0]
    perm = torch.randperm(n, generator=gen)
    gid = torch.arange(n) // p  # the last group holds the remainder
    groups = torch.zeros(int(gid[-1]) + 1, g.shape[1], dtype=g.dtype).index_add_(0, gid, g[perm])
    groups /= torch.bincount(gid).to(g.dtype).unsqueeze(1)
    return clip_rows(groups, clip).mean(0)


def p_averaged_cosines(g: Tensor, clip: float, ps: Sequence[int] = DEFAULT_PS,
                       reference: Tensor | None = None, generator: torch.Generator | None = None) -> dict[int, float]:
    """Xiao et al. Fig. 7: ``cos(full gradient, p-averaged clipped gradient)`` for each p
    (p = 1 is ordinary per-example clipping). Values of p above n are left out."""
    g = _check_rows(g)
    ref = g.mean(0) if reference is None else reference.double().flatten()
    gen = generator or torch.Generator().manual_seed(0)
    return {int(p): cosine(p_averaged_clipped(g, clip, int(p), gen), ref) for p in ps if 1 <= p <= g.shape[0]}


# ----------------------------------------------------------------------------- one recording

def instruments(g: Tensor, clip: float, reference: Tensor | None = None, *, projections: int = 8,
                ps: Sequence[int] = DEFAULT_PS, bins: int = 40, seed: int = 0) -> dict:
    """Every per-step instrument on one set of per-example gradients.

    Returns a JSON-able dict plus, under the key ``_arrays``, the tensors the figures need
    (cosines, projections); :func:`strip_arrays` removes them. The instruments run on the CPU in
    float64 whatever the device of ``g`` (their random projections and groupings come from CPU
    generators, so a run on CUDA records the same numbers as on the CPU, up to the gradients' rounding).
    """
    gen = torch.Generator().manual_seed(seed)
    g = g.detach().double().cpu()
    ref = None if reference is None else reference.detach().double().flatten().cpu()
    bias = clipping_bias(g, clip, ref)
    hist = cosine_histogram(g, ref, bins)
    sym = projection_symmetry(g, projections, gen)
    true_grad = g.double().mean(0) if ref is None else ref
    rec = {
        "norms": norm_stats(g, clip),
        "sampling_noise": sampling_noise_stats(g, clip),
        "clipping_bias": {k: v for k, v in bias.items() if k != "vector"},
        "cosine_histogram": {k: v for k, v in hist.items() if k != "values"},
        "symmetry": {k: v for k, v in sym.items() if k != "projections"},
        "p_averaging": {str(p): c for p, c in p_averaged_cosines(g, clip, ps, ref, gen).items()},
        # the same cosine without any clipping: what sampling alone allows (n rows vs the reference)
        "p_averaging_ceiling": cosine(g.double().mean(0), true_grad),
        "true_gradient_norm": float(true_grad.norm()),
        "reference": "full-batch gradient (given)" if ref is not None else "mean of the recorded rows",
        "_arrays": {"cosines": hist["values"], "projections": sym["projections"]},
    }
    return rec


def strip_arrays(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "_arrays"}
