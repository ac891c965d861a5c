"""Checkpoint formats (``clipbias.engine.migrate``): each migration step, tested on a real state with that
step's change undone (the state an older version wrote): it resumes bit-exactly where the older state
could, or is refused with the reason where it cannot; a newer format is refused."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.engine import migrate
from clipbias.engine.core import SEEDED_CAVEAT, DPEngine
from clipbias.errors import ConfigError, ResumeMismatchError
from clipbias.privacy import dice
from clipbias.run.training import CHECKPOINT, TrainConfig, load_checkpoint, prepare_splits, train
from tests.interrupt import interrupt_after_first_epoch

N, B, STEPS, CUT = 40, 8, 6, 3
X = torch.randn(N, 4, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Dropout(0.25), nn.Linear(4, 3))  # keyed dropout: its layouts are in the state


def _engine(model: nn.Module, **kw) -> DPEngine:
    cfg = AlgoConfig(lr=0.5, clip=1.0, momentum=0.9, **kw.pop("cfg", {}))
    return DPEngine(model, "dpsgd", n=N, batch_size=B, steps=STEPS, noise_multiplier=1.0, noise_seed=3,
                    config=cfg, **kw)


def _steps(engine: DPEngine, k: int) -> None:
    for _ in range(k):
        idx = engine.sampler.sample()
        engine.step(X[idx], Y[idx], idx)


_RUNS: dict = {}


def _interrupted(**kw) -> tuple[dict, dict, dict]:
    """(the engine state after CUT steps, the weights then, the weights after all STEPS uninterrupted)."""
    key = repr(sorted(kw.items()))
    if key not in _RUNS:
        model = _model()
        engine = _engine(model, **kw)
        _steps(engine, CUT)
        state, weights = copy.deepcopy(engine.state_dict()), copy.deepcopy(model.state_dict())  # saved, as on disk
        _steps(engine, STEPS - CUT)
        _RUNS[key] = state, weights, copy.deepcopy(model.state_dict())
    return _RUNS[key]


def _older(state: dict, *paths: str) -> dict:
    """``state`` as an older version wrote it: no format, and without the entries at ``paths`` ("a/b")."""
    old = copy.deepcopy(state)
    del old["format"]
    for path in paths:
        *parents, leaf = path.split("/")
        node = old
        for p in parents:
            node = node[p]
        del node[leaf]
    return old


def _resume(state: dict, weights: dict, **kw) -> dict:
    """The weights after resuming ``state`` on ``weights`` and taking the remaining steps."""
    model = _model()
    model.load_state_dict(weights)
    engine = _engine(model, **kw)
    engine.load_state_dict(copy.deepcopy(state))  # as read from disk: torch's optimizer adopts the saved tensors
    _steps(engine, STEPS - CUT)
    return model.state_dict()


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_state_records_the_current_format_and_each_step_names_its_versions():
    state, _, _ = _interrupted()
    assert state["format"] == migrate.FORMAT == len(migrate.STEPS)
    for k, step in enumerate(migrate.STEPS):
        assert step.__doc__.startswith(f"{k} -> {k + 1}"), step.__name__
    for k, step in enumerate(migrate.CHECKPOINT_STEPS, start=1):
        assert step.__doc__.startswith(f"{k} -> {k + 1}"), step.__name__


def test_a_current_state_resumes_bit_exactly():
    state, weights, final = _interrupted()
    _assert_same(_resume(state, weights), final)


@pytest.mark.parametrize("paths,kw", [
    (("settings/bands", "sampler/bands"), {}),                   # one_band
    (("optimizer_class",), {}),                                  # record_optimizer_class
    (("undrawn_steps",), {}),                                    # count_undrawn_steps
    (("sampler/skipped",), {}),                                  # count_skipped_batches
    (("pipeline/noise/strategy",), {"bands": 2}),                # taylor_strategy
    (("dropout_layouts",), {}),                                  # record_dropout_layouts
    (("pipeline/noise/coefs", "pipeline/noise/strategy", "pipeline/noise/inputs", "pipeline/noise/outputs"), {}),  # one_noise_type
    (("transformed_steps",), {}),                                # count_transformed_steps
    (("settings/bands", "sampler/bands", "optimizer_class", "undrawn_steps", "sampler/skipped",
      "dropout_layouts", "pipeline/noise/coefs", "pipeline/noise/strategy", "pipeline/noise/inputs", "pipeline/noise/outputs",
      "transformed_steps"), {}),  # the oldest resumable layout: every step
], ids=["bands", "optimizer-class", "undrawn", "skipped", "strategy", "dropout-layouts", "one-noise-type", "transformed",
        "oldest"])
def test_an_older_state_resumes_bit_exactly(paths, kw):
    state, weights, final = _interrupted(**kw)
    old = _older(state, *paths)
    _assert_same(_resume(old, weights, **kw), final)
    assert "format" not in old and not any(_has(old, p) for p in paths)  # the caller's state is left as it was


def _has(state: dict, path: str) -> bool:
    *parents, leaf = path.split("/")
    for p in parents:
        state = state[p]
    return leaf in state


def test_the_migrated_values_are_the_ones_the_older_run_had():
    state, _, _ = _interrupted(bands=2)
    old = _older(state, "settings/bands", "sampler/bands", "undrawn_steps", "sampler/skipped",
                 "pipeline/noise/strategy", "dropout_layouts", "optimizer_class", "transformed_steps")
    old["settings"]["bands"] = old["sampler"]["bands"] = 2  # a banded state always recorded its bands
    new = migrate.migrate(old, _engine(_model(), bands=2))
    assert new["format"] == migrate.FORMAT and new["undrawn_steps"] == 0 and new["sampler"]["skipped"] == 0
    assert new["transformed_steps"] == 0
    assert new["pipeline"]["noise"]["strategy"] == "taylor" and new["dropout_layouts"] == {}
    assert new["optimizer_class"] == "SGD"
    plain = migrate.migrate(_older(_interrupted()[0], "settings/bands", "sampler/bands", "pipeline/noise/coefs", "pipeline/noise/strategy", "pipeline/noise/inputs", "pipeline/noise/outputs"),
                            _engine(_model()))
    assert plain["settings"]["bands"] == plain["sampler"]["bands"] == 1
    noise = plain["pipeline"]["noise"]  # plain noise (only draws) is the one-band state
    assert (noise["coefs"], noise["strategy"], noise["inputs"], noise["outputs"]) == ([1.0], "taylor", [], [])


@pytest.mark.parametrize("paths,error,match", [
    (("secret_key",), ResumeMismatchError, "torch generators with 32-bit seeds"),
    (("sampler/drawn",), ConfigError, "sampler state comes from a clipbias version whose batches were drawn"),
    (("pipeline/noise/draws",), ConfigError, "noise state comes from a clipbias version whose noise was drawn"),
], ids=["key", "sampler", "noise"])
def test_a_state_from_torch_generators_is_refused_and_loads_nothing(paths, error, match):
    state, weights, _ = _interrupted()
    model = _model()
    model.load_state_dict(weights)
    engine = _engine(model)
    key, drawn = engine.key, engine.sampler.drawn
    with pytest.raises(error, match=match):
        engine.load_state_dict(_older(state, *paths))
    assert engine.steps_taken == 0 and engine.key is key and engine.sampler.drawn == drawn
    _assert_same(model.state_dict(), weights)


def test_an_older_state_of_another_optimizer_family_is_refused():
    state, weights, _ = _interrupted()
    old = _older(state, "optimizer_class")
    with pytest.raises(ResumeMismatchError, match=r"base optimizer is another kind \(hyperparameters .*momentum"):
        _resume(old, weights, cfg={"optimizer": "adam"})


def test_a_newer_or_unknown_format_is_refused():
    state, weights, _ = _interrupted()
    newer = dict(state, format=migrate.FORMAT + 1)
    with pytest.raises(ResumeMismatchError, match=f"format {migrate.FORMAT + 1}, written by a newer clipbias"):
        _resume(newer, weights)
    with pytest.raises(ConfigError, match="not a DPEngine state: its format is '7'"):
        _resume(dict(state, format="7"), weights)


# ---------------------------------------------------------------- a run's checkpoint.pt
RUN = TrainConfig(data="digits", model="logreg", algo="dpsgd", epochs=2, batch_size=64, lr=0.5, clip=1.0,
                  noise_multiplier=2.0, reproducible_noise=True)


def test_the_oldest_resumable_run_checkpoint_resumes_bit_exactly(tmp_path):
    """Every run checkpoint step (but the DiceSGD rename, for another algorithm) and every engine step
    undone: the run resumes to the uninterrupted run's weights and records."""
    splits = prepare_splits(RUN)
    train(dataclasses.replace(RUN, out=str(tmp_path / "a")), splits=splits, plot=False)
    cfg = dataclasses.replace(RUN, out=str(tmp_path / "b"))
    interrupt_after_first_epoch(cfg, splits)
    ck = torch.load(tmp_path / "b" / CHECKPOINT, weights_only=True)
    assert ck["format"] == migrate.CHECKPOINT_FORMAT and ck["world_size"] == 1
    assert ck["history"][0]["caveats"] == [SEEDED_CAVEAT]
    for k in ("world_size", "torch_rng_ranks"):
        del ck[k]
    del ck["history"][0]["caveats"]
    for k in ("ema", "bands", "bands_strategy"):
        del ck["config"][k]
    ck["engine"] = _older(ck["engine"], "settings/bands", "sampler/bands", "optimizer_class", "undrawn_steps",
                          "sampler/skipped", "dropout_layouts", "transformed_steps")
    ck["format"] = 1
    torch.save(ck, tmp_path / "b" / CHECKPOINT)
    migrated = load_checkpoint(tmp_path / "b")
    assert migrated["world_size"] == 1 and migrated["torch_rng_ranks"][0].equal(ck["torch_rng"])
    assert migrated["history"][0]["caveats"] == []  # what the older version recorded: none
    assert (migrated["config"]["ema"], migrated["config"]["bands"], migrated["config"]["bands_strategy"]) == \
        (None, 1, "taylor")
    train(dataclasses.replace(cfg, resume=True), splits=splits, plot=False)
    a, b = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    _assert_same(a["model"], b["model"])
    assert a["history"][1] == {**b["history"][1], **{k: a["history"][1][k] for k in ("epoch_time_s", "eval_time_s")}}


