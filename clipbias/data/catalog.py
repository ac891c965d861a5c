"""Real data sets, loaded offline: Fashion-MNIST (Debian files) and three scikit-learn sets.

One entry point, :func:`load_dataset`, returns a :class:`Dataset` of in-memory tensors; the names it
takes are the registry ``DATASETS`` (a ``DataSource`` each: ``fashion``, ``sklearn_sets`` and ``own``
register the built-in ones, and a new data set is one module that calls ``register_dataset``: this
catalog imports every module of the package itself, ``_modules``).
The test split is fixed (part of each data set's definition). A validation split (carved out of
the *training* split, for hyper-parameter tuning that never looks at the test set) is a keyed draw
per example under a ``SecretKey`` (``with_validation``): never a public seed.

Privacy of preprocessing: each set's is in ``docs/data.md``'s table (one row per registered set, checked
against the registry by ``tests/test_architecture.py``) and in its module. The built-in sets compute
nothing from the data: public constants (Fashion-MNIST's published mean and std, CIFAR-10's 0.5/0.5),
the known pixel range (digits) or a fixed transform (``log1p`` of breast-cancer's and wine's features:
standardising with the training split's mean and std would release statistics of the private data
outside the guarantee); ``npz`` is used as given.

``Dataset.preprocessing`` names which: ``"public"`` (constants or fixed transforms only),
``"none"`` (arrays used as given) or ``"private-statistics"`` (statistics of the private training
split: outside the guarantee, and runs on such data are reported ``certified: false``).
"""

from __future__ import annotations

import importlib
import os
import pkgutil

from ..errors import ConfigError
from ..randomness import SecretKey
from .dataset import (DATASETS, HOLDOUT_CAVEAT, DataFormatError, DataNotFoundError, DataSource, Dataset,
                      IdxFormatError, holdout, keyed_split, register_dataset, stratified_split, with_validation)

# the catalog: each module registers its data sets (``register_dataset``). The modules are discovered
# (``_modules``): ``_FIRST`` in its order (the order ``DATASETS`` and the CLI list the sets), then every other
# module of the package by name (a new data set needs no line here). ``_NOT_SETS``: this catalog, the registry
# and the helpers that register nothing (``batch``, ``text``: their users import them; ``text`` imports this).
_FIRST = ("fashion", "sklearn_sets", "own")  # fashion-mnist; digits, digits-image, breast-cancer, wine; cifar10, npz
_NOT_SETS = ("catalog", "dataset", "batch", "text")


def _modules(found: list[str]) -> list[str]:
    """The order in which the catalog imports the package's modules ``found`` (their names)."""
    rest = sorted(set(found) - set(_FIRST) - set(_NOT_SETS))
    return [*_FIRST, *(n for n in rest if not n.startswith("_"))]


def _load() -> None:
    for name in _modules([m.name for m in pkgutil.iter_modules([os.path.dirname(__file__)])]):
        importlib.import_module(f"{__package__}.{name}")


_load()
from .fashion import (FASHION_MNIST_MEAN, FASHION_MNIST_STD, cache_dir, fashion_mnist_dir,  # noqa: E402
                      load_fashion_mnist, read_idx)
from .own import CIFAR10_CLASSES, load_cifar10, load_npz  # noqa: E402

__all__ = ["CIFAR10_CLASSES", "DATASETS", "DataFormatError", "DataNotFoundError", "DataSource", "Dataset",
           "FASHION_MNIST_MEAN", "FASHION_MNIST_STD", "HOLDOUT_CAVEAT", "IdxFormatError", "cache_dir",
           "fashion_mnist_dir", "holdout", "keyed_split", "load_cifar10", "load_dataset", "load_fashion_mnist",
           "load_npz", "read_idx", "register_dataset", "stratified_split", "with_validation"]


def load_dataset(name: str, *, data_dir: str | os.PathLike | None = None, validation: int = 0,
                 key: SecretKey | None = None, image: bool = False,
                 data_path: str | os.PathLike | None = None) -> Dataset:
    """Load a data set by name, offline.

    Args:
        name: One of ``DATASETS``: ``fashion-mnist``, ``digits``, ``digits-image``, ``breast-cancer``,
            ``wine``, ``cifar10``, ``npz``.
        data_dir: Overrides the Fashion-MNIST directory, and is where ``cifar10`` is read from.
        validation: When > 0, moves about that many training examples into ``x_val``/``y_val``: each joins
            independently with probability ``validation / N``, by its keyed draw under ``key``
            (``with_validation``); the test split never changes.
        key: A ``clipbias.randomness.SecretKey``, required with ``validation``.
        image: ``True`` (or the name ``digits-image``) shapes ``digits`` as 1x8x8 images instead of 64 flat
            features.
        data_path: The file ``npz`` reads (see ``load_npz``).

    Returns:
        A ``Dataset`` of in-memory tensors (``x_train``, ``y_train``, ``x_test``, ``y_test``, ...).

    Raises:
        ConfigError: an unknown name, a negative ``validation``, or ``validation`` without ``key``.
        DataNotFoundError: the data set's files are missing (the message says how to install them).
        DataFormatError: a file that is not in the data set's format (a malformed ``npz`` array, ...).
    """
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if validation < 0:
        raise ConfigError(f"validation must be >= 0, got {validation}")
    if validation and key is None:
        raise ConfigError("load_dataset(validation=...) needs key=: the SecretKey whose draws choose the validation "
                          "part (a run's key; SecretKey.generate() for a fresh one)")
    ds = DATASETS[name].load(data_dir=data_dir, data_path=data_path, image=image)
    return with_validation(ds, validation, key)
