"""The in-memory ``Dataset`` every loader returns, its errors, the registry of data sets loaded by name
(``DATASETS``: a ``DataSource`` each, added by ``register_dataset``), and the splits carved out of its
training part (a validation split, examples held out), each a keyed draw per example under the run's
secret key (``keyed_split``)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from ..errors import ClipbiasError, ConfigError, require
from ..randomness import Purpose, SecretKey, poisson_indices
from ..registry import Registry


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


@dataclasses.dataclass(frozen=True)
class DataSource:
    """A data set that ``load_dataset`` (and ``clipbias train --data``) loads by ``name``.

    ``load(data_dir=..., data_path=..., image=...)`` returns the ``Dataset`` with its fixed test split
    and its ``preprocessing`` label (no validation split: ``load_dataset`` carves it); ``data_dir`` is
    where files live (None: the source's default place), ``data_path`` a file the user names, ``image``
    asks for image-shaped inputs where a source has both shapes. A source ignores what it does not use.
    """

    name: str
    load: Callable[..., Dataset]
    description: str = ""


DATASETS: Registry[DataSource] = Registry("a data set", "data")
"""The data sets loadable by name, in the order the CLI offers them (``register_dataset``)."""


def register_dataset(source: DataSource) -> DataSource:
    """Add ``source`` to ``DATASETS`` under its name (a name is registered once)."""
    return DATASETS.register(source)


def stratified_split(y: np.ndarray, size: int | float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of ``arange(len(y))`` into (keep, taken) index arrays. Only for the fixed
    test split of the scikit-learn sets (part of the data set's definition, seed 0): never for a split
    of private training data, where one example's label would move others (``keyed_split``)."""
    train_test_split = require("sklearn.model_selection", "the scikit-learn data sets' test split").train_test_split
    keep, taken = train_test_split(np.arange(len(y)), test_size=size, random_state=seed, stratify=y)
    return np.sort(keep), np.sort(taken)


def keyed_split(key: SecretKey, purpose: int, n: int, rate: float) -> Tensor:
    """A bool mask over ``arange(n)``: example i is taken independently with probability ``rate``, by its
    own keyed draw (the i-th 64-bit uniform at ``(purpose, 0, 0)``, ``randomness.poisson_indices``). No
    other example, no label and not ``n`` enters example i's draw: adding an example (index n) or removing
    the last moves no other example between the parts."""
    if not isinstance(key, SecretKey):
        raise ConfigError(f"a split of the private training data needs the run's clipbias.randomness.SecretKey, "
                          f"got {type(key).__name__}: a public seed would let anyone recompute which examples "
                          f"were held out")
    mask = torch.zeros(n, dtype=torch.bool)
    mask[poisson_indices(key, purpose, 0, n, rate)] = True
    return mask


def with_validation(ds: Dataset, validation: int, key: SecretKey) -> Dataset:
    """``ds`` with a validation part moved to ``x_val``/``y_val``: each training example joins it
    independently with probability ``validation / N`` (N = ``ds.num_train``), by its keyed draw under
    ``key`` (``Purpose.VALIDATION_SPLIT``). ``validation`` is the *expected* size: the realised sizes of
    both parts are random, and private (they depend on which examples fell where)."""
    if not validation:
        return ds
    if not 0 < validation < ds.num_train:
        raise ConfigError(f"validation must be smaller than the {ds.num_train} training examples, got {validation}")
    val = keyed_split(key, Purpose.VALIDATION_SPLIT, ds.num_train, validation / ds.num_train)
    _check_parts(val, "validation")
    return dataclasses.replace(ds, x_train=ds.x_train[~val], y_train=ds.y_train[~val],
                               x_val=ds.x_train[val], y_val=ds.y_train[val])


def holdout(dataset: Dataset, n: int, key: SecretKey) -> tuple[Dataset, Tensor]:
    """Hold out about ``n`` training examples and return ``(dataset_without_them, their_features)``: each
    example is held out independently with probability ``n / N``, by its keyed draw under ``key``
    (``Purpose.HOLDOUT``); ``n`` is the expected count.

    The held-out examples are PRIVATE data: used as public features (BatchClipping), nothing protects
    them (a run that does so is reported not certified, ``HOLDOUT_CAVEAT``). Their labels are dropped;
    the returned dataset's ``num_train`` shrinks.
    """
    if not 0 < n < dataset.num_train:
        raise ConfigError(f"the number held out must lie in [1, {dataset.num_train}), got {n}")
    taken = keyed_split(key, Purpose.HOLDOUT, dataset.num_train, n / dataset.num_train)
    _check_parts(taken, "held-out")
    rest = dataclasses.replace(
        dataset, x_train=dataset.x_train[~taken], y_train=dataset.y_train[~taken],
        notes=(dataset.notes + f" About {n} training examples held out (keyed draws) as public features: they "
               f"are private data, not protected.").strip())
    return rest, dataset.x_train[taken]


HOLDOUT_CAVEAT = ("the training examples held out as public features (--public-source holdout) are private data "
                  "that the guarantee does not protect: as public features their influence on the weights (and on "
                  "the majority-vote predictions) is neither bounded nor noised")


def _check_parts(taken: Tensor, part: str) -> None:
    if not 0 < int(taken.sum()) < len(taken):
        raise ConfigError(f"the keyed draw put {'no' if not taken.any() else 'every'} training example in the "
                          f"{part} part: use more data or another size")
