"""Seeing the clipping bias: instruments on per-example gradients, and a recording driver.

PRIVACY: every instrument here reads the *raw* per-example gradients of the training data.
Nothing in this module is differentially private; its outputs (numbers, histograms, projected
point clouds) leak information about individual examples. Use it for your own analysis, on
public data, or on data you are allowed to inspect; never publish its outputs as part of a DP
release. ``PRIVACY_WARNING`` is written into every output.

Instruments are pure functions of a ``[n, d]`` tensor ``g`` of per-example gradients (one row per
example, flattened in ``ParamLayout`` order, as ``clipbias.grads`` returns them):

* :func:`norm_stats` - quantiles of ``||g_i||``, fraction clipped, norm of the mean gradient
  (Xiao et al. Fig. 1a-c);
* :func:`sampling_noise` - ``E_i ||g_i - mean g||^2`` (Xiao et al. Definition 2.5), before and
  after clipping (:func:`sampling_noise_stats`);
* :func:`clipping_bias` - ``b = mean clip(g_i) - mean g_i``: norm, cosine with the true gradient;
* :func:`cosines_to`, :func:`cosine_histogram` - ``cos(g_i, full-batch gradient)`` (Chen et al. Fig. 3);
* :func:`random_projections`, :func:`symmetry_score`, :func:`projection_symmetry` - random 2-D
  Gaussian projections (Chen et al. Figs. 1-2) and a central-symmetry score (see below);
* :func:`window_noise_norms`, :func:`noise_lag_correlation` (and the online :class:`NoiseTracker`)
  - correlation of per-example sampling noise across iterations with a sliding window K0
  (Xiao et al. Fig. 5a);
* :func:`p_averaged_cosines` - cosine between the full gradient and the p-averaged clipped
  gradient (Xiao et al. Fig. 7).

Symmetry score. For points ``y_1..y_n`` (any dimension) centred at their mean, let
``S+ = mean_{i,j} ||y_i + y_j||`` and ``S- = mean_{i,j} ||y_i - y_j||`` (all pairs, i = j included).
``2 (S+ - S-)`` is the energy distance (Szekely & Rizzo) between the empirical distribution of the
``y_i`` and that of their reflections ``-y_i``: it is >= 0, and = 0 exactly when the point set is
centrally symmetric about its mean. ``R = (S+ - S-) / S+`` in [0, 1] is its normalised form (the
energy coefficient); the *asymmetry* is ``sqrt(R)`` and the *symmetry score* ``1 - sqrt(R)``: 1 for
a centrally symmetric set, lower for skewed ones. Reference values: the 1-D set {-2, 1, 1} scores
0.5; 300 draws from an exponential distribution (skewness 2) about 0.73; 300 Gaussian draws about
0.96 (a finite sample is never exactly symmetric). ``symmetry_null`` scores the same points with
random signs (an exactly symmetric distribution with the same radial profile and n): the value to
compare with. Linear maps preserve central symmetry, so a symmetric gradient distribution scores
like its null under every random projection.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from .engine import run_steps
from .grads import FuncGradients, LossFn, ParamLayout, cross_entropy
from .randomness import PROBE_STEP
from .transforms import StepContext, clip_rows

PRIVACY_WARNING = ("NOT differentially private: these diagnostics read the raw per-example gradients "
                   "of the training data; their outputs leak information about individual examples. "
                   "For the developer's own analysis only (or run them on public data); never publish "
                   "them as part of a DP release.")

DEFAULT_PS = (1, 2, 4, 10)
DEFAULT_WINDOWS = (1, 2, 4, 8)


# ----------------------------------------------------------------------------- helpers

def _check_rows(g: Tensor) -> Tensor:
    if g.dim() != 2 or g.shape[0] < 1:
        raise ValueError(f"expected per-example gradients of shape [n, d] with n >= 1, got {tuple(g.shape)}")
    return g.double()


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


@torch.no_grad()
def clipped_quantity(engine, x: Tensor, y: Tensor, indices: Tensor | None = None) -> Tensor:
    """The rows ``engine``'s algorithm would clip (or normalise) for the probe batch ``(x, y)``:
    per-example gradients, group means, augmented averages, inner momenta, BatchNorm group gradients,
    perturbed gradients (Xiao et al.: the clipping bias is driven by their sampling noise).

    Pure: no state of the engine changes. The row source's ``probe`` and each stage's ``probe``
    before the bounding one are applied (an outer clip G_max, the perturbation with probe
    randomness, the per-example momentum -- the latter needs the *training* indices of the probe
    examples, since the buffers belong to them).
    """
    rows = engine.rows.probe(x, y, engine.max_physical_batch)
    ctx = StepContext(indices, PROBE_STEP)
    for st in engine.pipeline.reference:
        rows = st.probe(rows, ctx)
    for st in engine.pipeline.per_sample:
        if st.bound is not None:
            break
        rows = st.probe(rows, ctx)
    return rows


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


# ----------------------------------------------------------------------------- symmetry

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


# ----------------------------------------------------------------------------- recording driver

def full_gradient(model: nn.Module, layout: ParamLayout, x: Tensor, y: Tensor,
                  loss_fn: LossFn = cross_entropy, chunk: int = 1024) -> Tensor:
    """``(1/N) sum_i grad loss_i`` over ``(x, y)`` by ordinary autograd (no per-example gradients);
    ``loss_fn`` must be a sum over the examples of a batch (as the default cross-entropy is)."""
    params = layout.params(model)
    total = [torch.zeros_like(p) for p in params]
    for s in range(0, len(x), chunk):
        loss = loss_fn(model(x[s:s + chunk]), y[s:s + chunk])
        grads = torch.autograd.grad(loss, params)
        for t, gr in zip(total, grads):
            t += gr
    return torch.cat([t.flatten() for t in total]).double() / len(x)


@dataclass
class Recorder:
    """Records the instruments at chosen steps of a training run.

    ``x_rec, y_rec``: the examples whose per-example gradients are recorded; ``x_ref, y_ref``: the
    examples of the "full-batch" reference gradient (ordinary autograd; None: the mean of the
    recorded rows); ``x_track, y_track``: examples whose sampling noise is tracked at *every* step
    for the window/correlation instrument, against the mean gradient on ``x_tref, y_tref`` (see
    :func:`record_training`). ``rows``: the per-example gradient function (default: ``vmap(grad)``
    of the model); BatchClipping passes its row source's ``probe`` (each example's gradient through
    the BatchNorm network run on its group), and the reference is then the mean of those rows.
    """

    model: nn.Module
    clip: float
    x_rec: Tensor
    y_rec: Tensor
    x_ref: Tensor | None = None
    y_ref: Tensor | None = None
    x_track: Tensor | None = None
    y_track: Tensor | None = None
    x_tref: Tensor | None = None
    y_tref: Tensor | None = None
    loss_fn: LossFn = cross_entropy
    projections: int = 8
    ps: Sequence[int] = DEFAULT_PS
    windows: Sequence[int] = DEFAULT_WINDOWS
    bins: int = 40
    seed: int = 0
    records: list = field(default_factory=list)
    rows: Callable[[Tensor, Tensor], Tensor] | None = None

    def __post_init__(self) -> None:
        self.grads = FuncGradients(self.model, self.loss_fn, check=self.rows is None)
        self.tracker = NoiseTracker(self.windows)

    def per_example(self, x: Tensor, y: Tensor, chunk: int = 256) -> Tensor:
        fn = self.rows or (lambda xs, ys: self.grads(xs, ys)[0])
        rows = [fn(x[s:s + chunk], y[s:s + chunk]) for s in range(0, len(x), chunk)]
        return torch.cat(rows).double()

    def reference(self) -> Tensor | None:
        if self.x_ref is None:
            return None
        if self.rows is not None:
            return self.per_example(self.x_ref, self.y_ref).mean(0)
        return full_gradient(self.model, self.grads.layout, self.x_ref, self.y_ref, self.loss_fn)

    def track_reference(self) -> Tensor:
        """The true-gradient estimate for the tracked sampling noise (mean over ``x_tref``; the
        tracked examples themselves when no ``x_tref`` is given)."""
        if self.x_tref is None or self.rows is not None:
            x, y = (self.x_track, self.y_track) if self.x_tref is None else (self.x_tref, self.y_tref)
            return self.per_example(x, y).mean(0)
        return full_gradient(self.model, self.grads.layout, self.x_tref, self.y_tref, self.loss_fn)

    def record(self, step: int, **extra) -> dict:
        g = self.per_example(self.x_rec, self.y_rec)
        rec = {"step": int(step), "clip": self.clip, **extra,
               **instruments(g, self.clip, self.reference(), projections=self.projections,
                             ps=self.ps, bins=self.bins, seed=self.seed)}
        self.records.append(rec)
        return rec


def record_training(engine, x: Tensor, y: Tensor, recorder: Recorder, steps_at: Sequence[int],
                    progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Run ``engine`` for its remaining Poisson steps on ``(x, y)``, recording at ``steps_at``
    (step s = after s updates, so 0 is the initial model and ``total_steps`` the final one).

    With tracked examples, their sampling noise ``xi_l^(i) = g_i(w_l) - grad F(w_l)`` is observed
    before every step (``grad F`` estimated on the fixed examples ``x_tref``; the full gradient
    when ``x_tref`` is the whole training set) and fed to ``recorder.tracker``.
    """
    steps_at = sorted({int(s) for s in steps_at if 0 <= int(s) <= engine.total_steps})
    losses: list[float] = []

    def record(t: int) -> None:
        if t in steps_at:
            recent = losses[-20:]
            recorder.record(t, train_loss_recent=sum(recent) / len(recent) if recent else None)

    def before(eng) -> None:
        record(eng.steps_taken)
        if recorder.x_track is not None:
            ref = recorder.track_reference()
            recorder.tracker.observe(recorder.per_example(recorder.x_track, recorder.y_track) - ref)

    def after(eng, batch_losses: Tensor) -> None:
        if len(batch_losses):
            losses.append(float(batch_losses.mean()))
        if progress is not None:
            progress(eng.steps_taken, eng.total_steps)

    run_steps(engine, x, y, before=before, after=after)
    record(engine.steps_taken)
    return recorder.records
