"""Real data sets, loaded offline: Fashion-MNIST (Debian files) and three scikit-learn sets.

One entry point, :func:`load_dataset`, returns a :class:`Dataset` of in-memory tensors.
The test split is fixed (part of each data set's definition). A validation split (carved out of
the *training* split, for hyper-parameter tuning that never looks at the test set) is a keyed draw
per example under a ``SecretKey`` (``with_validation``): never a public seed.

Privacy of preprocessing (see ``docs/data.md``):

* ``fashion-mnist``: pixels / 255, then ``(x - 0.2860) / 0.3530``. The two constants are
  the public, widely published Fashion-MNIST statistics; nothing is computed from the data.
* ``digits``: pixels / 16 (the known 0..16 range). Nothing is computed from the data.
* ``breast-cancer`` and ``wine``: ``log1p`` of each (non-negative) feature, a fixed transform that
  computes nothing from the data (standardising with the training split's mean and std would
  release statistics of the private data outside the guarantee).
* ``cifar10``: public constants 0.5/0.5. ``npz``: used as given (no preprocessing by clipbias).

``Dataset.preprocessing`` names which: ``"public"`` (constants or fixed transforms only),
``"none"`` (arrays used as given) or ``"private-statistics"`` (statistics of the private training
split: outside the guarantee, and runs on such data are reported ``certified: false``).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from ..errors import ConfigError, require
from ..randomness import SecretKey
from .dataset import (HOLDOUT_CAVEAT, DataFormatError, DataNotFoundError, Dataset, IdxFormatError, holdout,
                      keyed_split, stratified_split, with_validation)
from .fashion import (FASHION_MNIST_CLASSES, FASHION_MNIST_MEAN, FASHION_MNIST_STD, cache_dir, fashion_mnist_dir,
                      load_fashion_mnist, read_idx)
from .own import CIFAR10_CLASSES, load_cifar10, load_npz

__all__ = ["CIFAR10_CLASSES", "DATASET_NAMES", "DataFormatError", "DataNotFoundError", "Dataset", "FASHION_MNIST_MEAN",
           "FASHION_MNIST_STD", "HOLDOUT_CAVEAT", "IdxFormatError", "cache_dir", "fashion_mnist_dir", "holdout",
           "keyed_split", "load_cifar10", "load_dataset", "load_fashion_mnist", "load_npz", "read_idx",
           "with_validation"]

DATASET_NAMES = ("fashion-mnist", "digits", "digits-image", "breast-cancer", "wine", "cifar10", "npz")
"""Names accepted by :func:`load_dataset` (``digits-image`` = ``digits`` shaped 1x8x8)."""
SKLEARN_TEST_SIZE = 0.25
SKLEARN_SPLIT_SEED = 0


def _sklearn_arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
    skd = require("sklearn.datasets", f"the {name} data set")
    loader = {"digits": skd.load_digits, "breast-cancer": skd.load_breast_cancer,
              "wine": skd.load_wine}[name]
    bunch = loader()
    return np.asarray(bunch.data, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)



def load_dataset(name: str, *, data_dir: str | os.PathLike | None = None, validation: int = 0,
                 key: SecretKey | None = None, image: bool = False,
                 data_path: str | os.PathLike | None = None) -> Dataset:
    """Load a data set by name (see :data:`DATASET_NAMES`).

    ``validation > 0`` moves about that many training examples into ``x_val``/``y_val``: each joins
    independently with probability ``validation / N``, by its keyed draw under ``key`` (a
    ``clipbias.randomness.SecretKey``, required then; :func:`with_validation`); the test split never
    changes. ``image=True`` (or the name
    ``digits-image``) shapes ``digits`` as 1x8x8 images instead of 64 flat features.
    ``data_dir`` overrides the Fashion-MNIST directory and is where ``cifar10`` is read from;
    ``npz`` reads ``data_path`` (see ``load_npz``).
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if validation < 0:
        raise ValueError(f"validation must be >= 0, got {validation}")
    if validation and key is None:
        raise ConfigError("load_dataset(validation=...) needs key=: the SecretKey whose draws choose the validation "
                          "part (a run's key; SecretKey.generate() for a fresh one)")
    if name == "digits-image":
        name, image = "digits", True

    if name in ("cifar10", "npz"):
        ds = load_cifar10(data_dir) if name == "cifar10" else load_npz(data_path)
        return with_validation(ds, validation, key)
    if name == "fashion-mnist":
        t = load_fashion_mnist(data_dir)
        ds = Dataset(name=name, x_train=t["x_train"], y_train=t["y_train"], x_test=t["x_test"], y_test=t["y_test"],
                     num_classes=FASHION_MNIST_CLASSES, input_shape=(1, 28, 28),
                     notes=(f"pixels/255 then (x-{FASHION_MNIST_MEAN})/{FASHION_MNIST_STD}: public constants, no "
                            "statistic of the private data. Row-by-row sequence view: x.view(-1, 28, 28)."))
        return with_validation(ds, validation, key)
    x, y = _sklearn_arrays(name)
    train, test = stratified_split(y, SKLEARN_TEST_SIZE, SKLEARN_SPLIT_SEED)  # the data set's fixed test split
    if name == "digits":
        x = (x / 16.0).astype(np.float32)
        notes = "pixels/16 (known 0..16 range): no statistic of the private data."
    else:  # measurements >= 0 on scales from 1e-3 to 1e3: a fixed compression, nothing computed from the data
        x = np.log1p(x).astype(np.float32)
        notes = "log1p of each feature (a fixed transform): no statistic of the private data."
    shape = (1, 8, 8) if (name == "digits" and image) else (x.shape[1],)

    def take(idx: np.ndarray) -> tuple[Tensor, Tensor]:
        return (torch.from_numpy(x[idx]).reshape(len(idx), *shape),
                torch.from_numpy(y[idx]))

    x_tr, y_tr = take(train)
    x_te, y_te = take(test)
    ds = Dataset(name=name, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te,
                 num_classes=int(max(y_tr.max(), y_te.max())) + 1, input_shape=tuple(shape), notes=notes)
    return with_validation(ds, validation, key)
