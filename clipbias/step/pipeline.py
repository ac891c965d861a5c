"""The whole private update rule: ``Pipeline`` (per-example stages, sum / B, error feedback, noise, post
stage) and ``Chain`` (post stages in sequence)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..grads.precision import full_float32, last_norms
from .feedback import ErrorFeedback
from .noise import GaussianNoise
from .stage import PerSample, Stage, StepContext


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

    def draw_ahead(self, count: int, device: torch.device | str) -> None:
        """As a step begins: the noise's normals for an update of ``count`` coordinates on ``device`` start
        being drawn in the background (``GaussianNoise.draw_ahead``), while the step computes its sums."""
        if self.noise is not None:
            self.noise.draw_ahead(count, device)

    def finish(self, processed_sum: Tensor, reference_sum: Tensor | None) -> Tensor:
        """Sums over the logical batch -> the (noisy) update handed to the base optimizer."""
        v = processed_sum / self.divisor
        if self.error_feedback is not None:
            v = self.error_feedback(v, reference_sum / self.divisor)
        last = self.per_sample[-1] if self.per_sample else None
        if last is not None and last.dynamic:  # adaptive clipping: its own release, and the noise at this step's bound
            last.release(v.device)
            if self.noise is not None:
                self.noise.follow(last.bound)
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
