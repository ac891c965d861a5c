"""Your own data: CIFAR-10 from its python layout and any arrays from an .npz file (issue 16)."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch

from clipbias.cli import main
from clipbias.data.catalog import DataFormatError, DataNotFoundError, load_dataset
from clipbias.randomness import SecretKey


def fake_cifar(root, per_batch=4, seed=0):
    """The real layout (cifar-10-batches-py/data_batch_1..5, test_batch: pickled dicts with bytes keys,
    uint8 rows of 3072 = 3x32x32 pixels), with a few random images each."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        d = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
             b"labels": [int(v) for v in rng.integers(0, 10, per_batch)], b"batch_label": name.encode()}
        with open(folder / name, "wb") as f:
            pickle.dump(d, f, protocol=2)
    return root


def test_cifar10_loads_the_python_layout_with_public_scaling(tmp_path):
    ds = load_dataset("cifar10", data_dir=fake_cifar(tmp_path))
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        first = pickle.load(f, encoding="bytes")
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
    assert ds.num_classes == 10 and ds.input_shape == (3, 32, 32) and ds.preprocessing == "public"
    # pixel p -> (p/255 - 0.5)/0.5, row-major channels first, as CIFAR-10 stores them
    want = (torch.from_numpy(first[b"data"][0].astype(np.float32)).view(3, 32, 32) / 255 - 0.5) / 0.5
    torch.testing.assert_close(ds.x_train[0], want)
    assert ds.y_train[:4].tolist() == first[b"labels"]


def test_cifar10_errors_name_what_to_put_where(tmp_path):
    with pytest.raises(DataNotFoundError, match="`data_dir`"):
        load_dataset("cifar10")
    with pytest.raises(DataNotFoundError, match="cifar-10-batches-py.*data_batch_1"):
        load_dataset("cifar10", data_dir=tmp_path)
    fake_cifar(tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_3", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(DataFormatError, match="data_batch_3.*not allowed"):
        load_dataset("cifar10", data_dir=tmp_path)
    assert not (tmp_path / "pwned").exists()  # the pickle's code never ran


def _npz(path, **over):
    rng = np.random.default_rng(0)
    a = {"x_train": rng.normal(size=(30, 4, 3)).astype(np.float32), "y_train": rng.integers(0, 3, 30),
         "x_test": rng.normal(size=(10, 4, 3)).astype(np.float32), "y_test": rng.integers(0, 3, 10)}
    a.update(over)
    np.savez(path, **{k: v for k, v in a.items() if v is not None})
    return path


def test_npz_loads_any_shape_as_given(tmp_path):
    f = _npz(tmp_path / "d.npz", num_classes=np.array(5))
    ds = load_dataset("npz", data_path=f, validation=15, key=SecretKey.from_seed(0))
    raw = np.load(f)
    assert ds.input_shape == (4, 3) and ds.num_classes == 5 and ds.preprocessing == "none"
    assert len(ds.y_train) + len(ds.y_val) == 30 and len(ds.y_val) > 0
    torch.testing.assert_close(ds.x_test, torch.from_numpy(raw["x_test"]))


@pytest.mark.parametrize("over,match", [
    ({"y_test": None}, "lacks y_test"),
    ({"y_train": np.zeros(30)}, "dtype float64; labels must be integers"),
    ({"y_train": np.full(30, 7), "num_classes": np.array(5)}, r"\[0, 7\], outside 0..num_classes-1 = 0..4"),
    ({"x_train": np.full((30, 4, 3), np.nan)}, "x_train must be finite"),
    ({"x_test": np.zeros((10, 5))}, r"x_train examples are \(4, 3\) but x_test examples \(5,\)"),
    ({"y_train": np.zeros(29, dtype=int)}, "one row and one label per example"),
])
def test_npz_errors_name_the_bad_array(tmp_path, over, match):
    with pytest.raises(DataFormatError, match=match):
        load_dataset("npz", data_path=_npz(tmp_path / "d.npz", **over))


def test_npz_missing_file_and_missing_flag(tmp_path):
    with pytest.raises(DataNotFoundError, match="`data_path`"):
        load_dataset("npz")
    with pytest.raises(DataNotFoundError, match="no such file"):
        load_dataset("npz", data_path=tmp_path / "nope.npz")


@pytest.mark.parametrize("kind", ["npz", "cifar10"])
def test_train_on_your_own_data_end_to_end(tmp_path, kind, capsys):
    # CIFAR-10: one image per file (N = 5, B = 5: one full batch). The cnn's fast path times its convolution
    # kernels once per bucket of batch sizes, and with 20 images Poisson batches of 1-10 visited three buckets
    # (10 s of CPU); the layout, the loader and the cnn on 3x32x32 inputs are what this run checks
    src = _npz(tmp_path / "d.npz") if kind == "npz" else fake_cifar(tmp_path / "c", per_batch=1)
    flag = ["--data-path", src] if kind == "npz" else ["--data-dir", src]
    model = "mlp" if kind == "npz" else "cnn"
    code = main([str(a) for a in ["train", "--data", kind, *flag, "--model", model, "--algo", "dpsgd", "--epochs", 1,
                                  "--batch-size", 5, "--lr", 0.1, "--noise-multiplier", 1.0, "--out", tmp_path / "run",
                                  "--quiet"]])
    assert code == 0, capsys.readouterr().err
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["config"]["data"] == kind and 0 <= res["test_accuracy"] <= 1 and res["epsilon"] > 0
