"""Your own data: CIFAR-10 in its python layout (read by a restricted unpickler, so a tampered batch
cannot run code) and any arrays in an ``.npz`` file (used as given)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .dataset import DataFormatError, DataNotFoundError, DataSource, Dataset, register_dataset

CIFAR10_CLASSES = 10
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))


class _CifarUnpickler(pickle.Unpickler):
    """The CIFAR-10 python batches are pickles: load them without running arbitrary code (only
    the numpy reconstruction functions a batch file needs are allowed)."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR-10 batch file")
        return super().find_class(module, name)


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            d = _CifarUnpickler(f, encoding="bytes").load()
        x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        y = np.asarray(d[b"labels"], dtype=np.int64)
    except (OSError, pickle.UnpicklingError, KeyError, ValueError, TypeError, EOFError) as e:
        raise DataFormatError(f"{path} is not a CIFAR-10 python batch ({type(e).__name__}: {e}); re-extract "
                              f"cifar-10-python.tar.gz") from e
    if len(x) != len(y) or (len(y) and (y.min() < 0 or y.max() >= CIFAR10_CLASSES)):
        raise DataFormatError(f"{path}: {len(x)} images and {len(y)} labels, labels in "
                              f"[{y.min() if len(y) else '-'}, {y.max() if len(y) else '-'}]: CIFAR-10 has one label "
                              f"in 0..9 per image; re-extract cifar-10-python.tar.gz")
    return x, y


def load_cifar10(data_dir: str | os.PathLike | None) -> Dataset:
    """CIFAR-10 from the standard python layout ``DIR/cifar-10-batches-py/{data_batch_1..5,
    test_batch}`` (``DIR`` may also be that folder itself). Nothing is downloaded. Pixels scaled to
    [-1, 1] by the public constants 0.5/0.5 (no statistic of the private data)."""
    if data_dir is None:
        raise DataNotFoundError("`data='cifar10'` needs `data_dir` DIR, where DIR/cifar-10-batches-py/ holds "
                                "data_batch_1 ... data_batch_5 and test_batch (the python version, "
                                "cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, extracted)")
    base = Path(data_dir)
    folder = base if (base / "test_batch").exists() else base / _CIFAR_DIR
    missing = [n for n in _CIFAR_TRAIN + ("test_batch",) if not (folder / n).is_file()]
    if missing:
        raise DataNotFoundError(f"CIFAR-10 not found: {folder} lacks {', '.join(missing)}. Extract "
                                f"cifar-10-python.tar.gz (the python version) into {base}, so that "
                                f"{base / _CIFAR_DIR}/data_batch_1 ... test_batch exist")
    parts = [_cifar_batch(folder / n) for n in _CIFAR_TRAIN]
    x_te, y_te = _cifar_batch(folder / "test_batch")

    def scale(x: np.ndarray) -> Tensor:
        return (torch.from_numpy(x).float() / 255 - 0.5) / 0.5
    return Dataset(name="cifar10", x_train=scale(np.concatenate([p[0] for p in parts])),
                   y_train=torch.from_numpy(np.concatenate([p[1] for p in parts])), x_test=scale(x_te),
                   y_test=torch.from_numpy(y_te), num_classes=CIFAR10_CLASSES, input_shape=(3, 32, 32),
                   notes="pixels/255 then (x-0.5)/0.5: public constants, no statistic of the private data.")


def load_npz(path: str | os.PathLike | None) -> Dataset:
    """Any classification data as one ``.npz`` file with arrays ``x_train``, ``y_train``, ``x_test``,
    ``y_test`` (features of any per-example shape, finite; integer labels from 0) and optionally
    ``num_classes``. Used as given: any preprocessing is the user's, and so is its privacy."""
    if path is None:
        raise DataNotFoundError("`data='npz'` needs `data_path` FILE.npz holding arrays x_train, y_train, x_test, y_test")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError as e:
        raise DataNotFoundError(f"`data_path='{path}'`: no such file") from e
    except (OSError, ValueError, EOFError) as e:
        raise DataFormatError(f"`data_path='{path}'` is not a readable .npz file ({type(e).__name__}: {e}); write "
                              f"it with numpy.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)") from e
    missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in arrays]
    if missing:
        raise DataFormatError(f"`data_path='{path}'` lacks {', '.join(missing)} (it has {', '.join(sorted(arrays)) or 'nothing'}); "
                              f"write it with numpy.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)")
    return _npz_dataset(arrays, str(path))


def _npz_dataset(a: dict, path: str) -> Dataset:
    xs, ys = {}, {}
    for split in ("train", "test"):
        x, y = a[f"x_{split}"], a[f"y_{split}"]
        if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or not len(y):
            raise DataFormatError(f"{path}: x_{split} {x.shape} and y_{split} {y.shape} must be one row and one "
                                  f"label per example (x: [n, ...], y: [n], n >= 1)")
        if not np.issubdtype(y.dtype, np.integer):
            raise DataFormatError(f"{path}: y_{split} has dtype {y.dtype}; labels must be integers 0..K-1")
        if not (np.issubdtype(x.dtype, np.number) and np.isfinite(x).all()):
            raise DataFormatError(f"{path}: x_{split} must be finite numbers (dtype {x.dtype})")
        xs[split], ys[split] = torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))
    if xs["train"].shape[1:] != xs["test"].shape[1:]:
        raise DataFormatError(f"{path}: x_train examples are {tuple(xs['train'].shape[1:])} but x_test examples "
                              f"{tuple(xs['test'].shape[1:])}")
    k = int(a["num_classes"]) if "num_classes" in a else int(max(ys["train"].max(), ys["test"].max())) + 1
    lo, hi = min(int(ys["train"].min()), int(ys["test"].min())), max(int(ys["train"].max()), int(ys["test"].max()))
    if lo < 0 or hi >= k:
        raise DataFormatError(f"{path}: labels range over [{lo}, {hi}], outside 0..num_classes-1 = 0..{k - 1}")
    return Dataset(name="npz", x_train=xs["train"], y_train=ys["train"], x_test=xs["test"], y_test=ys["test"],
                   num_classes=k, input_shape=tuple(xs["train"].shape[1:]),
                   notes=f"{path}, used as given: its preprocessing is the user's and not covered by clipbias.",
                   preprocessing="none")


register_dataset(DataSource("cifar10", lambda *, data_dir=None, **_: load_cifar10(data_dir),
                            "CIFAR-10's python batches under data_dir"))
register_dataset(DataSource("npz", lambda *, data_path=None, **_: load_npz(data_path),
                            "your own arrays in an .npz file (data_path)"))
