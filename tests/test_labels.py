"""What a run certifies and what it releases outside the guarantee, said in every output: a key
derived from a seed, preprocessing with private statistics, validation metrics and training losses,
npz arrays used as given; old checkpoints with recoverable generator states are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from clipbias.cli import main
from clipbias.data.catalog import load_dataset
from clipbias.engine.core import SEEDED_CAVEAT, DPEngine
from clipbias.errors import ResumeMismatchError
from clipbias.randomness import SecretKey
from clipbias.run.report import PRIVATE_STATISTICS_CAVEAT
from clipbias.run.training import TrainConfig, export_weights, train

# digits, logistic regression, one epoch: about a second
BASE = TrainConfig(data="digits", model="logreg", algo="dpsgd", noise_multiplier=1.0, delta=1e-5, epochs=1,
                   batch_size=64, lr=0.5, clip=1.0, accountant="rdp")


def test_a_seeded_run_is_not_certified_in_results_console_and_export(tmp_path, capsys):
    seed = (1 << 255) + 12345  # every bit is used: a 256-bit seed
    code = main(["train", "--data", "digits", "--model", "logreg", "--algo", "dpsgd", "--noise-multiplier", "1",
                 "--epochs", "1", "--batch-size", "64", "--lr", "0.5", "--accountant", "rdp", "--quiet",
                 "--reproducible-noise", hex(seed), "--out", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 0 and out.count("unguessable") >= 2  # the header and the summary
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert res["certified"] is False and res["caveats"] == [SEEDED_CAVEAT]
    assert res["config"]["noise_seed"] == seed and "seed" in res["secret_randomness"]
    assert "NOT certified" in res["privacy_note"]
    meta = export_weights(tmp_path / "r", tmp_path / "w.pt")
    assert meta["certified"] is False and meta["caveats"] == [SEEDED_CAVEAT]
    # the same seed gives the same run; the default key is fresh and certified
    again = train(dataclasses.replace(BASE, reproducible_noise=True, noise_seed=seed))
    assert again["history"][-1]["train_loss"] == res["history"][-1]["train_loss"]
    fresh = train(BASE)
    assert fresh["certified"] is True and fresh["caveats"] == [] and "OS CSPRNG" in fresh["secret_randomness"]


@pytest.mark.parametrize("bad", ["-1", str(1 << 256), "0x", "seven"])
def test_a_bad_noise_seed_is_refused(bad, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--data", "digits", "--model", "logreg", "--algo", "dpsgd", "--epsilon", "1",
              "--epochs", "1", "--batch-size", "64", "--lr", "0.5", "--reproducible-noise", bad])
    assert "2^256" in capsys.readouterr().err


def test_released_statistics_are_named_and_private_statistics_void_the_guarantee(tmp_path):
    res = train(dataclasses.replace(BASE, validation=100))
    named = " ".join(res["outside_guarantee"])
    assert res["certified"] is True and "train_loss" in named and "val_accuracy" in named
    assert not any("val_accuracy" in s for s in train(BASE)["outside_guarantee"])
    ds = load_dataset("digits")
    ds = dataclasses.replace(ds, x_train=(ds.x_train - ds.x_train.mean(0)) / (ds.x_train.std(0) + 1e-6),
                             preprocessing="private-statistics")
    res = train(BASE, dataset=ds)
    assert res["certified"] is False and res["caveats"] == [PRIVATE_STATISTICS_CAVEAT]


def test_npz_arrays_are_used_as_given_and_the_header_says_so(tmp_path, capsys):
    import numpy as np
    g = np.random.default_rng(0)  # test data
    path = tmp_path / "d.npz"
    np.savez(path, x_train=g.normal(size=(200, 5)).astype(np.float32), y_train=g.integers(0, 3, 200),
             x_test=g.normal(size=(50, 5)).astype(np.float32), y_test=g.integers(0, 3, 50))
    code = main(["train", "--data", "npz", "--data-path", str(path), "--model", "logreg", "--algo", "dpsgd",
                 "--noise-multiplier", "1", "--epochs", "1", "--batch-size", "20", "--lr", "0.5", "--quiet",
                 "--accountant", "rdp", "--out", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 0 and "arrays used as given" in out and "NON-private" not in out
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert res["dataset"]["preprocessing"] == "none" and res["certified"] is True
    assert "used as given" in res["privacy_note"]


def test_a_checkpoint_with_torch_generator_states_is_refused():
    model = torch.nn.Linear(3, 2)
    eng = DPEngine(model, "dpsgd", n=50, batch_size=5, steps=3, noise_multiplier=1.0)
    state = eng.state_dict()
    old = {k: v for k, v in state.items() if k not in ("secret_key", "format")}  # an unversioned (old) state
    old["keyed_seed"] = 123
    with pytest.raises(ResumeMismatchError, match="32-bit seeds"):
        DPEngine(model, "dpsgd", n=50, batch_size=5, steps=3, noise_multiplier=1.0).load_state_dict(old)
    resumed = DPEngine(model, "dpsgd", n=50, batch_size=5, steps=3, noise_multiplier=1.0)
    resumed.load_state_dict(state)
    assert resumed.key == eng.key and resumed.sampler.key == eng.key and resumed.pipeline.noise.key == eng.key
    assert resumed.key != SecretKey.generate()


def _keys(node, prefix=""):
    """Every key of a JSON tree, with its path (lists walked through)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, f"{prefix}{k}"
            yield from _keys(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for v in node:
            yield from _keys(v, prefix)


def _named(outside: list[str]) -> set[str]:
    """The field names each outside_guarantee entry lists before its first colon."""
    import re
    return {w for entry in outside for w in re.findall(r"[A-Za-z_]+", entry.split(":")[0])}


def test_results_json_names_every_timing_and_size_field_it_holds(tmp_path):
    """A real run's results.json, walked key by key: every wall time (data-dependent: refusals, the fast
    path's probe rechecks) and every size (N as given, declared public; the realised sizes of the keyed
    validation split, private) is named in outside_guarantee."""
    code = main(["train", "--data", "digits", "--model", "logreg", "--algo", "dpsgd", "--noise-multiplier", "1",
                 "--epochs", "1", "--batch-size", "64", "--lr", "0.5", "--accountant", "rdp", "--quiet",
                 "--validation", "100", "--out", str(tmp_path / "r")])
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert code == 0 and res["certified"] is True
    fields = {k for k, _ in _keys(res) if k.endswith("_time_s") or k == "wall_time_per_epoch_s" or
              k == "n" or k.startswith(("n_", "num_")) or k in ("gradients", "grad_path_fallback")}
    assert {"wall_time_s", "epoch_time_s", "eval_time_s", "n", "n_given", "num_val", "gradients",
            "grad_path_fallback"} <= fields  # the path auto kept: decided on the first batch
    assert fields <= _named(res["outside_guarantee"]), fields - _named(res["outside_guarantee"])
    sizes = next(e for e in res["outside_guarantee"] if e.startswith("n,"))
    assert "private" in sizes and "keyed" in sizes  # with a keyed split the realised sizes are private
    info = res["dataset"]
    assert info["n"] + info["num_val"] == info["n_given"] == 1347 and res["n"] == info["n"]
    # q and the steps come from the public expected size N - K, not from the realised (private) n
    assert info["n_expected"] == 1247 and res["sample_rate"] == pytest.approx(64 / 1247)
    assert res["steps"] == round(1247 / 64)


def test_held_out_training_examples_used_as_public_features_void_the_certificate(tmp_path):
    """--public-source holdout: the held-out examples are private data BatchClipping reads as public
    features, unprotected: the run says so (certified false, the caveat) in the header, every epoch,
    the results and results.json; the same run with public test images stays certified."""
    from clipbias.data import HOLDOUT_CAVEAT, Dataset
    torch.manual_seed(0)
    ds = Dataset("toy", torch.randn(120, 1, 16, 16), torch.randint(0, 3, (120,)), torch.randn(40, 1, 16, 16),
                 torch.randint(0, 3, (40,)), 3, (1, 16, 16), preprocessing="public")
    cfg = dataclasses.replace(BASE, data="npz", model="cnn-gn", algo="batch-clip", batch_size=60,
                              public_source="holdout", extra={"public_size": 20, "p": 2, "draws": 1},
                              out=str(tmp_path / "h"))
    heads = []
    res = train(cfg, dataset=ds, on_start=heads.append, plot=False)
    assert res["certified"] is False and res["caveats"] == [HOLDOUT_CAVEAT] and "NOT certified" in res["privacy_note"]
    assert heads[0]["certified"] is False and heads[0]["caveats"] == [HOLDOUT_CAVEAT]
    assert res["history"][-1]["caveats"] == [HOLDOUT_CAVEAT]
    assert json.loads((tmp_path / "h" / "results.json").read_text())["caveats"] == [HOLDOUT_CAVEAT]
    info = res["dataset"]
    assert info["n"] + info["num_public"] == info["n_given"] == 120 and info["num_public"] > 0
    public = train(dataclasses.replace(cfg, public_source="test", out=None), dataset=ds)
    assert public["certified"] is True and public["caveats"] == []
