"""Rows at two points of one step: ``c r(x_t + gamma d_t) + (1 - c) r(x_t)`` of a base row source ``r``
(``d_t = x_t - x_{t-1}``, the released iterates). DiSK (``clipbias.algorithms.kalman_filter``) takes its rows this way;
the engine's aggregates see only this row source type (``TwoPoint``, the gradient path of its rows), never the method.

Each row is a function of one example and of the released iterates: the base's sensitivity holds."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn

from ..randomness import SecretKey
from .path import GradPath, StepBatch, Sums
from .rows import RowSource, micro_batch_sums


class TwoPointRows(RowSource):
    """The rows ``c r(x_t + gamma d_t) + (1 - c) r(x_t)`` of a base source ``r`` (its rows at both points
    of the same step: the same examples, keyed draws and groups), ``d_t = x_t - x_{t-1}``.

    The base's rows at the extrapolated point are computed with the model's parameters set there and
    restored bit for bit. The iterate the step started from is staged and kept by ``commit`` (state:
    ``prev``, in ``state_dict``). Where ``c`` is 0 (or at the first step) only ``x_t`` is evaluated; where
    ``c`` is 1 only the extrapolated point, unless the base stages state of its own (then both, so that
    its state follows ``x_t``)."""

    def __init__(self, rows: RowSource, params: list[nn.Parameter], gamma: float, c: float) -> None:
        self.base, self.params, self.gamma, self.c = rows, list(params), float(gamma), float(c)
        self.layout = rows.layout
        self.structured = rows.structured
        self.distributed_refusal = rows.distributed_refusal
        self.prev: list[Tensor] | None = None
        self._pending: list[Tensor] | None = None

    @property
    def key(self) -> SecretKey | None:  # the base's keyed draws (the engine sets and restores it)
        return self.base.key

    @key.setter
    def key(self, key: SecretKey | None) -> None:
        self.base.key = key

    def owners(self, indices: Tensor, step: int, world: int) -> Tensor:
        return self.base.owners(indices, step, world)

    def ahead(self, now: list[Tensor]) -> list[Tensor] | None:
        """``x_t + gamma (x_t - x_{t-1})``, or None where it is not needed (first step, c = 0)."""
        if self.prev is None or self.c == 0.0:
            return None
        return [n + self.gamma * (n - p.to(n.device)) for n, p in zip(now, self.prev)]

    @contextmanager
    def at(self, point: list[Tensor]):
        """The model's parameters set to ``point`` inside the block, restored exactly after it: each parameter's
        data is swapped for a copy of its point and swapped back, so the parameters end as the same tensors
        with the same storage and version counters (the engine's state guard, ``clipbias.engine.guard``,
        sees no write of the engine's own) and nothing written to them inside the block survives it."""
        saved = [p.data for p in self.params]
        with torch.no_grad():
            for p, v in zip(self.params, point):
                p.data = v.detach().to(p.dtype).clone()
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, saved):
                    p.data = v

    def begin(self) -> list[Tensor] | None:
        """Stage the iterate this step starts from; the extrapolated point (None: evaluate x_t only)."""
        now = [p.detach().clone() for p in self.params]
        self._pending = now
        return self.ahead(now)

    def iter_rows(self, x, y, indices: Tensor | None, step: int, max_physical_batch: int) -> Iterator:
        point = self.begin()
        if point is None:
            yield from self.base.iter_rows(x, y, indices, step, max_physical_batch)
            return
        there = self.base.iter_rows(x, y, indices, step, max_physical_batch)
        stateful = type(self.base).commit is not RowSource.commit
        here = self.base.iter_rows(x, y, indices, step, max_physical_batch) if self.c != 1.0 or stateful else None
        while True:
            with self.at(point):
                far = next(there, None)
            near = next(here, None) if here is not None else None
            if far is None:
                return
            if near is None:
                yield far
            else:
                yield far[0].mul_(self.c).add_(near[0], alpha=1.0 - self.c), near[1], near[2]  # in place: no [b, d] copy

    def probe(self, x, y, max_physical_batch: int = 512) -> Tensor:
        near = self.base.probe(x, y, max_physical_batch)
        point = self.ahead([p.detach().clone() for p in self.params])
        if point is None:
            return near
        with self.at(point):
            far = self.base.probe(x, y, max_physical_batch)
        return self.c * far + (1.0 - self.c) * near

    def commit(self) -> None:
        if self._pending is not None:
            self.prev, self._pending = self._pending, None
        self.base.commit()

    def rollback(self) -> None:
        self._pending = None
        self.base.rollback()

    def state_dict(self) -> dict:
        return {"prev": None if self.prev is None else [p.clone() for p in self.prev], "base": self.base.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        prev = state["prev"]
        self.prev = None if prev is None else [v.to(p.device) for v, p in zip(prev, self.params)]
        self._pending = None
        self.base.load_state_dict(state["base"])


class TwoPoint(GradPath):
    """Rows at two points ``c g(x_t + gamma d_t) + (1 - c) g(x_t)`` (``TwoPointRows``: DiSK's) through a
    norm-scaling path (``grads.rows.ParamSums`` or ``grads.fast.BookKeeping``: ``inner``), itself a
    ``grads.path.GradPath`` of its inner path's kind: it stages the step's iterate and gives the inner path the
    extrapolated point (None at the first step or c = 0: x_t alone). ``begin()`` once per step, before its
    micro-batches (also an empty step's: the iterate is staged all the same); ``sums`` begins the step."""

    two_point = True

    def __init__(self, inner: GradPath, rows: TwoPointRows) -> None:
        self.inner, self.rows, self.point = inner, rows, None

    kind = property(lambda self: self.inner.kind)

    def begin(self) -> None:
        self.point = self.rows.begin()

    def __call__(self, x, y, scale, reference: bool):
        if self.point is None:
            return self.inner(x, y, scale, reference)
        point = self.point
        return self.inner(x, y, scale, reference, at=(lambda: self.rows.at(point), self.rows.c))

    def sums(self, step: StepBatch) -> Iterator[Sums]:
        self.begin()  # a step-level preparation (the step's iterate is staged)
        yield from micro_batch_sums(self, step)

    def book_keeping(self):
        return self.inner.book_keeping()

    def func_grads(self, rows):
        return self.inner.func_grads(rows)
