"""Keyed per-example randomness for a Dataset and a ``collate_fn``: ``clipbias.example_generator()``.

Random augmentation in ``Dataset.__getitem__`` or in a collate (a random crop, MLM masking) is sound
only if each example's draws are a function of that example alone: a generator that hands out its
draws in fetch order (torch's, numpy's or Python's global one, a dataset's own ``np.random.default_rng``,
a collator's ``torch.Generator``) gives example i the draws that depend on how many draws the examples
fetched before it made, so adding one example moves every later example's augmentation. The private
loader (``clipbias.sampling.loader``) reports such a run uncertified (``clipbias.sampling.refetch``).

``example_generator()`` is the sound replacement: while the private loader fetches example i for step t
it returns a generator whose draws come from the run's secret key (ChaCha20,
``clipbias.randomness.chacha``) at the addresses ``(Purpose.EXAMPLE_FETCH, t + 2^32 c, i)`` in
``__getitem__``/``__getitems__`` and ``(Purpose.EXAMPLE_COLLATE, t + 2^32 c, i)`` in the collate, c
the draw's number within that example's fetch (its c-th call of a draw method, from 0). So the draws
of example i at step t are the same whichever other examples exist or share its batch, in whatever
order they are fetched, in the main process or a DataLoader worker, and again on a resumed run (nothing
to save); each draw reads its own stream from its start, so the size of one draw (a sequence padded to
the batch's longest) moves no later draw, and elements are laid out row-major, so a draw of shape
``(L, k)`` is the first L rows of one of shape ``(L', k)`` for L' > L. The re-fetch check fetches
an example again at the same address: it sees the same draws, and the run stays certified.

In ``__getitem__`` call ``example_generator()`` (the example being fetched); in a ``collate_fn``, or a
batched ``__getitems__``, call ``example_generator(j)`` for the j-th item of the list it was given.
Outside a private fetch (a DataLoader of your own, evaluation) it raises ``ConfigError``; use your own
generator there, where nothing is private.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from ..errors import ConfigError
from .draws import normals, uint64s
from .key import Purpose, SecretKey

EXAMPLE_STEP_BITS, DRAW_BITS = 32, 16
PROBE_FETCH_STEP = (1 << EXAMPLE_STEP_BITS) - 1
"""The step of fetches that only learn a batch's structure (the loader's empty-batch template): never a
training step, and nothing of what they draw is kept."""
_local = threading.local()


class ExampleGenerator:
    """Draws for one example at one step, from the run's secret key: what ``example_generator`` returns
    (not built by hand). Every call of a draw method reads a stream of its own (its number in the fetch: the
    c-th draw of this example in this fetch), so the same sequence of calls gives the same values, and a
    call's size moves no other call's values. Tensors are on the CPU.

    Args:
        key: The run's secret key.
        purpose: ``Purpose.EXAMPLE_FETCH`` (in the dataset) or ``Purpose.EXAMPLE_COLLATE`` (in the collate).
        step: The training step the example is fetched for.
        index: The example's index in the dataset.
    """

    __slots__ = ("_key", "_purpose", "_step", "index", "_calls")

    def __init__(self, key: SecretKey, purpose: int, step: int, index: int) -> None:
        self._key, self._purpose, self._step, self.index, self._calls = key, int(purpose), int(step), int(index), 0

    def __repr__(self) -> str:
        return f"ExampleGenerator(example {self.index}, draw {self._calls})"

    def _words(self, count: int) -> np.ndarray:
        """``count`` uniform 64-bit integers of the next draw's stream."""
        call, self._calls = self._calls, self._calls + 1
        if call >= 1 << DRAW_BITS:
            raise ConfigError(f"example {self.index} made more than {(1 << DRAW_BITS) - 1} draws from "
                              f"clipbias.example_generator() in one fetch: draw larger tensors, fewer times")
        return uint64s(self._key, self._purpose, self._field(call), self.index, count)

    def _field(self, call: int) -> int:
        return self._step | (call << EXAMPLE_STEP_BITS)

    def uniform(self, *size, dtype: torch.dtype = torch.float32) -> Tensor:
        """Uniform floats in [0, 1) (``rand``).

        Args:
            *size (int): The shape (integers, or one tuple).
            dtype: A floating dtype (default float32).

        Returns:
            A tensor of shape ``size``: multiples of 2^-m, m the precision of ``dtype`` (24 bits for float32, 53
                for float64), each exact in ``dtype`` (never rounded to 1).

        Raises:
            ConfigError: a dtype that is not floating, a negative size, or more than 2^16 - 1 draws for one
                example in one fetch.
        """
        shape = _shape(size)
        if not dtype.is_floating_point:
            raise ConfigError(f"example_generator().uniform draws floats; got dtype {dtype}")
        bits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # the significand's bits
        u = self._words(_count(shape)) >> np.uint64(64 - bits)
        return torch.from_numpy(u.astype(np.float64) * 2.0 ** -bits).to(dtype).view(shape)

    rand = uniform

    def normal(self, *size, dtype: torch.dtype = torch.float32) -> Tensor:
        """Standard normals (``randn``): ``clipbias.randomness.draws.normals``.

        Args:
            *size (int): The shape (integers, or one tuple).
            dtype: The dtype (default float32).

        Returns:
            A tensor of shape ``size``.
        """
        shape = _shape(size)
        call, self._calls = self._calls, self._calls + 1
        if call >= 1 << DRAW_BITS:
            raise ConfigError(f"example {self.index} made more than {(1 << DRAW_BITS) - 1} draws from "
                              f"clipbias.example_generator() in one fetch: draw larger tensors, fewer times")
        return normals(self._key, self._purpose, self._field(call), self.index, _count(shape)).to(dtype).view(shape)

    randn = normal

    def integers(self, low: int, high: int | None = None, size=(), dtype: torch.dtype = torch.int64) -> Tensor:
        """Integers in ``[low, high)`` (``randint``): a 64-bit uniform reduced mod ``high - low`` (each value's
        probability within (high - low) / 2^64 of uniform).

        Args:
            low: The lowest value, or with ``high`` None the (excluded) upper end, from 0.
            high: The excluded upper end.
            size (int | tuple): The shape (an integer or a tuple; default ``()``).
            dtype: The dtype (default int64).

        Returns:
            A tensor of shape ``size``.

        Raises:
            ConfigError: ``low >= high`` or a range of 2^63 or more.
        """
        low, high = (0, low) if high is None else (low, high)
        span = int(high) - int(low)
        if not 0 < span < 1 << 63:
            raise ConfigError(f"example_generator().integers needs low < high (a range below 2^63), got [{low}, {high})")
        shape = _shape(size if isinstance(size, (tuple, list, torch.Size)) else (size,))
        v = (self._words(_count(shape)) % np.uint64(span)).astype(np.int64) + int(low)
        return torch.from_numpy(v).to(dtype).view(shape)

    randint = integers

    def bernoulli(self, p: float | Tensor, size=None) -> Tensor:
        """A bool tensor, True with probability ``p`` at each element (a 53-bit uniform below p).

        Args:
            p: A float (then ``size`` gives the shape) or a tensor of probabilities (its shape), in [0, 1].
            size (int | tuple | None): The shape, with a float ``p`` (default None: ``()``).

        Returns:
            A bool tensor.

        Raises:
            ConfigError: a probability outside [0, 1] or NaN.
        """
        if isinstance(p, Tensor):
            prob = p.detach().to("cpu", torch.float64)
            shape = tuple(prob.shape) if size is None else _shape(size if isinstance(size, (tuple, list)) else (size,))
            if tuple(prob.shape) != shape:
                prob = prob.expand(shape)
        else:
            shape = () if size is None else _shape(size if isinstance(size, (tuple, list, torch.Size)) else (size,))
            prob = torch.tensor(float(p), dtype=torch.float64)
        if bool(((prob < 0) | (prob > 1) | prob.isnan()).any()):
            raise ConfigError("example_generator().bernoulli needs probabilities in [0, 1]")
        return self.uniform(*shape, dtype=torch.float64) < prob

    def permutation(self, n: int) -> Tensor:
        """A uniformly random permutation of ``range(n)`` (``randperm``): the order of n 64-bit uniforms (ties,
        with probability below n^2 / 2^65, keep index order).

        Args:
            n: The length (>= 0).

        Returns:
            A long tensor of shape ``(n,)``.
        """
        if n < 0:
            raise ConfigError(f"example_generator().permutation needs n >= 0, got {n}")
        return torch.from_numpy(np.argsort(self._words(int(n)), kind="stable").astype(np.int64))

    randperm = permutation


