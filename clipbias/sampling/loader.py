"""Poisson batches of any map-style ``torch.utils.data.Dataset``, fetched by a ``DataLoader``.

The engine's secret ``PoissonSampler`` chooses every step's indices; a ``DataLoader`` (workers,
pinned memory, your ``collate_fn``) only fetches and collates them. Privacy therefore rests on the
sampler exactly as for in-memory tensors: each example joins each step independently with
probability q, the realised batch size varies and may be 0 (an empty batch is a noise-only step),
the update is normalised by the expected size B. To let workers prefetch, batches are drawn ahead
(``PoissonSampler.draw_ahead``) in the order they are used; a checkpoint holds the ones drawn and not
yet used, so a resumed run sees exactly the batches an uninterrupted one would.

A collated batch is ``(inputs, targets)``, or a dict with a ``"labels"`` entry (the Hugging Face
convention: the rest of the dict is the model's keyword arguments). Inputs and targets may be any
``clipbias.data.batch.Batch``. The guarantee needs row i of every tensor, and the model's computation on
it, to depend on example i alone: a ``collate_fn`` that pads to the batch's longest example is sound
only for a model that ignores the padding (a causal model with right padding and its attention mask:
tested for GPT-2), and one that builds in-batch matrices is not; ``__getitem__`` and ``collate_fn`` must
not draw by fetch order (torch's, numpy's or Python's global generator, a generator object of their own,
a counter): one example's presence would move the others' draws. Every step is checked
(``clipbias.sampling.refetch``): the global generators' states around each batch's fetch (in the main
process and in workers alike), and one example of the batch, chosen in secret, fetched and collated alone
twice and compared with its row; what differs makes the run uncertified, with a caveat that says what
was seen and a warning. Random augmentation draws from ``clipbias.example_generator()``: keyed by the
run's secret key, the step and the example, which the plan carries to the process that fetches it
(``randomness.example``). In-memory tensors go through the same loop as ``TensorData`` (a batched
fetch: one indexing operation per step, no per-example collation, nothing to check).

Example::

    loader = PoissonLoader(engine, dataset, collate_fn=my_collate, num_workers=2)
    for epoch in range(epochs):
        for x, y, idx in loader.epoch():
            engine.step(x, y, idx)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, default_collate

from ..data import batch
from ..data.batch import Batch
from ..errors import ConfigError
from ..randomness import Purpose, SecretKey, secret_int
from ..randomness.example import PROBE_FETCH_STEP, fetching
from . import refetch



class TensorData(Dataset):
    """In-memory ``(inputs, targets)`` as a Dataset whose batches are fetched by one indexing
    operation (``__getitems__``), on whatever device the tensors live.

    Args:
        x: The inputs, one row per example (a tensor, or a tuple or dict of them: a ``Batch``).
        y: The targets, one per input.

    Raises:
        ConfigError: ``x`` and ``y`` hold different numbers of examples.
    """

    def __init__(self, x: Batch, y: Batch) -> None:
        if batch.size(x) != batch.size(y):
            raise ConfigError(f"got {batch.size(x)} inputs and {batch.size(y)} labels: one label per input is needed")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return batch.size(self.x)

    def __getitem__(self, i: int) -> tuple[Batch, Batch]:
        return batch.take(self.x, i), batch.take(self.y, i)

    def fetch(self, idx: Tensor) -> tuple[Batch, Batch]:
        """The batch of examples ``idx`` (a long tensor)."""
        return batch.take(self.x, idx), batch.take(self.y, idx)


class _Indices(list):
    """A batch of the plan: the example indices, and the step that will use them (``step``), which travels
    with the indices to the process that fetches them (``clipbias.example_generator``'s address)."""

    def __init__(self, indices: list[int], step: int) -> None:
        super().__init__(indices)
        self.step = step


class _Fetch(Dataset):
    """What the DataLoader reads: ``__getitems__(indices) -> (indices, collated batch, step, moved
    generators)``, collated in the worker; an empty index list gives ``template`` (the batch structure with
    zero rows). Each item is fetched, and the batch collated, with ``clipbias.example_generator`` keyed by
    ``key``, the step and the example (``randomness.example``); the global generators' states are compared
    before and after (``refetch.moved``)."""

    def __init__(self, dataset: Dataset, collate: Callable, template: Any, key: SecretKey) -> None:
        self.dataset, self.collate, self.template, self.key = dataset, collate, template, key

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Any, int | None, tuple[str, ...]]:
        step = getattr(indices, "step", None)
        indices = list(indices)
        idx = torch.tensor(indices, dtype=torch.long)
        if isinstance(self.dataset, TensorData):
            return idx, self.dataset.fetch(idx), step, ()
        if not indices:
            return idx, self.template, step, ()
        before = refetch.generator_states()
        out = self.fetched(indices, PROBE_FETCH_STEP if step is None else step)
        return idx, out, step, refetch.moved(before)

    def fetched(self, indices: list[int], step: int) -> Any:
        """The collated batch of examples ``indices`` fetched for step ``step``."""
        many = getattr(self.dataset, "__getitems__", None)
        if many is not None:
            with fetching(self.key, step, indices):
                items = many(indices)
        else:
            items = []
            for i in indices:
                with fetching(self.key, step, (i,), item=True):
                    items.append(self.dataset[i])
        with fetching(self.key, step, indices, collate=True):
            return self.collate(items)

    def alone(self, i: int, step: int) -> Any:
        """Example ``i`` fetched and collated alone for step ``step`` (the re-fetch check)."""
        return self.fetched([i], step)


