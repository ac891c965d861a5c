"""Real data sets, loaded offline: Fashion-MNIST (Debian files) and three scikit-learn sets.

One entry point, :func:`load_dataset`, returns a :class:`Dataset` of in-memory tensors.
Everything here is deterministic: the test split is fixed, the validation split (carved
out of the *training* split, for hyper-parameter tuning that never looks at the test set)
depends only on ``seed``.

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

import dataclasses
import gzip
import hashlib
import os
import pickle
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from .errors import ClipbiasError

__all__ = [
    "DATASET_NAMES",
    "DataNotFoundError",
    "Dataset",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "IdxFormatError",
    "cache_dir",
    "fashion_mnist_dir",
    "holdout",
    "load_dataset",
    "load_fashion_mnist",
    "read_idx",
]

FASHION_MNIST_MEAN = 0.2860
"""Public Fashion-MNIST pixel mean (of [0, 1] pixels); a constant, not computed here."""
FASHION_MNIST_STD = 0.3530
"""Public Fashion-MNIST pixel standard deviation (of [0, 1] pixels)."""

DEFAULT_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_CLASSES = 10
_FASHION_FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}
_CACHE_FORMAT = 1  # bump when the decoded layout or normalisation changes

DATASET_NAMES = ("fashion-mnist", "digits", "digits-image", "breast-cancer", "wine", "cifar10", "npz")
CIFAR10_CLASSES = 10
_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
"""Names accepted by :func:`load_dataset` (``digits-image`` = ``digits`` shaped 1x8x8)."""

SKLEARN_TEST_SIZE = 0.25
SKLEARN_SPLIT_SEED = 0


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


# --------------------------------------------------------------------------- idx files

_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | os.PathLike, expect_ndim: int | None = None) -> np.ndarray:
    """Parse an idx file (gzip-compressed when the name ends in ``.gz``) into an array.

    The idx header is two zero bytes, a dtype code, the number of dimensions, then one
    big-endian uint32 per dimension. Raises :class:`IdxFormatError` on a bad magic
    number, an unexpected number of dimensions, or a truncated/oversized payload.
    """
    path = Path(path)
    opener: Callable = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        if isinstance(exc, FileNotFoundError):
            raise
        raise IdxFormatError(f"{path}: cannot decompress/read idx file ({exc}); "
                             "the file is corrupt, re-install or re-download it") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        magic = raw[:4].hex() if raw else "<empty>"
        raise IdxFormatError(f"{path}: bad idx magic number 0x{magic}; expected "
                             "00 00 <dtype code> <ndim> (e.g. 0x00000803 for images)")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    if expect_ndim is not None and ndim != expect_ndim:
        raise IdxFormatError(f"{path}: idx file has {ndim} dimensions, expected {expect_ndim}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxFormatError(f"{path}: truncated idx header")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise IdxFormatError(f"{path}: idx payload has {len(raw) - header} bytes, header "
                             f"shape {shape} needs {expected}; the file is corrupt")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


# --------------------------------------------------------------------------- Fashion-MNIST

def fashion_mnist_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the Fashion-MNIST idx files: argument, else ``$CLIPBIAS_FASHION_MNIST_DIR``,
    else the Debian location ``/usr/share/datasets/fashion-mnist``."""
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get("CLIPBIAS_FASHION_MNIST_DIR")
    return Path(env) if env else DEFAULT_FASHION_MNIST_DIR