def _shape(size: Sequence) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    shape = tuple(int(s) for s in size)
    if any(s < 0 for s in shape):
        raise ConfigError(f"a draw's shape must not be negative, got {list(shape)}")
    return shape


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for s in shape:
        count *= s
    return count


class _Scope:
    """The fetch in progress in this thread: the key, the step, the examples' indices (one: an item's
    ``__getitem__``; a list: a batched ``__getitems__`` or the collate, by position) and their generators."""

    __slots__ = ("key", "purpose", "step", "ids", "item", "generators")

    def __init__(self, key: SecretKey, purpose: int, step: int, ids: list[int], item: bool) -> None:
        self.key, self.purpose, self.step, self.ids, self.item = key, purpose, step, ids, item
        self.generators: dict[int, ExampleGenerator] = {}


@contextlib.contextmanager
def fetching(key: SecretKey, step: int, ids: Sequence[int], *, collate: bool = False,
             item: bool = False) -> Iterator[None]:
    """``example_generator`` during the fetch (``item``: one example's ``__getitem__``; else a batched
    ``__getitems__``) or the collate (``collate``) of examples ``ids`` for step ``step``."""
    if not 0 <= int(step) <= PROBE_FETCH_STEP:
        raise ConfigError(f"clipbias.example_generator() is addressed by a step below 2^{EXAMPLE_STEP_BITS}; "
                          f"got step {step}")
    previous = getattr(_local, "scope", None)
    _local.scope = _Scope(key, Purpose.EXAMPLE_COLLATE if collate else Purpose.EXAMPLE_FETCH, int(step),
                          [int(i) for i in ids], item)
    try:
        yield
    finally:
        _local.scope = previous


