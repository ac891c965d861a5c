"""The white-box one-run audit through a real ``DPEngine``, for every algorithm, hidden state included.

One training run of the algorithm itself (its own row source: per-example or inner momentum, error
feedback, perturbation, adaptive clipping) on a model that is one parameter vector ``w`` of dimension
m, ``f(w, x) = <w, x>``, and a data set of canaries only: canary j is ``x_j = norm * e_j``, included
with probability 1/2, and its loss at step t is ``s_t f(w, x_j)``, so its gradient is the Dirac
vector ``s_t norm e_j`` at every iterate (a crafted gradient: the sign ``s_t`` follows the schedule,
``canary.gradient_signs``). The adversary sees every released noisy update ``u_t`` (before the
post-processing of outer momentum, which it can undo) and the current clip and noise std (functions of
earlier releases), and scores canary j by the statistic of ``canary._Statistic`` on coordinate j:
the summed projection ``sum_t s_t u_t[j] / sigma_t`` or the per-step likelihood ratio with the canary's
contribution ``c_t = s_t C_t / divisor``. Both one-run bounds (``estimators``) follow.

The audit is valid for any mechanism (an audit only ever uses released values); the coordinates are
independent runs only where nothing couples them (the clipped feedback buffer and the moving clip do).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from .. import algorithms, privacy
from ..config import AlgoConfig
from ..errors import ConfigError
from ..sampling.poisson import band_rate
from ..step import BLTNoise
from .canary import CanaryAudit, banded_statistic, gradient_signs, step_llr
from .estimators import one_run_estimate


class Coordinates(nn.Module):
    """``f(w, x) = <w, x>``: one parameter per canary, initialised at 0."""

    def __init__(self, m: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(m))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w


class _Tap:
    """Wraps ``pipeline.finish`` to record each step's released noisy update (before ``post``), the
    noise std and the per-example bound of that step."""

    def __init__(self, pipeline) -> None:
        self.pipe, self.finish = pipeline, pipeline.finish
        self.updates: list[Tensor] = []
        self.stds: list[float] = []
        self.bounds: list[float] = []
        pipeline.finish = self

    def __call__(self, processed_sum: Tensor, reference_sum: Tensor | None) -> Tensor:
        post, self.pipe.post = self.pipe.post, None
        try:
            v = self.finish(processed_sum, reference_sum)
        finally:
            self.pipe.post = post
        self.updates.append(v.detach().double().cpu().clone())
        self.stds.append(float(self.pipe.noise.std))
        self.bounds.append(float(self.pipe.sensitivity))
        return post(v) if post is not None else v


def white_box_one_run(audit: CanaryAudit, canaries: int = 1000) -> dict:
    """Train once with ``canaries`` Dirac canaries through the algorithm's own engine; both bounds."""
    from ..engine.core import DPEngine, run_steps

    algo = algorithms.get(audit.algo)
    if not algo.private:
        raise ConfigError(f"`algo='{audit.algo}'` is not private (epsilon = inf): there is no claim to audit")
    if algo.needs_public or audit.anti_norm is not None:
        raise ConfigError(f"`algo='{audit.algo}'`: the white-box one-run audit drives a linear model with Dirac "
                          f"canaries only (no public features, no anti-canary); use the canary audit or --mode one-run")
    if not (isinstance(canaries, int) and canaries >= 20):
        raise ConfigError(f"`canaries` must be an integer >= 20, got {canaries!r}")
    gen = torch.Generator().manual_seed(audit.seed + (1 << 42))
    inside = torch.rand(canaries, generator=gen) < 0.5
    ids = inside.nonzero().flatten()
    if not 0 < len(ids) < canaries:
        raise ConfigError(f"all {canaries} canaries fell on one side; use more canaries")
    x = torch.zeros(len(ids), canaries)
    x[torch.arange(len(ids)), ids] = float(audit.norm)
    signs = gradient_signs(audit)
    step = [0]
    model = Coordinates(canaries)
    # the updates are recorded before outer momentum; with bands the coefficients are shaped for band_momentum
    cfg = AlgoConfig(**{**audit.algo_config().__dict__, "momentum": audit.band_momentum if audit.bands > 1 else 0.0})
    batch = audit.sample_rate * len(ids)  # Poisson rate q over the included canaries (B = q x their number)
    engine = DPEngine(model, audit.algo, n=len(ids), batch_size=batch, steps=audit.steps,
                      noise_multiplier=audit.noise_multiplier, delta=audit.delta, config=cfg,
                      loss_fn=lambda out, y: signs[step[0]] * out.sum(), noise_seed=audit.seed, grad_path="rows",
                      bands=audit.bands, bands_strategy=audit.strategy)
    tap = _Tap(engine.pipeline)

    def after(e, losses) -> None:
        step[0] += 1

    run_steps(engine, x, torch.zeros(len(ids), dtype=torch.long), after=after)
    scores = _scores(audit, tap, signs, engine.pipeline)
    kw = dict(delta=audit.delta, significance=1 - audit.confidence)
    plain = one_run_estimate(scores[inside.numpy()], scores[~inside.numpy()], method="one-run", **kw)
    fdp = one_run_estimate(scores[inside.numpy()], scores[~inside.numpy()], method="one-run-fdp", **kw)
    spec = algo.spec(engine.config, engine.sample_rate, audit.claim_noise_multiplier or audit.noise_multiplier,
                     engine.expected_batch_size, audit.bands, engine.noise_shape)
    rep = privacy.account(spec, audit.steps, audit.delta, "pld", audit.basis)
    return {"epsilon_lower_bound": plain["epsilon_lower_bound"], "epsilon_lower_bound_fdp": fdp["epsilon_lower_bound"],
            "epsilon_claimed": rep.epsilon, "certified": rep.certified, "basis": rep.basis,
            "refuted": plain["epsilon_lower_bound"] > rep.epsilon, "confidence": audit.confidence,
            "method": "one-run, white-box engine (Dirac canaries on their own coordinates, every update seen)",
            "canaries": canaries, "included": len(ids), "delta": audit.delta, "guesses": plain["guesses"],
            "correct": plain["correct"], "bands": audit.bands, "bands_strategy": audit.bands_strategy,
            "guesses_fdp": fdp["guesses"], "correct_fdp": fdp["correct"],
            "score_gap": float(scores[inside.numpy()].mean() - scores[~inside.numpy()].mean()),
            "settings": {k: v for k, v in audit.__dict__.items() if k not in ("extra", "trials")}}