def _as_is(data: Any) -> Any:
    return data


def split(data: Any) -> tuple[Batch, Batch]:
    """``(inputs, targets)`` of a collated batch: a pair, or a dict with a ``"labels"`` entry."""
    if isinstance(data, Mapping) and "labels" in data:
        return {k: v for k, v in data.items() if k != "labels"}, data["labels"]
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0], data[1]
    raise ConfigError(f"a collated batch must be (inputs, targets) or a dict with a 'labels' entry, got "
                      f"{type(data).__name__}" + (f" with keys {sorted(data)}" if isinstance(data, Mapping) else "")
                      + "; make the dataset items (x, y) pairs or pass a collate_fn that returns one")


class _Plan:
    """The DataLoader's batch sampler: the engine's coming Poisson batches (this rank's share),
    drawn ahead in order."""

    def __init__(self, engine: Any, steps: int) -> None:
        self.engine, self.steps = engine, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        sampler = self.engine.sampler
        for _ in range(self.steps):
            idx = sampler.draw_ahead()
            step = self.engine.steps_taken + sampler.handed - 1  # the step that will use it
            yield _Indices(self.engine.local_share(idx, step).tolist(), step)


def _key_of(engine: Any) -> SecretKey:
    """The engine's key, unbound (it travels to DataLoader workers)."""
    return SecretKey(engine.key.bytes, engine.key.reproducible)


