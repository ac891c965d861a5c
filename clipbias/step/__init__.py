"""The stages of one DP step, in the order the data flows through them:

    per-example rows [b, d] --PerSample stages--> rows --sum / B--> aggregate [d]
        --ErrorFeedback--> v [d] --GaussianNoise--> v + w [d] --post stage--> base torch optimizer

``stage`` (the stage types: Stage, Carried, PerSample, StepContext); ``clip`` (Clip, Normalize and
their per-row factors); ``feedback`` (ErrorFeedback); ``noise`` (GaussianNoise, BLTNoise);
``pipeline`` (Pipeline, the whole update rule, and Chain, post stages in sequence).

Stateful stages never mutate their state while a step is computed: they stage the new value and
``commit()`` applies it once the whole step succeeded, ``rollback()`` drops it when a later
micro-batch failed (a NaN gradient, a bad shape), so a failed step leaves everything as it was, in
the spirit of optax's ``(update, new_state)``. ``PerSample.probe`` is the pure version of a stage
(diagnostics measure what a stage would produce without staging anything).
"""

from __future__ import annotations

from .clip import (TINY_CLIP, Clip, Normalize, clip_rows, clip_scale, normalize_rows, normalize_scale, safe_factor,
                   scale_rows)
from .feedback import ErrorFeedback
from .noise import BLTNoise, GaussianNoise
from .pipeline import Chain, Pipeline
from .stage import Carried, PerSample, Stage, StepContext, scales_by_norm

__all__ = ["BLTNoise", "Carried", "Chain", "Clip", "ErrorFeedback", "GaussianNoise", "Normalize", "PerSample",
           "Pipeline", "Stage", "StepContext", "TINY_CLIP", "clip_rows", "clip_scale", "normalize_rows",
           "normalize_scale", "safe_factor", "scale_rows", "scales_by_norm"]