def test_a_pre_refutation_dicesgd_checkpoint_is_migrated_to_the_refuted_paper_bound():
    old = {"format": 1, "model": {}, "engine": {}, "torch_rng": torch.get_rng_state(),
           "config": {"algo": "dice", "dice_accounting": "certified"},
           "history": [{"certified": True, "basis": "DiceSGD Thm 3.8"} for _ in range(2)]}
    new = migrate.migrate_checkpoint(old)
    assert new["config"]["dice_accounting"] == "paper" and new["format"] == migrate.CHECKPOINT_FORMAT
    for rec in new["history"]:
        assert rec["certified"] is False and rec["basis"] == f"DiceSGD Thm 3.8; {dice.REFUTED.format(basis='paper')}"
        assert rec["caveats"] == []
    assert old["config"]["dice_accounting"] == "certified" and old["history"][0]["certified"] is True
    dpsgd = migrate.migrate_checkpoint(dict(old, config={"algo": "dpsgd", "dice_accounting": "certified"}))
    assert dpsgd["config"]["dice_accounting"] == "certified"  # not a DiceSGD run: its accounting is not dice
    current = migrate.migrate_checkpoint(dict(old, format=migrate.CHECKPOINT_FORMAT))
    assert current["config"]["dice_accounting"] == "certified"  # the version decides, not the keys
    with pytest.raises(ResumeMismatchError, match="newer clipbias"):
        migrate.migrate_checkpoint(dict(old, format=migrate.CHECKPOINT_FORMAT + 1))