def _scores(audit: CanaryAudit, tap: _Tap, signs: np.ndarray, pipeline) -> np.ndarray:
    """Each coordinate's statistic over the recorded releases (with banded noise: over the releases
    y = C u recovered from the updates, ``canary.banded_statistic``, the canaries' classes unknown)."""
    u = torch.stack(tap.updates)  # T x m
    if audit.bands > 1:
        if len(set(tap.stds)) != 1 or len(set(tap.bounds)) != 1:
            raise ConfigError(f"`bands={audit.bands}`: the white-box audit scores a fixed noise std and bound")
        if isinstance(pipeline.noise, BLTNoise):
            from .blt import blt_statistic
            return blt_statistic(u, signs, pipeline.noise.blt, tap.stds[0], tap.bounds[0] / pipeline.divisor).numpy()
        return banded_statistic(audit.statistic, u, signs, pipeline.noise.coefs, tap.stds[0],
                                tap.bounds[0] / pipeline.divisor, band_rate(audit.bands, audit.sample_rate)).numpy()
    sigma = torch.tensor(tap.stds, dtype=torch.float64).unsqueeze(1)
    s = torch.from_numpy(signs).unsqueeze(1)
    if audit.statistic == "sum":
        return ((s * u / sigma).sum(0) / math.sqrt(len(u))).numpy()
    c = s * torch.tensor(tap.bounds, dtype=torch.float64).unsqueeze(1) / pipeline.divisor
    return step_llr(u, c, sigma, audit.sample_rate).sum(0).numpy()
