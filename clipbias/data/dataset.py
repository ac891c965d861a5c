"""The in-memory ``Dataset`` every loader returns, its errors, and the splits carved out of its
training part (a validation split, public examples held out)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from ..errors import ClipbiasError, require


class DataNotFoundError(ClipbiasError, FileNotFoundError):
    """A data set's files are not on disk. The message says how to install them."""


class DataFormatError(ClipbiasError, ValueError):
    """A data file exists but is not what its loader expects. The message says what to fix."""


class IdxFormatError(DataFormatError):
    """An idx(.gz) file is corrupt or not the kind of idx file expected."""


@dataclasses.dataclass
class Dataset:
    """A classification data set held in memory.

    ``x_*`` are float32 tensors of shape ``(n, *input_shape)``; ``y_*`` are int64 labels
    in ``[0, num_classes)``. ``x_val``/``y_val`` are ``None`` unless a validation split
    was asked for; it is carved out of the training split, never out of the test split.
    ``preprocessing`` is ``"public"`` when preprocessing used only public constants or fixed
    transforms (nothing computed from the data), ``"none"`` when the arrays are used as given, and
    ``"private-statistics"`` when it used statistics of the private training split (outside the DP
    guarantee); ``notes`` says which and why.
    """

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    notes: str = ""
    preprocessing: str = "public"
    x_val: Tensor | None = None
    y_val: Tensor | None = None

    @property
    def num_train(self) -> int:
        """Number of (private) training examples, the ``n`` of privacy accounting."""
        return int(self.y_train.shape[0])


def stratified_split(y: np.ndarray, size: int | float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of ``arange(len(y))`` into (keep, taken) index arrays."""
    train_test_split = require("sklearn.model_selection", "a stratified split (--validation)").train_test_split
    keep, taken = train_test_split(np.arange(len(y)), test_size=size, random_state=seed, stratify=y)
    return np.sort(keep), np.sort(taken)


def with_validation(ds: Dataset, validation: int, seed: int) -> Dataset:
    """``ds`` with ``validation`` training examples (stratified, chosen by ``seed``) moved to
    ``x_val``/``y_val``."""
    if not validation:
        return ds
    keep, val = stratified_split(ds.y_train.numpy(), validation, seed)
    return dataclasses.replace(ds, x_train=ds.x_train[keep], y_train=ds.y_train[keep],
                               x_val=ds.x_train[val], y_val=ds.y_train[val])


def holdout(dataset: Dataset, n: int, seed: int = 0) -> tuple[Dataset, Tensor]:
    """Remove ``n`` random training examples (chosen by ``seed``) and return
    ``(dataset_without_them, their_features)``.

    The removed features can serve as *public* data (e.g. BatchClipping's public
    features); their labels are dropped. The returned dataset's ``num_train`` shrinks,
    which is what the privacy accounting must then use.
    """
    if not 0 <= n < dataset.num_train:
        raise ValueError(f"n must be in [0, {dataset.num_train}), got {n}")
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(dataset.num_train))
    taken, keep = perm[:n].sort().values, perm[n:].sort().values
    rest = dataclasses.replace(
        dataset, x_train=dataset.x_train[keep], y_train=dataset.y_train[keep],
        notes=(dataset.notes + f" {n} training examples held out as public data (seed {seed}).").strip())
    return rest, dataset.x_train[taken]
