"""Poisson sampling: each example joins a batch independently with probability q.

This is the sampling the subsampled-Gaussian accountants assume. Batch sizes vary (and can be 0);
updates are normalised by the expected size B = qN, never the realised one. The inclusion draws are
secret: batch ``t`` is a pure function of the run's ``SecretKey`` and ``t``
(``clipbias.randomness.poisson_indices``: a 64-bit ChaCha20 uniform per example, compared with q
rounded to 2^-64).

With ``bands = b > 1`` (cyclic Poisson participation, for banded correlated noise:
``clipbias.algorithms.bands``) every example draws once a class l_i in [0, b), i.i.d. and
independent of the data, and joins only the batches of steps t = l_i mod b, each with probability
b q: the expected batch stays qN, and any two participations of one example are at least b steps
apart.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from ..randomness import Purpose, SecretKey, band_labels, poisson_indices


class PoissonSampler:
    """Yields index tensors of Poisson batches; ``len(self)`` = steps per epoch = round(1/q).

    A loader that prefetches (``clipbias.sampling.loader``: DataLoader workers fetch the next batches while
    the current step runs) draws batches ahead with ``draw_ahead``; ``sample`` then returns them in
    the same order, so the batches are the same with or without lookahead. Batches drawn ahead and
    not yet sampled are part of ``state_dict``: a resumed run continues with exactly them.

    Args:
        n: The dataset size (>= 1).
        sample_rate: The probability q, in (0, 1], that an example joins a batch.
        key: The run's ``clipbias.randomness.SecretKey``: batch t is a pure function of it and t.
        steps: ``len(self)``, the steps of one iteration (default: an epoch, ``round(1 / q)``).
        bands: Cyclic Poisson participation in ``bands`` classes, for banded noise (default 1: plain
            Poisson sampling; see the module's docstring); ``bands * q`` must not exceed 1.

    Raises:
        ConfigError: ``n < 1``, ``sample_rate`` outside (0, 1], ``bands`` not a whole number >= 1 or
            ``bands * q > 1``, or ``key`` not a ``SecretKey``.
    """

    def __init__(self, n: int, sample_rate: float, key: SecretKey, steps: int | None = None, bands: int = 1) -> None:
        if n < 1:
            raise ConfigError(f"dataset size must be >= 1, got {n}")
        if not 0 < sample_rate <= 1:
            raise ConfigError(f"sample rate must lie in (0, 1], got {sample_rate!r}")
        check_bands(bands, sample_rate)
        self.n, self.q, self.bands = n, float(sample_rate), int(bands)
        self._labels: tuple[SecretKey, object] | None = None  # (key, classes) of the banded participation
        self.steps = steps if steps is not None else max(1, round(1 / self.q))
        if not isinstance(key, SecretKey):
            raise ConfigError(f"PoissonSampler needs a clipbias.randomness.SecretKey, got {type(key).__name__}")
        self.key, self.drawn = key, 0  # batches drawn so far: the address of the next one
        self.skipped = 0  # batches returned by sample() that no step used before the next sample()
        self.abandoned = False  # the last one's loader was closed before a step used it (``abandon``)
        self._last: Tensor | None = None  # what sample() returned last (give_back)
        self.fetched: tuple | None = None  # (indices, a copy of the batch a PoissonLoader fetched for them)
        self._ahead: list[Tensor] = []  # drawn by draw_ahead, not yet returned by sample
        self.handed = 0                # how many of them the current loader was given (read-only outside)

    @property
    def expected_batch_size(self) -> float:
        return self.q * self.n

    def sample(self) -> Tensor:
        """The next batch (the oldest one drawn ahead, if any). A batch returned before and used by no step
        is counted in ``skipped``: a loop that skips batches by their content (``if len(x) < 4: continue``)
        samples by another law than the accountant's.

        Returns:
            The indices i with U_i < q (a long tensor; possibly empty).
        """
        if self._last is not None:
            self.skipped += 1
        self.abandoned = False
        if self._ahead:
            self.handed = max(0, self.handed - 1)
            self._last = self._ahead.pop(0)
        else:
            self._last = self._draw()
        return self._last

    @property
    def last(self) -> Tensor | None:
        """The batch ``sample`` returned last, until a step has used it (``settle``) or it was given back."""
        return self._last

    @property
    def next_step(self) -> int:
        """The step whose batch ``sample`` returns next (batches are drawn for steps 0, 1, 2, ...)."""
        return self.drawn - len(self._ahead)

    def settle(self) -> None:
        """The batch ``sample`` returned last was released: ``give_back`` no longer applies to it."""
        self._last = self.fetched = None
        self.abandoned = False

    def abandon(self) -> None:
        """The loader that handed out the batch ``sample`` returned last was closed before a step used it (a
        ``break``, a peek with ``next(iter(loader))``, an error in the loop): it is not handed out again, and
        until a step uses it (the peeked batch stepped on) it counts as passed over (``passed_over``). Given
        back, the next loop would get it again, so a loop that stops on what it sees (an outlier) would stop
        again and again, never counted: whether and when training ends would depend on the batch."""
        if self._last is not None:
            self.abandoned = True

    @property
    def passed_over(self) -> int:
        """Batches drawn that no step used: ``skipped``, and the last one if its loader was closed without a
        step on it (``abandon``)."""
        return self.skipped + int(self._last is not None and self.abandoned)

    def give_back(self) -> None:
        """Return the batch ``sample`` just returned: ``sample`` gives it again (a step that failed
        before releasing anything is retried with its own batch; with bands its class is the step's)."""
        if self._last is not None:
            self._ahead.insert(0, self._last)
            self._last = None
        self.abandoned = False

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
        idx = poisson_indices(self.key, Purpose.SAMPLE, self.drawn, self.n, band_rate(self.bands, self.q))
        if self.bands > 1:  # the same draws at rate b q, restricted to the step's class
            idx = idx[torch.from_numpy(self.labels[idx.numpy()] == self.drawn % self.bands)]
        self.drawn += 1
        return idx

    @property
    def labels(self):
        """Each example's participation class (``bands > 1``), drawn once under the current key."""
        if self._labels is None or self._labels[0] is not self.key:
            self._labels = (self.key, band_labels(self.key, self.n, self.bands))
        return self._labels[1]

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.sample()

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "n": self.n, "q": self.q, "bands": self.bands, "skipped": self.skipped,
                "ahead": [t.clone() for t in self._ahead]}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n or state["q"] != self.q or state["bands"] != self.bands:
            raise ConfigError(f"sampler state is for n={state['n']}, q={state['q']}, bands={state['bands']}; "
                              f"this sampler has n={self.n}, q={self.q}, bands={self.bands}")
        self.drawn, self.skipped = int(state["drawn"]), int(state["skipped"])
        self._ahead, self.handed, self._last = [t.clone() for t in state["ahead"]], 0, None


def epoch_steps(n: int, batch_size: int, drop_last: bool = False) -> int:
    """The steps of one epoch as the training frameworks count a DataLoader's batches (``len(DataLoader)``, which
    Opacus, Hugging Face's ``Trainer`` and Lightning all read): ceil(n / B), or n // B with ``drop_last``; at
    least 1. Every integration counts its epochs with it (``clipbias train`` and ``DPEngine(epochs=)`` count
    ``round(n / B)``, their own documented convention). Each step draws every example with probability
    q = B / n, so an epoch draws B ceil(n / B) >= n examples in expectation."""
    return max(1, n // batch_size if drop_last else -(-n // batch_size))


def band_rate(bands: int, sample_rate: float) -> float:
    """The rate at which an example joins a step of its class with ``bands`` classes: b q, the float the
    inclusion threshold rounds down and the accountant reads (the realised rate never exceeds it)."""
    return min(1.0, bands * sample_rate)


def check_bands(bands: int, sample_rate: float) -> None:
    """``bands`` a whole number >= 1 with ``bands * q <= 1`` (the rate of the step's class)."""
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise ConfigError(f"`bands` must be a whole number >= 1, got {bands!r}")
    if bands * sample_rate > 1:  # band_rate would cap it: the expected batch would shrink
        raise ConfigError(f"`bands={bands}` with sampling rate q = {sample_rate:.4g}: each example joins a step of "
                          f"its class with probability bands x q = {bands * sample_rate:.4g} > 1; use `bands` <= "
                          f"{max(1, int(1 / sample_rate))} or a smaller batch")
