"""The library training loop: results, checkpoints (private), resume equivalence, export, compare."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat

import pytest
import torch

from clipbias.engine.core import SEEDED_CAVEAT
from clipbias.errors import ConfigError, ResumeMismatchError
from clipbias.run.training import (CHECKPOINT, CURVES, PRIVATE_NOTE, RESULTS, TrainConfig, evaluate,
                                   export_weights, load_checkpoint, prepare_splits, run_many, train)
from tests.interrupt import Stop, interrupt_after_first_epoch

# digits: 1347 training examples, 64 features; B = 64 -> 21 steps per epoch, ~0.1 s per epoch.
BASE = TrainConfig(data="digits", model="mlp", algo="dice", epsilon=3.0, delta=1e-5, epochs=3,
                   batch_size=64, lr=0.5, clip=1.0, ef_clip=1.0 / 64, accountant="rdp")


# one epoch at a given noise multiplier: the tests of files, refusals and export need no calibration
ONE = dataclasses.replace(BASE, epochs=1, epsilon=None, noise_multiplier=2.0)


@pytest.fixture(scope="module")
def splits():
    return prepare_splits(BASE)



def _params(model_state: dict) -> dict:
    return {k: v.clone() for k, v in model_state.items()}


def test_results_files_and_private_checkpoint(tmp_path, splits):
    out = tmp_path / "run"
    res = train(dataclasses.replace(BASE, out=str(out)), splits=splits)
    assert res["certified"] is True and res["accountant"] == "pld" and "sound bound" in res["basis"]
    assert 0 < res["epsilon"] <= 3.0 and res["ef_ratio_r"] == pytest.approx(1.0)
    assert len(res["history"]) == 3 and res["steps"] == res["planned_steps"] == 3 * 21
    for key in ("config", "history", "test_accuracy", "epsilon", "delta", "accountant", "basis",
                "certified", "noise_multiplier", "wall_time_s", "wall_time_per_epoch_s"):
        assert key in res
    on_disk = json.loads((out / RESULTS).read_text())
    assert on_disk["epsilon"] == pytest.approx(res["epsilon"]) and on_disk["config"]["algo"] == "dice"
    assert (out / CURVES).stat().st_size > 1000
    ck_path = out / CHECKPOINT
    assert stat.S_IMODE(os.stat(ck_path).st_mode) == 0o600
    ck = load_checkpoint(out)
    assert ck["PRIVATE"] == PRIVATE_NOTE
    assert ck["epoch"] == 3 and len(ck["history"]) == 3 and ck["config"]["seed"] == 0
    ef = [s for s in ck["engine"]["pipeline"].values() if "e" in s]
    assert ef and ef[0]["e"] is not None  # the secret error-feedback buffer is in the checkpoint
    # the history's last epsilon is the final one, computed by the engine
    assert ck["history"][-1]["epsilon"] == pytest.approx(res["epsilon"])


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, splits):
    # two separate runs draw the same batches and noise only with --reproducible-noise
    full = train(dataclasses.replace(BASE, reproducible_noise=True, out=str(tmp_path / "a")), splits=splits)
    assert "user-given seed" in full["privacy_note"] and "secret" in full["privacy_note"]
    assert full["certified"] is False and full["caveats"] == [SEEDED_CAVEAT]

    cfg_b = dataclasses.replace(BASE, reproducible_noise=True, out=str(tmp_path / "b"))
    interrupt_after_first_epoch(cfg_b, splits)
    assert load_checkpoint(tmp_path / "b")["epoch"] == 1
    resumed = train(dataclasses.replace(cfg_b, resume=True), splits=splits)
    assert resumed["resumed"] is True
    a, b = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    ea = [s["e"] for s in a["engine"]["pipeline"].values() if "e" in s][0]
    eb = [s["e"] for s in b["engine"]["pipeline"].values() if "e" in s][0]
    assert torch.equal(ea, eb)
    assert resumed["epsilon"] == full["epsilon"]
    assert resumed["test_accuracy"] == full["test_accuracy"]
    assert [h["train_loss"] for h in resumed["history"]] == [h["train_loss"] for h in full["history"]]


def test_resume_refuses_changed_settings(tmp_path, splits):
    out = str(tmp_path / "r")
    cfg = dataclasses.replace(BASE, out=out)  # calibrated as in test_results_files_and_private_checkpoint
    train(cfg, splits=splits)
    for change, flag in [({"epsilon": 2.0}, "`epsilon"), ({"seed": 1}, "`seed`"),
                         ({"epochs": 2}, "`epochs"), ({"model": "logreg"}, "`model`"),
                         ({"clip": 0.5}, "`clip`"), ({"dice_accounting": "authors"}, "`dice_accounting`"),
                         ({"data": "wine"}, "`data`")]:
        with pytest.raises(ResumeMismatchError, match=flag):
            train(dataclasses.replace(cfg, resume=True, **change), splits=splits)


def test_engine_refuses_mismatched_privacy_state(tmp_path, splits):
    """Even if the config check were bypassed, DPEngine.load_state_dict refuses."""
    out = tmp_path / "t"
    cfg = dataclasses.replace(ONE, out=str(out))
    train(cfg, splits=splits)
    ck = torch.load(out / CHECKPOINT, weights_only=True)
    ck["engine"]["settings"]["delta"] = 1e-6
    torch.save(ck, out / CHECKPOINT)
    with pytest.raises(ResumeMismatchError, match="delta"):
        train(dataclasses.replace(cfg, resume=True), splits=splits)


def test_existing_run_needs_resume_or_overwrite(tmp_path, splits):
    cfg = dataclasses.replace(ONE, out=str(tmp_path / "x"))
    train(cfg, splits=splits)
    with pytest.raises(ConfigError, match="`resume=True`"):
        train(cfg, splits=splits)
    train(dataclasses.replace(cfg, overwrite=True), splits=splits)
    with pytest.raises(ConfigError, match="no checkpoint"):
        train(dataclasses.replace(cfg, out=str(tmp_path / "empty"), resume=True), splits=splits)


def test_an_interrupted_overwrite_never_mixes_old_and_new_files(tmp_path, splits):
    """--overwrite sets the old run aside (``.previous``) once the new run is built: interrupted after
    one epoch, the directory holds only the new run's checkpoint (no stale results.json or curves.png
    describing the old run) and the old run is whole in ``.previous``; a finished overwrite removes it."""
    out = tmp_path / "o"  # a given noise multiplier: no calibration needed to test the files
    cfg = dataclasses.replace(ONE, epochs=2, out=str(out), reproducible_noise=True)
    old = train(cfg, splits=splits)

    def stop(rec):
        raise Stop

    with pytest.raises(Stop):
        train(dataclasses.replace(cfg, overwrite=True, lr=0.25), splits=splits, on_epoch_end=stop)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [CHECKPOINT]
    assert load_checkpoint(out)["config"]["lr"] == 0.25 and load_checkpoint(out)["epoch"] == 1
    prev = out / ".previous"
    assert json.loads((prev / RESULTS).read_text())["test_accuracy"] == old["test_accuracy"]
    assert (prev / CURVES).is_file() and stat.S_IMODE(os.stat(prev / CHECKPOINT).st_mode) == 0o600
    train(dataclasses.replace(cfg, resume=True, lr=0.25), splits=splits)  # finish the new run
    train(dataclasses.replace(cfg, overwrite=True), splits=splits)
    assert not prev.exists() and (out / RESULTS).is_file()
    with pytest.raises(ConfigError, match="`model`"):  # a refused overwrite moves nothing
        train(dataclasses.replace(cfg, overwrite=True, model="nope"), splits=splits)
    assert (out / RESULTS).is_file() and not prev.exists()


def test_export_has_weights_only(tmp_path, splits):
    out = tmp_path / "e"
    train(dataclasses.replace(ONE, out=str(out)), splits=splits)
    info = export_weights(out, tmp_path / "model.pt")
    assert info["certified"] is True
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(exported) == {"state_dict", "meta"}
    ck = load_checkpoint(out)
    assert set(exported["state_dict"]) == set(ck["model"])
    e = [s["e"] for s in ck["engine"]["pipeline"].values() if "e" in s][0]

    def walk(obj, path=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                assert k not in ("e", "engine", "pipeline", "optimizer", "sampler", "rng", "PRIVATE",
                                 "torch_rng"), f"{path}/{k}"
                walk(v, f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, path)
        elif isinstance(obj, torch.Tensor):
            assert not (obj.shape == e.shape and torch.equal(obj, e)), path
    walk(exported)


def test_non_private_reports_infinite_epsilon(tmp_path, splits):
    res = train(dataclasses.replace(BASE, algo="sgd", epsilon=None, epochs=1, ef_clip=None, out=str(tmp_path / "s")),
                splits=splits)
    assert math.isinf(res["epsilon"]) and res["certified"] is False and res["noise_multiplier"] == 0
    on_disk = json.loads((tmp_path / "s" / RESULTS).read_text())
    assert on_disk["epsilon"] == "inf" and on_disk["history"][0]["epsilon"] == "inf"


def test_authors_accounting_is_not_certified(splits):
    res = train(dataclasses.replace(BASE, dice_accounting="authors", epochs=1), splits=splits)
    assert res["certified"] is False and "NOT a guarantee" in res["privacy_note"] and "REFUTED" in res["basis"]


def test_validation_split_and_subset():
    cfg = dataclasses.replace(BASE, algo="dpsgd", ef_clip=None, epochs=1, validation=200, subset=500)
    res = train(cfg)
    n, val = res["n"], res["dataset"]["num_val"]
    assert res["dataset"]["n_given"] == 500 and n + val == 500 and 200 - 60 < val < 200 + 60  # expected 200
    assert 0 <= res["val_accuracy"] <= 1 and "val_accuracy" in res["history"][0]
    assert res["sample_rate"] == pytest.approx(64 / 300)  # B / the expected training part N - K: public


def test_bad_settings_name_the_parameter(splits):
    """The library names the TrainConfig field (the CLI turns it into its flag: tests/test_bad_inputs.py)."""
    for change, name in [({"epsilon": -1.0}, "`epsilon`"), ({"delta": 1.5}, "`delta`"),
                         ({"epochs": 0}, "`epochs`"), ({"batch_size": 0.0}, "`batch_size`"),
                         ({"lr": 0.0}, "`lr`"), ({"clip": -1.0}, "`clip`"), ({"ef_clip": 0.0}, "`ef_clip`"),
                         ({"grad_bound": -2.0}, "`grad_bound`"), ({"momentum": 1.0}, "`momentum`"),
                         ({"validation": -1}, "`validation`"), ({"subset": 0}, "`subset`"),
                         ({"epsilon": None}, "`epsilon`"), ({"extra": {"augmentations": 0}}, r"`AlgoConfig.extra\['augmentations'\]`")]:
        with pytest.raises(ConfigError, match=name):
            train(dataclasses.replace(BASE, **change), splits=splits)
    with pytest.raises(ConfigError, match="`batch_size`"):
        train(dataclasses.replace(BASE, batch_size=5000.0), splits=splits)
    with pytest.raises(ConfigError, match="`subset`"):
        prepare_splits(dataclasses.replace(BASE, subset=10**6))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_cuda_unavailable_is_a_clear_error(splits):
    with pytest.raises(ConfigError, match="CUDA is not available"):
        train(dataclasses.replace(BASE, device="cuda"))


def test_evaluate_matches_a_plain_forward(splits):
    torch.manual_seed(0)
    from clipbias.models import build_model
    model = build_model("mlp", (64,), 10)
    acc, loss = evaluate(model, splits.x_test, splits.y_test, batch_size=7)
    with torch.no_grad():
        out = model(splits.x_test)
    assert acc == pytest.approx(float((out.argmax(1) == splits.y_test).float().mean()))
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(out, splits.y_test)), rel=1e-5)
    assert model.training


def test_run_many_and_scatter_preprocess_once_per_split(tmp_path, monkeypatch):
    from clipbias.models.scatter import ScatterLinear
    calls = []
    orig = ScatterLinear.preprocess

    def counting(self, x, cache_key=None):
        calls.append(cache_key)
        return orig(self, x, cache_key=None)  # no disk cache in tests

    monkeypatch.setattr(ScatterLinear, "preprocess", counting)
    base = TrainConfig(data="digits-image", model="scatter-linear", epsilon=3.0, epochs=1, batch_size=32,
                       lr=0.5, accountant="rdp", subset=300)
    out = tmp_path / "cmp"
    result = run_many(base, [("dpsgd", {"algo": "dpsgd"}),  # calibrated; dice at a given noise (no second calibration)
                             ("dice", {"algo": "dice", "ef_clip": 1 / 32, "epsilon": None, "noise_multiplier": 2.0})],
                      [0, 1], out=out)
    assert len(calls) == 2  # train and test, once for the whole comparison
    rows = {r["label"]: r for r in result["summary"]}
    assert set(rows) == {"dpsgd", "dice"} and rows["dice"]["certified"]
    assert rows["dpsgd"]["seeds"] == [0, 1] and rows["dpsgd"]["test_accuracy_std"] >= 0
    assert (out / "dice-s1" / RESULTS).is_file() and not (out / "dice-s1" / CHECKPOINT).exists()


def test_plot_curves(tmp_path):
    from clipbias.run.plots import plot_curves
    h = [{"epoch": i, "train_loss": 1.0 / i, "test_accuracy": 0.5 + 0.1 * i, "val_accuracy": 0.5}
         for i in (1, 2, 3)]
    path = plot_curves({"a": [h, h], "b": [h]}, tmp_path / "c.png", title="t")
    assert path.stat().st_size > 1000


def test_a_diverged_run_fails_loudly_and_is_marked(tmp_path):
    """lr 1e38 saturates the softmax: finite gradients, infinite loss. That used to exit 0 with an
    accuracy (issue 17); now it raises and results.json says diverged."""
    from clipbias.errors import TrainingDivergedError
    cfg = TrainConfig(data="digits", model="logreg", algo="dpsgd", epsilon=3.0, epochs=2, batch_size=64,
                      lr=1e38, clip=1.0, accountant="rdp", out=str(tmp_path / "div"))
    with pytest.raises(TrainingDivergedError, match="diverged in epoch 1.*Lower `lr`"):
        train(cfg)
    res = json.loads((tmp_path / "div" / RESULTS).read_text())
    assert res["diverged"] is True and len(res["history"]) == 1 and "test_accuracy" not in res


def test_ef_clip_is_refused_where_no_feedback_reads_it():
    """--ef-clip with dpsgd used to be recorded but change nothing (issue 17)."""
    for algo in ("dpsgd", "normalized", "dice-auto", "sgd"):
        with pytest.raises(ConfigError, match="`ef_clip` applies to the clipped error-feedback"):
            dataclasses.replace(BASE, algo=algo, epsilon=None if algo == "sgd" else 3.0)
    for algo in ("dice", "dice-adam", "ef-sgd"):
        dataclasses.replace(BASE, algo=algo, epsilon=None if algo == "ef-sgd" else 3.0)


def test_stale_private_temporaries_are_removed_and_truncated_checkpoints_explained(tmp_path):
    from clipbias.run.training import check_out_dir, load_checkpoint
    out = tmp_path / "run"
    out.mkdir()
    dead = out / ".checkpoint.pt.tmp999999999"   # no such process
    live = out / f".checkpoint.pt.tmp{os.getpid()}"
    dead.write_bytes(b"private"), live.write_bytes(b"in progress")
    check_out_dir(out)
    assert not dead.exists() and live.exists()
    (out / CHECKPOINT).write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ConfigError, match="truncated or corrupted.*`overwrite=True`"):
        load_checkpoint(out)


def test_exports_and_figures_are_atomic_and_do_not_write_through_hard_links(tmp_path):
    """A failed write leaves the old file intact and no temporary; a hard link to an exported file is
    not overwritten by the next export (issue 17)."""
    from clipbias.files import atomic_write
    target = tmp_path / "w.pt"
    target.write_bytes(b"old")
    os.link(target, tmp_path / "link.pt")

    def boom(fh):
        fh.write(b"half")
        raise OSError("disk full")
    from clipbias.errors import WriteError
    with pytest.raises(WriteError, match="cannot write .*disk full.*free disk space"):
        atomic_write(target, boom)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    atomic_write(target, lambda fh: fh.write(b"new"))
    assert target.read_bytes() == b"new" and (tmp_path / "link.pt").read_bytes() == b"old"
    atomic_write(tmp_path / "private.pt", lambda fh: fh.write(b"x"), mode=0o600)
    assert (tmp_path / "private.pt").stat().st_mode & 0o777 == 0o600


def test_a_second_run_on_the_same_out_is_refused(tmp_path):
    """Two runs on one --out used to interleave their files (issue 17): the directory is locked."""
    from clipbias.files import run_lock
    out = tmp_path / "busy"
    cfg = TrainConfig(data="digits", model="logreg", algo="dpsgd", epsilon=3.0, epochs=1, batch_size=64,
                      lr=0.5, clip=1.0, accountant="rdp", out=str(out))
    with run_lock(out):
        with pytest.raises(ConfigError, match="in use by another clipbias run"):
            train(cfg)
    res = train(cfg)  # free again
    assert res["steps"] == res["planned_steps"] and (out / RESULTS).is_file()


def test_a_finished_run_at_a_given_noise_extends_to_more_epochs_exactly(tmp_path):
    """--resume with more --epochs continues a run whose noise multiplier was given: the result equals
    an uninterrupted run of all the epochs bit for bit (same batches, noise and weights) and reports
    the epsilon of all the steps; a run calibrated to a target epsilon is refused, saying why (issue 16)."""
    from clipbias.run.training import load_checkpoint, train
    base = dict(data="digits", model="mlp", algo="dice", batch_size=128.0, lr=0.5, clip=1.0, seed=3,
                reproducible_noise=True, noise_multiplier=1.0)
    train(TrainConfig(**base, epochs=1, out=str(tmp_path / "a")), progress=False, plot=False)
    extended = train(TrainConfig(**base, epochs=3, out=str(tmp_path / "a"), resume=True), progress=False, plot=False)
    direct = train(TrainConfig(**base, epochs=3, out=str(tmp_path / "b")), progress=False, plot=False)
    a, b = load_checkpoint(str(tmp_path / "a")), load_checkpoint(str(tmp_path / "b"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    assert extended["epsilon"] == direct["epsilon"] and extended["steps"] == direct["steps"] == 33
    assert len(extended["history"]) == 3
    cal = dict(base, noise_multiplier=None, epsilon=2.0, algo="dpsgd", accountant="rdp")  # rdp: a quick calibration
    train(TrainConfig(**cal, epochs=1, out=str(tmp_path / "c")), progress=False, plot=False)
    with pytest.raises(ResumeMismatchError, match="calibrated so that 1 epochs spend exactly `epsilon=2`"):
        train(TrainConfig(**cal, epochs=2, out=str(tmp_path / "c"), resume=True), progress=False, plot=False)


def test_run_many_refuses_a_variant_before_any_run_trains(tmp_path):
    """A variant that its algorithm refuses (inner-outer with the base's SGD momentum) stops the
    comparison before the first variant trains, not after it."""
    base = TrainConfig(data="digits", model="logreg", algo="dpsgd", noise_multiplier=1.0, epochs=1,
                       batch_size=64, lr=0.5, momentum=0.9)
    with pytest.raises(ConfigError, match="set `AlgoConfig.momentum=0`"):
        run_many(base, [("dpsgd", {"algo": "dpsgd"}), ("inner-outer", {"algo": "inner-outer"})], [0],
                 out=tmp_path / "cmp")
    assert not (tmp_path / "cmp").exists() or not any((tmp_path / "cmp").iterdir())


def test_on_engine_gets_the_engine_before_the_first_step(splits):
    """``train(on_engine=...)`` hands the built engine to the caller before any step (the CLI sets the
    allocator by its gradient path there, on every rank)."""
    from clipbias.engine.core import DPEngine
    seen = []
    train(dataclasses.replace(ONE, algo="dpsgd", ef_clip=None),
          splits=splits, on_engine=lambda e: seen.append((type(e), e.steps_taken, e.fast is None)))
    assert seen == [(DPEngine, 0, False)]  # digits' MLP (Linear layers, per-example by construction): fast path
