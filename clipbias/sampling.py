"""The run's randomness: Poisson sampling, the secret streams, keyed per-example draws.

Poisson sampling: each example joins a batch independently with probability q. This is the
sampling the subsampled-Gaussian accountants assume. Batch sizes vary (and can be 0); updates are
normalised by the expected size B = qN, never the realised one.

Keyed randomness: perturbation noise, augmentation parameters, group assignments and public-feature
draws are pure functions of ``(seed, purpose, step, example index)`` (``mix``): fresh per example
and step, independent of the data, identical whatever the micro-batching, and exactly reproducible
on resume without carrying generator state. ``seed`` is a secret key (the third of
``secret_streams``): a public one would let removing an example re-key every later index
predictably. Without example indices the position in the logical batch is the key (then only the
randomness, never the privacy, depends on the order).
"""

from __future__ import annotations

import secrets
from typing import Iterable

import numpy as np
import torch
from torch import Tensor

from .errors import ConfigError


class PoissonSampler:
    """Yields index tensors of Poisson batches; ``len(self)`` = steps per epoch = round(1/q).

    A loader that prefetches (``clipbias.loader``: DataLoader workers fetch the next batches while
    the current step runs) draws batches ahead with ``draw_ahead``; ``sample`` then returns them in
    the same order, so the batches are the same with or without lookahead. Batches drawn ahead and
    not yet sampled are part of ``state_dict``: a resumed run continues with exactly them.
    """

    def __init__(self, n: int, sample_rate: float, seed: int = 0, steps: int | None = None) -> None:
        if n < 1:
            raise ConfigError(f"dataset size must be >= 1, got {n}")
        if not 0 < sample_rate <= 1:
            raise ConfigError(f"sample rate must lie in (0, 1], got {sample_rate!r}")
        self.n, self.q = n, float(sample_rate)
        self.steps = steps if steps is not None else max(1, round(1 / self.q))
        self.generator = torch.Generator().manual_seed(seed)
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
        if self.q == 1:
            return torch.arange(self.n)
        # float64 uniforms on a 2^-53 grid: P(U < q) is q to within 2^-53 (float32 was 2^-24 coarse)
        u = torch.rand(self.n, generator=self.generator, dtype=torch.float64)
        return (u < self.q).nonzero().flatten()

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.sample()

    def state_dict(self) -> dict:
        return {"rng": self.generator.get_state(), "n": self.n, "q": self.q,
                "ahead": [t.clone() for t in self._ahead]}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n or state["q"] != self.q:
            raise ConfigError(f"sampler state is for n={state['n']}, q={state['q']}; this sampler has "
                              f"n={self.n}, q={self.q}")
        self.generator.set_state(state["rng"])
        self._ahead, self.handed = [t.clone() for t in state.get("ahead", [])], 0


_DOMAIN = 0x636C697062696173  # "clipbias": separates these streams from torch.manual_seed(seed)


def secret_seeds(noise_seed: int | None = None) -> tuple[int, int]:
    """Seeds of the first two secret streams, (Poisson sampler, Gaussian noise): ``secret_streams``."""
    return secret_streams(noise_seed)[:2]


def secret_streams(noise_seed: int | None = None) -> tuple[int, int, int]:
    """Seeds of the three secret random streams: (Poisson sampler, Gaussian noise, keyed draws).

    The keyed draws are the per-(step, example) randomness of the methods (augmentations, p-avg
    groups, BatchClipping's public partners): keyed by example index, they must be secret too, or
    removing one example (which shifts every later index) would change the others' draws in a way
    the adversary can predict (docs/privacy.md, "Hidden state and keyed randomness").

    The DP guarantee assumes nobody can predict the batches or the noise. With ``noise_seed=None``
    (the default) the streams are seeded from 128 bits of the operating system's CSPRNG
    (``secrets``), which are never written anywhere; only the generator states in the private
    checkpoint can continue them. An integer ``noise_seed`` makes runs reproducible (tests,
    benchmarks, toy problems): the guarantee then holds only while that integer stays secret.
    The streams are independent children of one ``numpy.random.SeedSequence`` (children are indexed,
    so the first two are the same as before the third existed).
    """
    if noise_seed is not None and (not isinstance(noise_seed, int) or isinstance(noise_seed, bool)
                                   or noise_seed < 0):
        raise ConfigError(f"noise seed must be an integer >= 0 or None, got {noise_seed!r}")
    entropy = secrets.randbits(128) if noise_seed is None else [noise_seed, _DOMAIN]
    return tuple(int(c.generate_state(1, np.uint64)[0]) for c in np.random.SeedSequence(entropy).spawn(3))


# ---------------------------------------------------------------- keyed per-example draws
_MASK64 = (1 << 64) - 1

# purposes of keyed randomness (one stream each)
PERTURB, AUGMENT, GROUP, PUBLIC, PREDICT = 1, 2, 3, 4, 5
PROBE_STEP = 1 << 62  # step key of measurement probes: never collides with a training step


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 chain): distinct tuples give independent streams."""
    h = 0x2545F4914F6CDD1D
    for v in parts:
        h = _splitmix64(h ^ (int(v) & _MASK64))
    return h & ((1 << 63) - 1)


def keyed_ints(seed: int, purpose: int, step: int, keys: Iterable[int], count: int, high: int) -> Tensor:
    """``[len(keys), count]`` integers uniform in ``[0, high)``, a pure function of each key."""
    out = []
    for k in keys:
        h = mix(seed, purpose, step, k)
        row = []
        for _ in range(count):
            h = _splitmix64(h)
            row.append(h % high)
        out.append(row)
    return torch.tensor(out, dtype=torch.long).reshape(-1, count)


def keyed_normal(seed: int, purpose: int, step: int, keys: Iterable[int], d: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """``[len(keys), d]`` standard normal rows, row i from a generator seeded by ``keys[i]``."""
    rows = []
    for k in keys:
        gen = torch.Generator(device=device)
        gen.manual_seed(mix(seed, purpose, step, k))
        rows.append(torch.randn(d, generator=gen, device=device, dtype=dtype))
    return torch.stack(rows) if rows else torch.zeros(0, d, device=device, dtype=dtype)


def batch_keys(indices: Tensor | None, start: int, size: int) -> list[int]:
    """Example indices of ``[start, start + size)`` of the logical batch, or the positions."""
    if indices is not None:
        return [int(i) for i in indices[start:start + size]]
    return list(range(start, start + size))
