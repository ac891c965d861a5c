"""Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (idx files, gzip), decoded once and
cached; pixels scaled by the public constants 0.2860 / 0.3530 (nothing computed from the data)."""

from __future__ import annotations

import gzip
import hashlib
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from .dataset import DataNotFoundError, DataSource, Dataset, IdxFormatError, register_dataset

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
        else:
            print(f"Fashion-MNIST decoded once and cached in {cache_file} ({cache_file.stat().st_size / 2**20:.0f} MB; "
                  f"`clipbias cache --clear` deletes it)", file=sys.stderr, flush=True)
    return tensors


def fashion_mnist_dataset(*, data_dir: str | os.PathLike | None = None, **_) -> Dataset:
    """Fashion-MNIST as a ``Dataset`` (60000 training and 10000 test images, 1x28x28, 10 classes)."""
    t = load_fashion_mnist(data_dir)
    return Dataset(name="fashion-mnist", x_train=t["x_train"], y_train=t["y_train"], x_test=t["x_test"],
                   y_test=t["y_test"], num_classes=FASHION_MNIST_CLASSES, input_shape=(1, 28, 28),
                   notes=(f"pixels/255 then (x-{FASHION_MNIST_MEAN})/{FASHION_MNIST_STD}: public constants, no "
                          "statistic of the private data. Row-by-row sequence view: x.view(-1, 28, 28)."))


register_dataset(DataSource("fashion-mnist", fashion_mnist_dataset,
                            "Fashion-MNIST from the Debian package (or data_dir)"))
