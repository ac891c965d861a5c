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

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from ..engine.core import run_steps
from ..grads.rows import FuncGradients, LossFn, ParamLayout, cross_entropy
from ..randomness import PROBE_STEP
from ..step import StepContext
from .instruments import (DEFAULT_PS, DEFAULT_WINDOWS, PRIVACY_WARNING, NoiseTracker, clipping_bias, cosine,
                          cosine_histogram, cosines_to, instruments, noise_lag_correlation, norm_stats,
                          p_averaged_clipped, p_averaged_cosines, sampling_noise, sampling_noise_report,
                          sampling_noise_stats, strip_arrays, window_noise_norms)
from .symmetry import asymmetry, projection_symmetry, random_projections, symmetry_null, symmetry_score

__all__ = ["DEFAULT_PS", "DEFAULT_WINDOWS", "PRIVACY_WARNING", "NoiseTracker", "Recorder", "asymmetry", "clipped_quantity",
           "clipping_bias", "cosine", "cosine_histogram", "cosines_to", "full_gradient", "instruments",
           "noise_lag_correlation", "norm_stats", "p_averaged_clipped", "p_averaged_cosines", "projection_symmetry",
           "random_projections", "record_training", "sampling_noise", "sampling_noise_report", "sampling_noise_stats",
           "strip_arrays", "symmetry_null", "symmetry_score", "window_noise_norms"]

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
