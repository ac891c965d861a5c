"""Error feedback: DiceSGD's clipped (or normalised) feedback of what clipping removed (``ErrorFeedback``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from .clip import clip_rows, normalize_rows
from .stage import Carried


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