def example_generator(position: int | None = None) -> ExampleGenerator:
    """The keyed generator of the example being fetched by clipbias's private loader (``PoissonLoader``,
    ``PrivacyEngine``'s data loader, ``DPCallback``, ``DPTrainer``). See ``clipbias.randomness.example``.

    Args:
        position: None (default) in ``Dataset.__getitem__``: the example being fetched. In a ``collate_fn``
            (or a batched ``__getitems__``), the item's place in the list it was given.

    Returns:
        The example's ``ExampleGenerator``: ``uniform``/``rand``, ``normal``/``randn``,
            ``integers``/``randint``, ``bernoulli`` and ``permutation``/``randperm`` (CPU tensors). Within one
            fetch, repeated calls for one example return the same generator (its draws continue).

    Raises:
        ConfigError: no private fetch in progress (evaluation, your own DataLoader: use a generator of your
            own there); no ``position`` in a collate or batched fetch; a ``position`` outside the list.
    """
    scope = getattr(_local, "scope", None)
    if scope is None:
        raise ConfigError("clipbias.example_generator() draws an example's randomness from the run's secret key "
                          "while clipbias's private loader fetches it (Dataset.__getitem__ or the collate_fn run by "
                          "PoissonLoader, PrivacyEngine's data loader, DPCallback or DPTrainer); no private fetch is "
                          "in progress. Outside private training (evaluation, your own DataLoader) use a generator "
                          "of your own")
    if position is None:
        if not scope.item:
            raise ConfigError("clipbias.example_generator() in a collate_fn (or a batched __getitems__) needs the "
                              "item's position: example_generator(j) for the j-th item of the list it was given")
        position = 0
    position = int(position)
    if not 0 <= position < len(scope.ids):
        raise ConfigError(f"clipbias.example_generator({position}): this fetch has {len(scope.ids)} item(s)")
    g = scope.generators.get(position)
    if g is None:
        g = scope.generators[position] = ExampleGenerator(scope.key, scope.purpose, scope.step, scope.ids[position])
    return g
