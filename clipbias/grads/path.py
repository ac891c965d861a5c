"""The gradient-path protocol: how a step's batch becomes its clipped sums.

A ``GradPath`` turns one logical batch (``StepBatch``) into ``(reference sum or None, processed sum, losses)`` per
physical micro-batch (``sums``: the one method the engine calls), and answers the few questions the engine asks
of it: which kind it is (``kind``, as ``PathChoice`` names it), whether it evaluates DiSK's two points, the
book-keeping state it runs (checked and configured by the engine: ``book_keeping``), the per-example gradient
function whose ``vmap`` refusal the engine switches (``func_grads``), what keeps the step's forward output
(``output_source``), and, for ``grad_path="auto"``, whether and how it falls back to another path.

Implementations: the rows through the pipeline (``grads.rows.RowsPath``), the rows summed per parameter
(``grads.rows.ParamSums``), the book-keeping fast path (``grads.fast.BookKeeping``), DiSK's two points through
either of the last two (``grads.two_point.TwoPoint``), and ``FallBack`` below: ``grad_path="auto"``'s chosen
path with the other one it takes, once, when the chosen one refuses the model at the first step."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

Sums = tuple["Tensor | None", Tensor, Tensor]  # (reference sum or None, processed sum, per-example losses)


@dataclass
class StepBatch:
    """What a path reads of the engine's step: the batch ``(x, y)`` and its example ids, the step's index, the
    physical micro-batch size, the row source, the pipeline (its per-example stage's ``scale``; its ``rows``
    for the rows path), the list the batch's outputs are appended to (None: not kept), and ``via``: a
    replacement of the path's own micro-batch call (a fully_shard model's ``engine.sharded.ShardedSums``)."""

    x: Any
    y: Any
    indices: Tensor | None
    step: int
    max_physical_batch: int
    rows: Any
    pipeline: Any
    outputs: list | None = None
    via: Callable | None = None


class GradPath(abc.ABC):
    """A gradient path (module doc). ``sums`` is abstract; every query has the answer of a plain path."""

    kind: str
    """``"fast"`` (book-keeping), ``"sums"`` (rows summed per parameter) or ``"rows"`` (rows through the pipeline)."""
    two_point = False
    """Whether the path evaluates DiSK's two points (``grads.two_point``)."""

    @abc.abstractmethod
    def sums(self, step: StepBatch) -> Iterator[Sums]:
        """The step's (reference sum or None, processed sum, per-example losses), micro-batch by micro-batch, the
        finiteness of every example's gradient checked on its norm."""

    def book_keeping(self):
        """The fast path's ``BookKeeping`` this path runs (its state the engine checks and configures), or None."""
        return None

    def func_grads(self, rows):
        """The per-example gradient function this path runs (``FuncGradients``: the engine sets what it does with
        a model ``vmap`` refuses), looked up on the step's row source ``rows`` unless the path holds its own."""
        return getattr(rows, "grads", None)

    def output_source(self):
        """What computes the step's forward where it can keep its output (``keep_output``, ``last_out``), or None."""
        return None

    def paths(self) -> tuple[GradPath, ...]:
        """This path and every path it may switch to (a fall-back's other)."""
        return (self,)

    @property
    def may_fall_back(self) -> bool:
        """Whether a ``PathRefusal`` of this path is answered by another path (``fall_back``)."""
        return False

    def fall_back(self, refused: str):
        """Take the other path where this one, ``"fast"`` or ``"rows"`` as ``PathRefusal.path`` names it, refused
        the model: the other's ``PathChoice``, or None where there is none (then the refusal stands)."""
        return None

    def settled(self) -> GradPath:
        """The path the run keeps once a step ran the model (a fall-back's current path; else itself)."""
        return self


def refusal_name(path: GradPath) -> str:
    """``"fast"`` or ``"rows"``: the name a ``PathRefusal`` of ``path`` carries."""
    return "fast" if path.book_keeping() is not None else "rows"


class FallBack(GradPath):
    """``grad_path="auto"``'s path: the ``current`` one, and ``other`` (a ``(GradPath, PathChoice)``) taken once if
    ``current`` refuses the model before a step ran it (``fall_back``); ``other_of(path)`` is the new current
    path's own other, or None. Every query is the current path's."""

    def __init__(self, current: GradPath, other: tuple, other_of: Callable[[GradPath], tuple | None]) -> None:
        self.current, self.other, self.other_of = current, other, other_of

    kind = property(lambda self: self.current.kind)
    two_point = property(lambda self: self.current.two_point)

    def sums(self, step: StepBatch) -> Iterator[Sums]:
        return self.current.sums(step)

    def book_keeping(self):
        return self.current.book_keeping()

    def func_grads(self, rows):
        return self.current.func_grads(rows)

    def output_source(self):
        return self.current.output_source()

    def paths(self) -> tuple[GradPath, ...]:
        return self.current.paths() + (self.other[0].paths() if self.other is not None else ())

    @property
    def may_fall_back(self) -> bool:
        return self.other is not None

    def fall_back(self, refused: str):
        if self.other is None or refused != refusal_name(self.current):
            return None
        self.current, choice = self.other
        self.other = self.other_of(self.current)
        return choice

    def settled(self) -> GradPath:
        return self.current
