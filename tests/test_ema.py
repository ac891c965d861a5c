"""--ema: the exponential moving average of the weights (post-processing), evaluated, reported,
exported, checkpointed and resumed exactly."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from clipbias.cli import main
from clipbias.errors import ConfigError, ResumeMismatchError
from clipbias.run.average import WeightAverage
from clipbias.run.training import RESULTS, TrainConfig, evaluate, export_weights, load_checkpoint, prepare_splits, train
from tests.interrupt import interrupt_after_first_epoch

# digits, logreg, B = 64: 21 steps per epoch
BASE = TrainConfig(data="digits", model="logreg", algo="disk", noise_multiplier=1.0, delta=1e-5, epochs=2,
                   batch_size=64, lr=0.5, clip=1.0, momentum=0.5, ema=0.8, reproducible_noise=True)


@pytest.fixture(scope="module")
def splits():
    return prepare_splits(BASE)



def test_average_equals_the_recursion_and_restores_the_weights():
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    avg = WeightAverage(m, 0.75)
    seen = []
    for _ in range(4):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p))
        seen.append([p.detach().clone() for p in m.parameters()])
        avg.update()
    want = seen[0]
    for w in seen[1:]:
        want = [0.75 * a + 0.25 * b for a, b in zip(want, w)]
    raw = [p.detach().clone() for p in m.parameters()]
    with avg.applied():
        for p, w in zip(m.parameters(), want):
            assert torch.allclose(p, w, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(p, r) for p, r in zip(m.parameters(), raw))  # bit for bit after
    sd = avg.averaged_state_dict()
    assert torch.allclose(sd["weight"], want[0], rtol=1e-6, atol=1e-7)


def test_reported_exported_and_resumed_exactly(tmp_path, splits):
    full = train(dataclasses.replace(BASE, out=str(tmp_path / "a")), splits=splits)
    assert full["ema"] == 0.8 and 0 < full["ema_test_accuracy"] <= 1
    assert all("ema_test_accuracy" in h for h in full["history"])
    on_disk = json.loads((tmp_path / "a" / RESULTS).read_text())
    assert on_disk["ema_test_accuracy"] == full["ema_test_accuracy"]
    ck = load_checkpoint(tmp_path / "a")
    assert ck["ema"]["updates"] == full["steps"]
    # the reported accuracy is the exported averaged model's, and it differs from the raw weights
    meta = export_weights(tmp_path / "a", tmp_path / "w.pt")
    w = torch.load(tmp_path / "w.pt", weights_only=True)
    assert meta["ema"] == 0.8 and set(w["ema_state_dict"]) == set(w["state_dict"])
    assert any(not torch.equal(w["ema_state_dict"][k], w["state_dict"][k]) for k in w["state_dict"])
    torch.manual_seed(0)
    from clipbias.run.splits import build_model
    model = build_model(BASE, tuple(splits.info["input_shape"]), splits.info["num_classes"])
    model.load_state_dict(w["ema_state_dict"])
    assert evaluate(model, splits.x_test, splits.y_test)[0] == full["ema_test_accuracy"]

    cfg = dataclasses.replace(BASE, out=str(tmp_path / "b"))
    interrupt_after_first_epoch(cfg, splits)
    resumed = train(dataclasses.replace(cfg, resume=True), splits=splits)
    b = load_checkpoint(tmp_path / "b")
    for k in ck["ema"]["avg"]:
        assert torch.equal(ck["ema"]["avg"][k], b["ema"]["avg"][k])
    for k in ck["ema_model"]:
        assert torch.equal(ck["ema_model"][k], b["ema_model"][k])
    assert resumed["ema_test_accuracy"] == full["ema_test_accuracy"]
    with pytest.raises(ResumeMismatchError, match="ema"):
        train(dataclasses.replace(cfg, resume=True, ema=0.9, epochs=3), splits=splits)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.5, float("nan")])
def test_bad_decay_is_refused(bad):
    with pytest.raises(ConfigError, match="`ema`"):
        dataclasses.replace(BASE, ema=bad).validate()


def test_cli_prints_the_average(tmp_path, capsys):
    rc = main(["train", "--data", "digits", "--model", "logreg", "--algo", "dice", "--kalman", "--kappa", "0.5",
               "--noise-multiplier", "1", "--epochs", "1", "--batch-size", "128", "--lr", "0.5",
               "--ema", "0.7", "--out", str(tmp_path / "r")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "EMA test accuracy (decay 0.7)" in text
    res = json.loads((tmp_path / "r" / RESULTS).read_text())
    assert res["algorithm"]["name"] == "dice+disk" and res["config"]["extra"] == {"kappa": 0.5}
