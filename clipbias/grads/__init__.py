"""Per-example gradients, the second stage: rows of per-example gradients and the ``RowSource``
protocol the engine reads them through (``rows``: ``torch.func`` ``vmap(grad)``, the per-parameter
sums of a norm-scaling step), and the book-keeping fast path that never forms the rows (``fast``:
per-layer per-example norms, run-time soundness checks; ``layers``: each layer family's rule, registered
behind the ``LayerRule`` protocol)."""

from .fast import BookKeeping, why_unsupported
from .rows import (FuncGradients, LossFn, ParamLayout, ParamSums, PerExampleRows, PerSampleGradients, RowSource,
                   as_row_source, check_finite, check_finite_norms, check_model, cross_entropy)

__all__ = ["BookKeeping", "FuncGradients", "LossFn", "ParamLayout", "ParamSums", "PerExampleRows",
           "PerSampleGradients", "RowSource", "as_row_source", "check_finite", "check_finite_norms", "check_model",
           "cross_entropy", "why_unsupported"]
