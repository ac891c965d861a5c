"""Composable stages of a DP update, each with explicit, checkpointable state.

The stages run in one direction:

    per-example rows [b, d] --PerSample stages--> rows --sum / B--> aggregate [d]
        --ErrorFeedback--> v [d] --GaussianNoise--> v + w [d] --post stage--> base torch optimizer

Stateful stages never mutate their state while a step is computed: they stage the new value and
``commit()`` applies it once the whole step succeeded, ``rollback()`` drops it when a later
micro-batch failed (a NaN gradient, a bad shape), so a failed step leaves everything as it was, in
the spirit of optax's ``(update, new_state)``. ``PerSample.probe`` is the pure version of a stage
(diagnostics measure what a stage would produce without staging anything).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .errors import ConfigError
from .grads.precision import full_float32, last_norms
from .randomness import SecretKey, snapped_gaussian


@dataclass
class StepContext:
    """What a stage may look at besides the rows: the example indices of this (micro-)batch, the
    step, and the norms of the rows as the pipeline received them (``norms``, computed once by the
    engine's finiteness check; None when unknown)."""

    indices: Tensor | None = None
    step: int = 0
    norms: Tensor | None = None


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


class Stage:
    """Base of every stage: stateless by default. ``distributed_refusal`` says why a stage cannot
    run split over the ranks of a process group (None: it can; ``clipbias.distributed``)."""

    distributed_refusal: str | None = None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def commit(self) -> None:
        """Apply the state staged during the step (the step succeeded)."""

    def rollback(self) -> None:
        """Drop the state staged during the step (the step failed)."""


class Carried(Stage):
    """A stage that carries one tensor from step to step (the attribute and ``state_dict`` key
    ``KEY``): a step stages the next value in ``_pending``, which becomes the state only on ``commit``
    (a failed step leaves it as it was). Error feedback, outer momentum and DiSK's filter."""

    KEY = "state"

    def __init__(self) -> None:
        setattr(self, self.KEY, None)
        self._pending: Tensor | None = None

    def commit(self) -> None:
        if self._pending is not None:
            setattr(self, self.KEY, self._pending)
            self._pending = None

    def rollback(self) -> None:
        self._pending = None

    def state_dict(self) -> dict:
        v = getattr(self, self.KEY)
        return {self.KEY: None if v is None else v.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        setattr(self, self.KEY, state[self.KEY])
        self._pending = None


class PerSample(Stage):
    """Maps per-example rows ``[b, d] -> [b, d]``.

    ``bound`` is the guaranteed upper bound on every output row's norm (the per-example
    sensitivity) when this stage enforces one, else None.
    """

    bound: float | None = None

    def __call__(self, g: Tensor, ctx: StepContext) -> Tensor:  # pragma: no cover - every stage overrides it
        return g

    def probe(self, g: Tensor, ctx: StepContext) -> Tensor:
        """What the stage outputs for probe rows, staging nothing (default: a stateless stage's call)."""
        return self(g, ctx)

    def scale(self, norms: Tensor) -> Tensor | None:
        """Per-row factors when the stage only rescales rows by a function of their norm (clip,
        normalise), else None. Then the pipeline sums ``scale @ rows`` in one pass, with no [b, d]
        temporary."""
        return None


def scales_by_norm(stage: PerSample) -> bool:
    """Whether the stage only rescales each row by a function of its norm (it overrides ``scale``):
    decided without calling it (a stage may count what ``scale`` sees: adaptive clipping)."""
    return type(stage).scale is not PerSample.scale


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


class ErrorFeedback(Carried):
    """DiceSGD's clipped error feedback (Zhang et al. Alg. 2, lines 5 and 7).

    ``v = aggregate + clip(e, C2)`` and ``e <- e + reference_mean - v`` where ``reference_mean`` is
    ``(1/B) sum_i g_i`` (the unclipped gradients, after the optional outer clip). With
    ``normalize=gamma`` the feedback is ``e / (||e|| + gamma)`` (automatic DiceSGD, Alg. 4).
    ``e`` is a hidden state: it is in ``state_dict`` (checkpoints are private) but never released.
    """

    KEY = "e"
    e: Tensor | None

    def __init__(self, c2: float | None = None, normalize: float | None = None) -> None:
        if (c2 is None) == (normalize is None):
            raise ConfigError("ErrorFeedback needs exactly one of c2 (clip) or normalize (gamma)")
        if c2 is not None and not c2 > 0:
            raise ConfigError(f"`AlgoConfig.ef_clip` must be > 0, got {c2!r}")
        self.c2, self.gamma = c2, normalize
        super().__init__()

    @property
    def bound(self) -> float:
        """Norm bound of the feedback term (C2, or 1 when normalised)."""
        return float(self.c2) if self.c2 is not None else 1.0

    def feedback(self, e: Tensor) -> Tensor:
        if self.c2 is not None:
            return clip_rows(e, self.c2)
        return normalize_rows(e, self.gamma)  # e is finite here (__call__)

    def __call__(self, aggregate: Tensor, reference_mean: Tensor) -> Tensor:
        # .to: a checkpoint saved on the CPU may be resumed on CUDA (no-op when already there)
        e = self.e.to(aggregate.device) if self.e is not None else torch.zeros_like(aggregate)
        # the unclipped sum can overflow while every example's gradient is finite (three examples of norm
        # 1.7e38 in float32); clip(inf) is NaN, and a NaN release would tell whether they were sampled. The
        # sound bound allows the buffer to be anything, so a non-finite one restarts from zero: the feedback
        # term stays within its bound (docs/privacy.md, the DiceSGD proof, step 2). No host sync.
        e = torch.where(torch.isfinite(e).all(), e, torch.zeros_like(e))
        v = aggregate + self.feedback(e)
        self._pending = e + reference_mean - v
        return v


class GaussianNoise(Stage):
    """Adds ``N(0, std^2 I)`` and rounds once onto a grid (``clipbias.randomness.snapped_gaussian``).

    Draw ``t`` (the t-th committed call) is a pure function of the secret key and t; its state is
    the draw counter. The output has the input's dtype (a deterministic rounding of the released
    float64 grid value: post-processing)."""

    def __init__(self, std: float, key: SecretKey) -> None:
        if not std >= 0:
            raise ConfigError(f"noise std must be >= 0, got {std!r}")
        if not isinstance(key, SecretKey):
            raise ConfigError(f"GaussianNoise needs a clipbias.randomness.SecretKey, got {type(key).__name__}")
        self.std, self.key = float(std), key
        self.draws, self._pending = 0, None

    def __call__(self, v: Tensor) -> Tensor:
        if self.std == 0:
            return v
        self._pending = self.draws + 1
        return snapped_gaussian(v, self.std, self.key, self.draws, dtype=v.dtype)

    def commit(self) -> None:
        if self._pending is not None:
            self.draws, self._pending = self._pending, None

    def rollback(self) -> None:
        self._pending = None

    def state_dict(self) -> dict:
        return {"draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.draws, self._pending = int(state["draws"]), None


@dataclass
class Pipeline:
    """The whole private update rule.

    ``reference``: per-example stages applied before the rows are recorded as the gradients
    error feedback tracks (e.g. an outer clip G_max). ``per_sample``: the stages after it (perturb,
    clip/normalise, ...). ``divisor``: what the summed rows are divided by: B = qN, the expected
    batch size (never the realised one), or the number of groups for p-averaging. ``post``: a stage
    after the noise (post-processing of the released update, e.g. outer momentum).
    """

    per_sample: list[PerSample]
    divisor: float
    reference: list[PerSample] = field(default_factory=list)
    error_feedback: ErrorFeedback | None = None
    noise: GaussianNoise | None = None
    post: Stage | None = None
    noise_per_bound: float | None = None  # with a moving bound (adaptive clipping): noise std / bound

    def named_stages(self) -> list[tuple[str, Stage]]:
        """Every stage with its ``state_dict`` key, in the order of the data flow."""
        named = [(f"reference.{i}", s) for i, s in enumerate(self.reference)]
        named += [(f"per_sample.{i}", s) for i, s in enumerate(self.per_sample)]
        named += [(k, s) for k, s in (("error_feedback", self.error_feedback), ("noise", self.noise),
                                      ("post", self.post)) if s is not None]
        return named

    @property
    def sensitivity(self) -> float | None:
        """Per-example L2 bound of the aggregated sum: the bound of the *last* per-sample stage.

        ``None`` (the pipeline is refused) when the last stage bounds nothing: an unbounded stage
        after a Clip would void the Clip's bound.
        """
        return self.per_sample[-1].bound if self.per_sample else None

    def rows(self, g: Tensor, ctx: StepContext) -> tuple[Tensor | None, Tensor]:
        """Per-example rows -> (reference rows summed, processed rows summed). The reference sum is
        only read by error feedback: None (not computed) without it."""
        known = ctx.norms  # the norms of g as received, while no stage has changed it
        for s in self.reference:
            g, known = s(g, ctx), None
        ref = g.sum(-2) if self.error_feedback is not None else None
        for s in self.per_sample[:-1]:
            g, known = s(g, ctx), None
        last = self.per_sample[-1] if self.per_sample else None
        if last is not None:
            norms = known if known is not None else last_norms(g)
            factors = last.scale(norms)
            if factors is None:
                g = last(g, ctx)
            else:  # clip/normalise and sum in one pass: sum_i s_i g_i
                if known is None and not bool(torch.isfinite(norms).all()):
                    # a row an earlier stage overflowed (a perturbation; the received rows were checked
                    # finite): zero, not 0 * inf = NaN in the product
                    g = g.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
                with full_float32():  # TF32 would round the rows before their factors (grads/precision.py)
                    return ref, (factors.to(g.dtype).unsqueeze(-2) @ g).squeeze(-2)
        return ref, g.sum(-2)

    def finish(self, processed_sum: Tensor, reference_sum: Tensor | None) -> Tensor:
        """Sums over the logical batch -> the (noisy) update handed to the base optimizer."""
        v = processed_sum / self.divisor
        if self.error_feedback is not None:
            v = self.error_feedback(v, reference_sum / self.divisor)
        last = self.per_sample[-1] if self.per_sample else None
        if getattr(last, "dynamic", False):  # adaptive clipping: its own release, and the noise at this step's bound
            last.release(v.device)
            if self.noise is not None and self.noise_per_bound is not None:
                self.noise.std = self.noise_per_bound * last.bound
        if self.noise is not None:
            v = self.noise(v)
        return self.post(v) if self.post is not None else v

    def commit(self) -> None:
        for _, s in self.named_stages():
            s.commit()

    def rollback(self) -> None:
        for _, s in self.named_stages():
            s.rollback()

    def state_dict(self) -> dict:
        return {k: s.state_dict() for k, s in self.named_stages()}

    def load_state_dict(self, state: dict) -> None:
        for k, s in self.named_stages():
            s.load_state_dict(state[k])


class Chain(Stage):
    """Post stages in sequence (each sees the previous one's output), with one checkpointable state."""

    def __init__(self, *stages: Stage) -> None:
        self.stages = tuple(stages)
        refusals = [s.distributed_refusal for s in self.stages if s.distributed_refusal]
        self.distributed_refusal = refusals[0] if refusals else None

    def __call__(self, v: Tensor) -> Tensor:
        for s in self.stages:
            v = s(v)
        return v

    def commit(self) -> None:
        for s in self.stages:
            s.commit()

    def rollback(self) -> None:
        for s in self.stages:
            s.rollback()

    def state_dict(self) -> dict:
        return {str(i): s.state_dict() for i, s in enumerate(self.stages)}

    def load_state_dict(self, state: dict) -> None:
        for i, s in enumerate(self.stages):
            s.load_state_dict(state[str(i)])
