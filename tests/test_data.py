"""Tests for clipbias.data.catalog: idx parsing, Fashion-MNIST loading/caching, sklearn splits."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from clipbias.data import fashion as cd
from clipbias.data.catalog import DataNotFoundError, IdxFormatError, holdout, keyed_split, load_dataset, read_idx
from clipbias.errors import ConfigError
from clipbias.randomness import Purpose, SecretKey

FASHION_DIR = cd.DEFAULT_FASHION_MNIST_DIR
HAVE_FASHION = all((FASHION_DIR / f).is_file() for f in cd._FASHION_FILES.values())
needs_fashion = pytest.mark.skipif(
    not HAVE_FASHION, reason=f"Fashion-MNIST not installed in {FASHION_DIR} "
    "(apt-get install -y dataset-fashion-mnist)")


def write_idx(path: Path, array: np.ndarray, code: int = 0x08) -> None:
    """Write ``array`` as a gzip idx file (uint8 payload)."""
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def write_fake_fashion(directory: Path, n_train: int = 6, n_test: int = 4) -> None:
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("t10k", n_test)):
        write_idx(directory / f"{split}-images-idx3-ubyte.gz",
                  rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(directory / f"{split}-labels-idx1-ubyte.gz",
                  np.arange(n, dtype=np.uint8) % 10)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test caches into a private temporary directory, never ~/.cache."""
    monkeypatch.setenv("CLIPBIAS_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("CLIPBIAS_FASHION_MNIST_DIR", raising=False)


# ------------------------------------------------------------------ idx parser

def test_read_idx_images_and_labels(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    labels = np.array([7, 1], dtype=np.uint8)
    write_idx(tmp_path / "img.gz", images)
    write_idx(tmp_path / "lab.gz", labels)
    np.testing.assert_array_equal(read_idx(tmp_path / "img.gz", expect_ndim=3), images)
    np.testing.assert_array_equal(read_idx(tmp_path / "lab.gz", expect_ndim=1), labels)


def test_read_idx_uncompressed_big_endian_int(tmp_path):
    values = np.array([1, -2, 70000], dtype=">i4")
    (tmp_path / "v.idx").write_bytes(bytes([0, 0, 0x0C, 1]) + struct.pack(">I", 3) + values.tobytes())
    np.testing.assert_array_equal(read_idx(tmp_path / "v.idx"), [1, -2, 70000])


def test_read_idx_bad_magic(tmp_path):
    with gzip.open(tmp_path / "bad.gz", "wb") as fh:
        fh.write(b"\x12\x34\x08\x01" + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(IdxFormatError, match="magic"):
        read_idx(tmp_path / "bad.gz")


def test_read_idx_wrong_ndim_truncated_and_not_gzip(tmp_path):
    write_idx(tmp_path / "lab.gz", np.zeros(3, dtype=np.uint8))
    with pytest.raises(IdxFormatError, match="dimensions"):
        read_idx(tmp_path / "lab.gz", expect_ndim=3)
    with gzip.open(tmp_path / "short.gz", "wb") as fh:  # header says 5 bytes, holds 2
        fh.write(bytes([0, 0, 8, 1]) + struct.pack(">I", 5) + b"\x01\x02")
    with pytest.raises(IdxFormatError, match="corrupt"):
        read_idx(tmp_path / "short.gz")
    (tmp_path / "junk.gz").write_bytes(b"this is not gzip data at all")
    with pytest.raises(IdxFormatError, match="corrupt"):
        read_idx(tmp_path / "junk.gz")


# ------------------------------------------------------------------ Fashion-MNIST

def test_missing_dir_error_names_package_and_command(tmp_path):
    with pytest.raises(DataNotFoundError) as info:
        load_dataset("fashion-mnist", data_dir=tmp_path / "nowhere")
    assert isinstance(info.value, FileNotFoundError)
    assert "dataset-fashion-mnist" in str(info.value)
    assert "apt-get install -y dataset-fashion-mnist" in str(info.value)


def test_env_var_and_argument_override_dir(tmp_path, monkeypatch):
    write_fake_fashion(tmp_path)
    monkeypatch.setenv("CLIPBIAS_FASHION_MNIST_DIR", str(tmp_path))
    d = load_dataset("fashion-mnist")
    assert d.x_train.shape == (6, 1, 28, 28) and d.x_test.shape == (4, 1, 28, 28)
    monkeypatch.setenv("CLIPBIAS_FASHION_MNIST_DIR", str(tmp_path / "nowhere"))
    assert load_dataset("fashion-mnist", data_dir=tmp_path).y_train.tolist() == list(range(6))


def test_fake_fashion_normalisation_and_cache_invalidation(tmp_path, capsys):
    write_fake_fashion(tmp_path)
    d1 = load_dataset("fashion-mnist", data_dir=tmp_path)
    (cache_file,) = cd.cache_dir().glob("fashion-mnist-*.pt")
    assert f"Fashion-MNIST decoded once and cached in {cache_file} (0 MB; `clipbias cache --clear`" in capsys.readouterr().err
    raw = read_idx(tmp_path / "train-images-idx3-ubyte.gz").astype(np.float32)
    expected = (raw / 255.0 - cd.FASHION_MNIST_MEAN) / cd.FASHION_MNIST_STD
    np.testing.assert_allclose(d1.x_train[:, 0].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert d1.preprocessing == "public" and "x.view(-1, 28, 28)" in d1.notes
    assert len(list(cd.cache_dir().glob("fashion-mnist-*.pt"))) == 1
    # a changed file (new size/mtime) must not be served from the old cache
    write_fake_fashion(tmp_path, n_train=8)
    os.utime(tmp_path / "train-images-idx3-ubyte.gz", ns=(1, 1))
    d2 = load_dataset("fashion-mnist", data_dir=tmp_path)
    assert d2.x_train.shape[0] == 8
    assert len(list(cd.cache_dir().glob("fashion-mnist-*.pt"))) == 2


def test_corrupt_cache_is_rebuilt(tmp_path):
    write_fake_fashion(tmp_path)
    d1 = load_dataset("fashion-mnist", data_dir=tmp_path)
    (cache_file,) = cd.cache_dir().glob("fashion-mnist-*.pt")
    cache_file.write_bytes(b"garbage")
    d2 = load_dataset("fashion-mnist", data_dir=tmp_path)
    assert torch.equal(d1.x_train, d2.x_train)


@needs_fashion
def test_fashion_mnist_real_load_and_cache_hit():
    d = load_dataset("fashion-mnist")
    assert d.x_train.shape == (60000, 1, 28, 28) and d.y_train.shape == (60000,)
    assert d.x_test.shape == (10000, 1, 28, 28) and d.y_test.shape == (10000,)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert d.num_classes == 10 and d.input_shape == (1, 28, 28)
    assert int(d.y_train.min()) == 0 and int(d.y_train.max()) == 9
    assert torch.bincount(d.y_train).tolist() == [6000] * 10
    # the public constants really are the data's statistics (sanity, not used privately)
    assert abs(float(d.x_train.mean())) < 0.01 and abs(float(d.x_train.std()) - 1) < 0.01
    assert len(list(cd.cache_dir().glob("fashion-mnist-*.pt"))) == 1
    again = load_dataset("fashion-mnist")
    for k in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(d, k), getattr(again, k))


@needs_fashion
def test_fashion_mnist_validation_split():
    d = load_dataset("fashion-mnist", validation=5000, key=SecretKey.from_seed(3))
    assert d.x_train.shape[0] + d.x_val.shape[0] == 60000 and d.x_val.shape[1:] == (1, 28, 28)
    assert abs(d.x_val.shape[0] - 5000) < 5 * 69  # Binomial(60000, 1/12): std 68
    assert d.x_test.shape[0] == 10000


# ------------------------------------------------------------------ scikit-learn sets

@pytest.mark.parametrize("name, n, features, classes", [
    ("digits", 1797, 64, 10), ("breast-cancer", 569, 30, 2), ("wine", 178, 13, 3)])
def test_sklearn_shapes(name, n, features, classes):
    d = load_dataset(name)
    assert d.x_train.shape[1:] == (features,) and d.input_shape == (features,)
    assert d.x_train.shape[0] + d.x_test.shape[0] == n
    assert d.x_test.shape[0] == int(np.ceil(0.25 * n))
    assert d.num_classes == classes and d.x_val is None and d.y_val is None
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert d.preprocessing == "public"


def test_digits_image_shape_and_fixed_scaling():
    flat, img = load_dataset("digits"), load_dataset("digits", image=True)
    assert img.x_train.shape[1:] == (1, 8, 8) and img.input_shape == (1, 8, 8)
    assert torch.equal(img.x_train.reshape(-1, 64), flat.x_train)
    assert load_dataset("digits-image").input_shape == (1, 8, 8)
    assert float(flat.x_train.min()) == 0.0 and float(flat.x_train.max()) == 1.0


@pytest.mark.parametrize("name", ["breast-cancer", "wine"])
def test_tabular_preprocessing_is_a_fixed_transform(name):
    """log1p of every feature: each example's features are a function of that example alone, so
    removing or changing one training example leaves every other example's inputs unchanged (a
    train-split standardisation moved them all: outside the guarantee)."""
    from sklearn import datasets as skd
    raw = {"breast-cancer": skd.load_breast_cancer, "wine": skd.load_wine}[name]().data
    d = load_dataset(name)
    ours = torch.cat([d.x_train, d.x_test]).double()
    want = torch.from_numpy(np.log1p(raw)).float().double()
    assert _rows(ours.float()) == _rows(want.float())  # the same rows, in the split's order
    assert d.preprocessing == "public" and "fixed transform" in d.notes


def _rows(x: torch.Tensor) -> set[bytes]:
    return {r.numpy().tobytes() for r in x.reshape(x.shape[0], -1)}


@pytest.mark.parametrize("name", ["digits", "breast-cancer", "wine"])
def test_split_determinism_no_overlap_and_validation(name):
    a, b = load_dataset(name), load_dataset(name)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not _rows(a.x_train) & _rows(a.x_test)
    v = load_dataset(name, validation=30, key=SecretKey.from_seed(1))
    assert v.y_val.shape == (len(v.x_val),) and 0 < len(v.y_val) < 60
    assert v.x_train.shape[0] + v.x_val.shape[0] == a.x_train.shape[0]
    assert torch.equal(v.y_test, a.y_test)  # the test split never moves
    assert not _rows(v.x_val) & _rows(v.x_test) and not _rows(v.x_val) & _rows(v.x_train)
    w = load_dataset(name, validation=30, key=SecretKey.from_seed(1))
    assert torch.equal(v.x_val, w.x_val)
    other = load_dataset(name, validation=30, key=SecretKey.from_seed(2))
    assert not torch.equal(v.y_val, other.y_val) or not torch.equal(v.x_val, other.x_val)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="validation"):
        load_dataset("wine", validation=-1)
    with pytest.raises(ConfigError, match="key="):  # a private split never falls back to a public seed
        load_dataset("wine", validation=10)
    with pytest.raises(ConfigError, match="SecretKey"):
        keyed_split(0, Purpose.VALIDATION_SPLIT, 10, 0.5)


def test_holdout():
    d, key = load_dataset("digits"), SecretKey.generate()
    rest, public = holdout(d, 100, key)
    assert public.shape[1:] == (64,) and rest.num_train == d.num_train - len(public) and 50 < len(public) < 150
    assert rest.y_train.shape[0] == rest.x_train.shape[0]
    assert not _rows(public) & _rows(rest.x_train)
    assert torch.equal(holdout(d, 100, key)[1], public)
    assert torch.equal(rest.x_test, d.x_test)
    with pytest.raises(ConfigError):
        holdout(d, d.num_train, key)


@pytest.mark.parametrize("n, k", [(40, 5), (1347, 200), (5000, 1), (5000, 2500)])
def test_a_keyed_split_moves_no_other_example_when_one_is_added_or_removed(n, k):
    """The attack on the seeded stratified split: adding one example moved a median of 14 others
    between the parts (digits, validation 100). A keyed split draws each example's part from its own
    address (purpose, 0, index): with the rate fixed (K/N of the data set as given, public), adding an
    example at index N or removing the last moves none of the others, under any key."""
    moved = []
    for seed in range(20):
        key = SecretKey.from_seed(seed)
        for purpose in (Purpose.VALIDATION_SPLIT, Purpose.HOLDOUT):
            base = keyed_split(key, purpose, n, k / n)
            grown, shrunk = keyed_split(key, purpose, n + 1, k / n), keyed_split(key, purpose, n - 1, k / n)
            moved += [int((grown[:n] != base).sum()), int((shrunk != base[:n - 1]).sum())]
            assert torch.equal(base, keyed_split(key, purpose, n, k / n))  # a pure function of key and index
    assert moved == [0] * len(moved)
    taken = sum(int(keyed_split(SecretKey.from_seed(s), Purpose.VALIDATION_SPLIT, n, k / n).sum()) for s in range(20))
    assert abs(taken / 20 - k) < 4 * (k * (1 - k / n) / 20) ** 0.5 + 0.5  # the expected size is K


def test_the_validation_and_holdout_draws_are_independent_streams():
    key, n = SecretKey.from_seed(7), 4000
    val = keyed_split(key, Purpose.VALIDATION_SPLIT, n, 0.5)
    held = keyed_split(key, Purpose.HOLDOUT, n, 0.5)
    assert not torch.equal(val, held) and abs(int((val & held).sum()) - 1000) < 150  # independent halves


def test_corrupted_label_byte_is_a_clear_error_not_a_new_class(tmp_path):
    """One label byte of 200 used to build a 201-class model silently (issue 17)."""
    write_fake_fashion(tmp_path)
    labels = np.arange(6, dtype=np.uint8) % 10
    labels[3] = 200
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", labels)
    with pytest.raises(IdxFormatError, match=r"label 200 at index 3 .*0\.\.9.*reinstall"):
        load_dataset("fashion-mnist", data_dir=tmp_path)