def test_a_run_from_before_the_secret_key_is_no_longer_certified_on_export(tmp_path):
    """A run checkpoint whose engine state has no secret key drew its batches and noise from torch generators
    with 32-bit seeds: its records (and so its export) said certified; migrated, they say not, with why.
    A run with the secret key keeps its statement."""
    old = {"format": 1, "model": {"w": torch.zeros(2)}, "engine": {"sampler": {}, "pipeline": {}},
           "torch_rng": torch.get_rng_state(), "input_shape": [2], "num_classes": 2, "epoch": 1,
           "config": {"algo": "dpsgd", "model": "logreg", "data": "digits", "delta": 1e-5},
           "history": [{"certified": True, "epsilon": 3.0, "basis": "PLD", "steps": 10}]}
    torch.save(old, tmp_path / CHECKPOINT)
    from clipbias.run.checkpoint import export_weights
    meta = export_weights(tmp_path, tmp_path / "weights.pt")
    assert meta["certified"] is False and meta["caveats"] == [migrate.TORCH_GENERATOR_CAVEAT]
    keyed = migrate.migrate_checkpoint(dict(old, engine={"secret_key": {}, "sampler": {}, "pipeline": {}}))
    assert keyed["history"][0]["certified"] is True and keyed["history"][0]["caveats"] == []