class PoissonLoader:
    """Poisson batches of ``dataset`` for ``engine``: ``epoch()`` yields ``(x, y, indices)`` for
    ``engine.step`` (see the module's docstring for what the dataset and ``collate_fn`` must respect).

    Args:
        engine: The ``DPEngine`` whose secret sampler chooses every batch.
        dataset: A map-style ``torch.utils.data.Dataset`` (``__getitem__`` and ``__len__``; in-memory
            tensors as ``TensorData``). ``len(dataset)`` must be the engine's n: the sampler draws from n
            examples and the accounting assumes n.
        collate_fn: Turns a list of dataset items into a batch (default: torch's ``default_collate``).
        num_workers: The DataLoader's worker processes (default 0). The workers' seeds derive from the
            run's secret key and the step (fresh every epoch, reproducible with ``noise_seed``).
        pin_memory: The DataLoader's.
        prefetch_factor: The DataLoader's (with workers only).
        persistent_workers: The DataLoader's (with workers only).
        multiprocessing_context: The DataLoader's (with workers only).
        device: Where ``epoch()`` puts the batches (default: the model's device).

    Raises:
        ConfigError: a dataset that is not map-style, whose length is not the engine's n, a
            ``num_workers`` that is not an integer >= 0, or workers over tensors on a GPU.
    """

    def __init__(self, engine: Any, dataset: Dataset, *, collate_fn: Callable | None = None, num_workers: int = 0,
                 pin_memory: bool = False, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 multiprocessing_context: Any = None, device: torch.device | str | None = None) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ConfigError(f"the data must be a map-style torch Dataset (__getitem__ and __len__), got "
                              f"{type(dataset).__name__}; wrap tensors as clipbias.sampling.TensorData(x, y)")
        if len(dataset) != engine.n:
            raise ConfigError(f"the dataset has {len(dataset)} examples but the engine was built with n={engine.n}: "
                              f"the sampler draws from n examples and the accounting assumes n; build the engine "
                              f"with n=len(dataset)")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"`num_workers` (DataLoader worker processes) must be an integer >= 0, got {num_workers!r}")
        if num_workers and isinstance(dataset, TensorData) and any(t.device.type != "cpu"
                                                                 for t in batch.leaves(dataset.x)):
            raise ConfigError("DataLoader workers cannot read tensors on a GPU: keep the data on the CPU or use "
                              "`num_workers=0`")
        collate = collate_fn or default_collate
        self.engine, self.dataset = engine, dataset
        self.fetch = _Fetch(dataset, collate, None, _key_of(engine))
        if not isinstance(dataset, TensorData) and len(dataset):
            # the structure of an empty batch (a noise-only step): one example's collated shapes and
            # dtypes with zero rows, in fresh storage (no value of the example is kept)
            self.fetch.template = batch.tree_map(lambda t: t.new_empty((0, *t.shape[1:])),
                                                 self.fetch.alone(0, PROBE_FETCH_STEP))
        self.options = dict(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers
                            and num_workers > 0, multiprocessing_context=multiprocessing_context if num_workers else None)
        if num_workers and prefetch_factor is not None:
            self.options["prefetch_factor"] = prefetch_factor
        self.device = torch.device(device) if device is not None else next(engine.model.parameters()).device

    def epoch(self, steps: int | None = None) -> Iterator[tuple[Batch, Batch, Tensor]]:
        """The next Poisson batches, for ``engine.step(x, y, indices)``.

        Args:
            steps: How many steps (default: one epoch, ``len(engine.sampler)``); never past the engine's
                ``total_steps``.

        Yields:
            ``(x, y, indices)``: the batch's inputs and targets on the loader's ``device``, and the indices
                of its examples.
        """
        non_blocking = self.options["pin_memory"] and self.device.type == "cuda"
        for idx, data in self.batches(steps):
            x, y = split(data)
            yield batch.to(x, self.device, non_blocking), batch.to(y, self.device, non_blocking), idx

    def batches(self, steps: int | None = None) -> Iterator[tuple[Tensor, Any]]:
        """The next Poisson batches as ``collate_fn`` made them (on the CPU).

        Args:
            steps: How many steps (default: one epoch, ``len(engine.sampler)``); never past the engine's
                ``total_steps``.

        Yields:
            ``(indices, collated batch)``; the engine's sampler has just returned ``indices``
                (``sampler.last``).
        """
        engine = self.engine
        steps = len(engine.sampler) if steps is None else steps
        steps = max(0, min(steps, engine.total_steps - engine.steps_taken))
        engine.sampler.restart_ahead()
        self.fetch.key = _key_of(engine)  # (a state loaded since: the run's key)
        check = not isinstance(self.dataset, TensorData)
        seed = secret_int(engine.key, Purpose.LOADER, engine.steps_taken)  # ChaCha20 output: reveals no key bit
        loader = DataLoader(self.fetch, batch_sampler=_Plan(engine, steps), collate_fn=_as_is,
                            generator=torch.Generator().manual_seed(seed), **self.options)
        guard = getattr(engine, "state_guard", None)
        before = guard.snapshot(copies=False) if guard is not None else None  # (the model before each fetch)
        try:
            for idx, data, step, moved in loader:
                want = engine.local_share(engine.sampler.sample())
                if not torch.equal(want, idx):  # the loader and the sampler must agree on every batch
                    raise RuntimeError("PoissonLoader: the fetched batch is not the sampler's next batch (was the "
                                       "sampler used by another loop at the same time?)")
                if check:  # fetch and collate a function of the example alone (refetch), or a caveat
                    refetch.check(engine, self.fetch.alone, idx, data, step, moved)
                now = guard.snapshot() if guard is not None else None  # (the fetches above included)
                written = guard.changed_since(before, now) if guard is not None else []
                if written:  # the dataset or collate_fn wrote the model while the batch was fetched (a red team's
                    # collate set a buffer from the batch that the forward read: 7.8 C, certified, before)
                    raise ConfigError(
                        f"the model's state changed while the private data loader fetched and collated a batch "
                        f"({', '.join(written[:6])}{' and more' if len(written) > 6 else ''}): a dataset or "
                        f"collate_fn that writes the model from the batch releases that statistic without noise. "
                        f"Keep the data pipeline out of the model's state; the model now holds it: do not release "
                        f"it, reload it from before")
                # the batch as fetched, before the loop can change it, and the model's state: the step compares
                # both (engine.drawn, engine.guard: the loop, its hooks and callbacks may not write the model)
                engine.sampler.fetched = (idx, batch.tree_map(lambda t: t.detach().clone(), data), now)
                yield idx, data
                before = guard.snapshot(copies=False) if guard is not None else None  # (after the loop's step)
        finally:  # a loop that stopped (break, an error) before stepping on the last batch: counted as skipped
            engine.sampler.abandon()  # (a failed step gave its batch back already: ``aggregate.drop_staged``)
