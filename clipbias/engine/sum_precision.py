"""``DPEngine(sum_precision=...)``: the precision of the fast path's ghost-layer clipped sums.

"float64" (the default) changes nothing. "float32" sets the fast path's ``BookKeeping.sum_precision`` (the chosen
path's and ``grad_path="auto"``'s other one) and scales the noise to the inflated sensitivity
``C (1 + SUM32_DELTA)``: the noise stage's std (and, under a moving bound, its std per bound) times
``1 + SUM32_DELTA``, so that the noise multiplier the accountant reads stays the std over the sensitivity and
every epsilon the engine reports holds as stated (docs/privacy.md, "Float32 clipped sums"). On the rows path
the setting only adds that noise (the rows are summed as always)."""

from __future__ import annotations

import dataclasses

from ..grads.fast import BookKeeping
from ..grads.precision import SUM32_DELTA, check_sum_precision


def apply_sum_precision(engine, sum_precision: str) -> float:
    """Apply ``sum_precision`` to ``engine`` (after its pipeline and aggregates are built); the inflation of
    the sensitivity it accounts for (0 in float64, ``SUM32_DELTA`` in float32), kept as ``engine.sum_delta``."""
    check_sum_precision(sum_precision)
    engine.sum_precision, engine.sum_delta = sum_precision, 0.0
    if sum_precision == "float64":
        return 0.0
    for path in engine.path.paths():  # the chosen path and auto's other one (grads.path.FallBack)
        fast: BookKeeping | None = path.book_keeping()  # (DiSK's two points through the fast path: its BookKeeping)
        if fast is not None:
            fast.sum_precision = sum_precision
    noise = getattr(engine.pipeline, "noise", None)
    if noise is not None and engine.algo.private:
        noise.std *= 1 + SUM32_DELTA
        if getattr(noise, "per_bound", None) is not None:
            noise.per_bound *= 1 + SUM32_DELTA
    engine.sum_delta = SUM32_DELTA
    engine.plan = engine.plan.with_path(dataclasses.replace(engine.plan.path, sum_precision=sum_precision))
    return SUM32_DELTA
