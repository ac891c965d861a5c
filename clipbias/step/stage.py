"""The stage types of a DP step: ``Stage`` (stateless by default, with ``commit``/``rollback``),
``Carried`` (one tensor carried from step to step), ``PerSample`` (rows ``[b, d] -> [b, d]``, with the
per-example bound it enforces) and ``StepContext`` (what a stage may look at besides the rows).

Stateful stages never mutate their state while a step is computed: they stage the new value and
``commit()`` applies it once the whole step succeeded, ``rollback()`` drops it when a later
micro-batch failed (a NaN gradient, a bad shape), so a failed step leaves everything as it was, in
the spirit of optax's ``(update, new_state)``. ``PerSample.probe`` is the pure version of a stage
(diagnostics measure what a stage would produce without staging anything).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class StepContext:
    """What a stage may look at besides the rows: the example indices of this (micro-)batch, the
    step, and the norms of the rows as the pipeline received them (``norms``, computed once by the
    engine's finiteness check; None when unknown)."""

    indices: Tensor | None = None
    step: int = 0
    norms: Tensor | None = None


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
    sensitivity) when this stage enforces one, else None. A ``dynamic`` stage's bound moves: its
    ``release(device)`` releases the next one, and the noise stage follows it.
    """

    bound: float | None = None
    dynamic = False  # the bound moves from step to step, released by ``release`` (adaptive clipping)

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
