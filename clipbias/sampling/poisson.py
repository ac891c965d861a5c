"""Poisson sampling: each example joins a batch independently with probability q.

This is the sampling the subsampled-Gaussian accountants assume. Batch sizes vary (and can be 0);
updates are normalised by the expected size B = qN, never the realised one. The inclusion draws are
secret: batch ``t`` is a pure function of the run's ``SecretKey`` and ``t``
(``clipbias.randomness.poisson_indices``: a 64-bit ChaCha20 uniform per example, compared with q
rounded to 2^-64).
"""

from __future__ import annotations

from torch import Tensor

from ..errors import ConfigError
from ..randomness import Purpose, SecretKey, poisson_indices


class PoissonSampler:
    """Yields index tensors of Poisson batches; ``len(self)`` = steps per epoch = round(1/q).

    A loader that prefetches (``clipbias.sampling.loader``: DataLoader workers fetch the next batches while
    the current step runs) draws batches ahead with ``draw_ahead``; ``sample`` then returns them in
    the same order, so the batches are the same with or without lookahead. Batches drawn ahead and
    not yet sampled are part of ``state_dict``: a resumed run continues with exactly them.
    """

    def __init__(self, n: int, sample_rate: float, key: SecretKey, steps: int | None = None) -> None:
        if n < 1:
            raise ConfigError(f"dataset size must be >= 1, got {n}")
        if not 0 < sample_rate <= 1:
            raise ConfigError(f"sample rate must lie in (0, 1], got {sample_rate!r}")
        self.n, self.q = n, float(sample_rate)
        self.steps = steps if steps is not None else max(1, round(1 / self.q))
        if not isinstance(key, SecretKey):
            raise ConfigError(f"PoissonSampler needs a clipbias.randomness.SecretKey, got {type(key).__name__}")
        self.key, self.drawn = key, 0  # batches drawn so far: the address of the next one
        self._ahead: list[Tensor] = []  # drawn by draw_ahead, not yet returned by sample
        self.handed = 0                # how many of them the current loader was given (read-only outside)

    @property
    def expected_batch_size(self) -> float:
        return self.q * self.n

    def sample(self) -> Tensor:
        """The next batch (the oldest one drawn ahead, if any): the indices i with U_i < q."""
        if self._ahead:
            self.handed = max(0, self.handed - 1)
            return self._ahead.pop(0)
        return self._draw()

    def draw_ahead(self) -> Tensor:
        """The batch that ``sample`` returns after every batch handed out before it: drawn now (or
        the next one drawn earlier and not yet handed out since ``restart_ahead``)."""
        if self.handed == len(self._ahead):
            self._ahead.append(self._draw())
        self.handed += 1
        return self._ahead[self.handed - 1]

    def restart_ahead(self) -> None:
        """A new loader starts: batches drawn ahead and not yet sampled are handed out again first."""
        self.handed = 0

    def _draw(self) -> Tensor:
        idx = poisson_indices(self.key, Purpose.SAMPLE, self.drawn, self.n, self.q)
        self.drawn += 1
        return idx

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.sample()

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "n": self.n, "q": self.q, "ahead": [t.clone() for t in self._ahead]}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n or state["q"] != self.q:
            raise ConfigError(f"sampler state is for n={state['n']}, q={state['q']}; this sampler has "
                              f"n={self.n}, q={self.q}")
        if "drawn" not in state:
            raise ConfigError("this sampler state comes from a clipbias version whose batches were drawn by a "
                              "torch generator with a 32-bit seed (recoverable from the released model); it "
                              "cannot be resumed: start a new run")
        self.drawn = int(state["drawn"])
        self._ahead, self.handed = [t.clone() for t in state.get("ahead", [])], 0
