"""scikit-learn's bundled data sets (``digits``, ``digits-image``, ``breast-cancer``, ``wine``), each
with a fixed stratified test split and a fixed transform that computes nothing from the data."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..errors import require
from .dataset import DataSource, Dataset, register_dataset, stratified_split

SKLEARN_TEST_SIZE = 0.25
SKLEARN_SPLIT_SEED = 0


def _sklearn_arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
    skd = require("sklearn.datasets", f"the {name} data set")
    loader = {"digits": skd.load_digits, "breast-cancer": skd.load_breast_cancer,
              "wine": skd.load_wine}[name]
    bunch = loader()
    return np.asarray(bunch.data, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


def sklearn_dataset(name: str, image: bool = False) -> Dataset:
    """The scikit-learn set ``name`` as a ``Dataset``; ``image=True`` shapes ``digits`` as 1x8x8 images
    instead of 64 flat features."""
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
    return Dataset(name=name, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te,
                   num_classes=int(max(y_tr.max(), y_te.max())) + 1, input_shape=tuple(shape), notes=notes)


register_dataset(DataSource("digits", lambda *, image=False, **_: sklearn_dataset("digits", image),
                            "scikit-learn's 8x8 digits, 64 features (image=True: 1x8x8)"))
register_dataset(DataSource("digits-image", lambda **_: sklearn_dataset("digits", True),
                            "digits shaped 1x8x8"))
register_dataset(DataSource("breast-cancer", lambda **_: sklearn_dataset("breast-cancer"),
                            "scikit-learn's breast cancer set, 30 features"))
register_dataset(DataSource("wine", lambda **_: sklearn_dataset("wine"), "scikit-learn's wine set, 13 features"))