def cache_dir() -> Path:
    """Where decoded tensors are cached: ``$CLIPBIAS_CACHE_DIR`` or ``~/.cache/clipbias``."""
    env = os.environ.get("CLIPBIAS_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "clipbias"


def _fashion_paths(directory: Path) -> dict[str, Path]:
    paths = {k: directory / f for k, f in _FASHION_FILES.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise DataNotFoundError(
            f"Fashion-MNIST files not found: {', '.join(missing)}. They come from the Debian "
            f"package {FASHION_MNIST_PACKAGE}; install it with "
            f"`apt-get install -y {FASHION_MNIST_PACKAGE}`, or point "
            "CLIPBIAS_FASHION_MNIST_DIR (or data_dir=) at a directory holding "
            f"{', '.join(_FASHION_FILES.values())}.")
    return paths


def _cache_key(paths: dict[str, Path]) -> str:
    """Key from each file's resolved path, size and mtime: a changed file invalidates it."""
    h = hashlib.sha256(f"fashion-mnist-v{_CACHE_FORMAT}".encode())
    for key in sorted(paths):
        st = paths[key].stat()
        h.update(f"{key}:{paths[key].resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:20]


def _decode_fashion(paths: dict[str, Path]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for split in ("train", "test"):
        images = read_idx(paths[f"x_{split}"], expect_ndim=3)
        labels = read_idx(paths[f"y_{split}"], expect_ndim=1)
        if images.shape[1:] != (28, 28) or images.shape[0] != labels.shape[0]:
            raise IdxFormatError(f"Fashion-MNIST {split}: images {images.shape} and labels "
                                 f"{labels.shape} do not fit together")
        bad = np.flatnonzero(labels >= FASHION_MNIST_CLASSES)
        if len(bad):  # a corrupted label byte would otherwise add classes to the model silently
            raise IdxFormatError(f"{paths[f'y_{split}']}: label {int(labels[bad[0]])} at index {int(bad[0])} "
                                 f"({len(bad)} label(s) in all) is outside Fashion-MNIST's classes "
                                 f"0..{FASHION_MNIST_CLASSES - 1}: the file is corrupted; reinstall it with "
                                 f"`apt-get install --reinstall {FASHION_MNIST_PACKAGE}`")
        x = torch.from_numpy(images.astype(np.float32)).div_(255.0)
        x = x.sub_(FASHION_MNIST_MEAN).div_(FASHION_MNIST_STD).unsqueeze(1)
        out[f"x_{split}"] = x.contiguous()
        out[f"y_{split}"] = torch.from_numpy(labels.astype(np.int64))
    return out


def load_fashion_mnist(data_dir: str | os.PathLike | None = None, *,
                       use_cache: bool = True) -> dict[str, Tensor]:
    """Decoded, normalised Fashion-MNIST: ``x_train`` (60000, 1, 28, 28), ``y_train``
    (60000,), ``x_test`` (10000, 1, 28, 28), ``y_test`` (10000,).

    Decodes the idx files once and caches the tensors with ``torch.save`` under
    :func:`cache_dir`; the cache file name depends on the files' size and mtime, so
    replacing a file invalidates it. A damaged cache file is ignored and rewritten.
    """
    paths = _fashion_paths(fashion_mnist_dir(data_dir))
    cache_file = cache_dir() / f"fashion-mnist-{_cache_key(paths)}.pt"
    if use_cache and cache_file.is_file():
        try:
            tensors = torch.load(cache_file, weights_only=True)
            if set(tensors) == set(_FASHION_FILES):
                return tensors
        except Exception:  # corrupt/partial cache: fall through and rebuild it
            pass
    tensors = _decode_fashion(paths)
    if use_cache:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
            torch.save(tensors, tmp)
            os.replace(tmp, cache_file)
        except OSError:  # read-only home etc.: caching is an optimisation only
            pass
    return tensors


# --------------------------------------------------------------------------- scikit-learn sets

def _sklearn_arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn import datasets as skd

    loader = {"digits": skd.load_digits, "breast-cancer": skd.load_breast_cancer,
              "wine": skd.load_wine}[name]
    bunch = loader()
    return np.asarray(bunch.data, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)


def _split(y: np.ndarray, size: int | float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of ``arange(len(y))`` into (keep, taken) index arrays."""
    from sklearn.model_selection import train_test_split

    keep, taken = train_test_split(np.arange(len(y)), test_size=size, random_state=seed,
                                   stratify=y)
    return np.sort(keep), np.sort(taken)


# --------------------------------------------------------------------------- entry point

def load_dataset(name: str, *, data_dir: str | os.PathLike | None = None, validation: int = 0,
                 seed: int = 0, image: bool = False, data_path: str | os.PathLike | None = None) -> Dataset:
    """Load a data set by name (see :data:`DATASET_NAMES`).

    ``validation > 0`` moves that many training examples (stratified, chosen by ``seed``)
    into ``x_val``/``y_val``; the test split never changes. ``image=True`` (or the name
    ``digits-image``) shapes ``digits`` as 1x8x8 images instead of 64 flat features.
    ``data_dir`` overrides the Fashion-MNIST directory and is where ``cifar10`` is read from;
    ``npz`` reads ``data_path`` (see :func:`load_npz`).
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if validation < 0:
        raise ValueError(f"validation must be >= 0, got {validation}")
    if name == "digits-image":
        name, image = "digits", True

    if name in ("cifar10", "npz"):
        ds = load_cifar10(data_dir) if name == "cifar10" else load_npz(data_path)
        return with_validation(ds, validation, seed)
    if name == "fashion-mnist":
        t = load_fashion_mnist(data_dir)
        ds = Dataset(name=name, x_train=t["x_train"], y_train=t["y_train"], x_test=t["x_test"], y_test=t["y_test"],
                     num_classes=FASHION_MNIST_CLASSES, input_shape=(1, 28, 28),
                     notes=(f"pixels/255 then (x-{FASHION_MNIST_MEAN})/{FASHION_MNIST_STD}: public constants, no "
                            "statistic of the private data. Row-by-row sequence view: x.view(-1, 28, 28)."))
        return with_validation(ds, validation, seed)
    x, y = _sklearn_arrays(name)
    train, test = _split(y, SKLEARN_TEST_SIZE, SKLEARN_SPLIT_SEED)
    val = np.empty(0, dtype=np.int64)
    if validation:
        keep, val = _split(y[train], validation, seed)
        train, val = train[keep], train[val]
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
    x_val, y_val = take(val) if validation else (None, None)

    return Dataset(name=name, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te,
                   num_classes=int(max(y_tr.max(), y_te.max())) + 1, input_shape=tuple(shape), notes=notes,
                   x_val=x_val, y_val=y_val)


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


# --------------------------------------------------------------------------- your own data

def with_validation(ds: Dataset, validation: int, seed: int) -> Dataset:
    """``ds`` with ``validation`` training examples (stratified, chosen by ``seed``) moved to
    ``x_val``/``y_val``."""
    if not validation:
        return ds
    keep, val = _split(ds.y_train.numpy(), validation, seed)
    return dataclasses.replace(ds, x_train=ds.x_train[keep], y_train=ds.y_train[keep],
                               x_val=ds.x_train[val], y_val=ds.y_train[val])


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
        raise DataNotFoundError("--data cifar10 needs --data-dir DIR, where DIR/cifar-10-batches-py/ holds "
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
        raise DataNotFoundError("--data npz needs --data-path FILE.npz holding arrays x_train, y_train, x_test, y_test")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError as e:
        raise DataNotFoundError(f"--data-path {path}: no such file") from e
    except (OSError, ValueError, EOFError) as e:
        raise DataFormatError(f"--data-path {path} is not a readable .npz file ({type(e).__name__}: {e}); write "
                              f"it with numpy.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)") from e
    missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in arrays]
    if missing:
        raise DataFormatError(f"--data-path {path} lacks {', '.join(missing)} (it has {', '.join(sorted(arrays)) or 'nothing'}); "
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
