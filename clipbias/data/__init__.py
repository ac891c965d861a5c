"""The data, before any sampling: real offline data sets (``catalog``: ``load_dataset`` and Fashion-MNIST from Debian,
scikit-learn's sets, CIFAR-10 and npz files), E2E NLG text for causal language models (``text``) and
the batch structures every later stage walks (``batch``: tensors, tuples, lists and dicts)."""

from .catalog import (CIFAR10_CLASSES, DATASETS, DataFormatError, DataNotFoundError, DataSource, Dataset,
                       FASHION_MNIST_MEAN, FASHION_MNIST_STD, IdxFormatError, cache_dir, fashion_mnist_dir,
                       HOLDOUT_CAVEAT, holdout, keyed_split, load_cifar10, load_dataset, load_fashion_mnist, load_npz,
                       read_idx, register_dataset, with_validation)

__all__ = ["CIFAR10_CLASSES", "DATASETS", "DataFormatError", "DataNotFoundError", "DataSource", "Dataset", "FASHION_MNIST_MEAN",
           "FASHION_MNIST_STD", "HOLDOUT_CAVEAT", "IdxFormatError", "cache_dir", "fashion_mnist_dir", "holdout", "keyed_split", "load_cifar10",
           "load_dataset", "load_fashion_mnist", "load_npz", "read_idx", "register_dataset", "with_validation"]
