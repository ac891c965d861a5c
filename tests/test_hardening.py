"""Bad input gets a clear error that names the problem and the fix (issue 17, first cases)."""

import numpy as np
import pytest
import torch
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ClipbiasError, ConfigError, UnsupportedModelError
from clipbias.privacy import gaussian, pld
from clipbias.run.training import TrainConfig


def lin() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def engine(model=None, **kw):
    args = dict(n=100, batch_size=10.0, steps=3, noise_multiplier=1.0, config=AlgoConfig(lr=0.1), noise_seed=0)
    return DPEngine(model if model is not None else lin(), "dpsgd", **(args | kw))


@pytest.mark.parametrize("kw,match", [
    ({"batch_size": 0.5}, r"`batch_size` .* must lie in \[1, N=100\]"),
    ({"batch_size": 101.0}, r"`batch_size` .* must lie in \[1, N=100\]"),
    ({"batch_size": "10"}, r"`batch_size`"),
    ({"n": True}, r"dataset size n must be a positive integer"),
    ({"n": 10.5}, r"dataset size n must be a positive integer"),
    ({"n": 0}, r"dataset size n must be a positive integer"),
    ({"noise_multiplier": -1.0}, r"`noise_multiplier`"),
    ({"noise_multiplier": 1.0, "epsilon": 3.0}, r"either epsilon .* or noise_multiplier"),
])
def test_engine_refuses_bad_settings(kw, match):
    with pytest.raises(ConfigError, match=match):
        engine(**kw)


def test_numpy_integer_n_is_accepted():
    assert engine(n=np.int64(100)).n == 100


def test_model_without_trainable_parameters_is_refused():
    with pytest.raises(ConfigError, match="no trainable parameters"):
        engine(model=nn.Identity())


@pytest.mark.parametrize("rows,labels", [(200, 200), (100, 99), (50, 50)])
def test_train_epoch_refuses_data_of_another_size(rows, labels):
    with pytest.raises(ConfigError, match=r"engine built with n=100.*pass exactly the n training examples"):
        engine().train_epoch(torch.randn(rows, 4), torch.zeros(labels, dtype=torch.long))


def test_batchnorm_switched_to_train_mode_after_construction_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).eval()
    eng = engine(model=model)
    model.train()
    with pytest.raises(UnsupportedModelError, match="GroupNorm"):
        eng.step(torch.randn(5, 4), torch.zeros(5, dtype=torch.long))
    assert eng.steps_taken == 0


@pytest.mark.parametrize("z", [1e-9, 0.01, 0.099])
def test_tiny_noise_multiplier_is_a_clear_error_not_a_hang(z):
    with pytest.raises(gaussian.NoiseTooSmallError, match=r"`noise_multiplier`, or `accountant='rdp'`"):
        gaussian.epsilon(z, 0.01, 100, 1e-5, "pld")
    assert gaussian.epsilon(z, 0.01, 100, 1e-5, "rdp") > 10  # RDP still gives (an enormous) number


def test_calibration_steps_over_the_pld_floor(monkeypatch):
    """An answer just above the floor: the search (whose Renyi stand-in points below the floor) never
    evaluates the PLD below it, and a refusal there reads as epsilon = inf (too much), never as a crash.
    (A stand-in PLD epsilon(z) = 1/z keeps this test fast: real PLD evaluations near z = 0.1 take seconds.)"""
    calls = []
    monkeypatch.setattr(pld, "pld_epsilon", lambda z, q, t, d, grid: calls.append(z) or 1.0 / z)
    gaussian.calibrate.cache_clear()
    z = gaussian.calibrate(9.0, 1e-5, 0.0123, 77, "pld")  # answer 1/9 = 0.111
    gaussian.calibrate.cache_clear()
    assert pld.PLD_MIN_NOISE <= z <= 0.1112 and 1.0 / z <= 9.0 and min(calls) >= pld.PLD_MIN_NOISE
    assert gaussian.epsilon(0.05, 0.0123, 77, 1e-5, "rdp") > 9.0  # the stand-in does point below the floor
    with pytest.raises(gaussian.NoiseTooSmallError):
        gaussian.epsilon(0.05, 0.0123, 77, 1e-5, "pld")


@pytest.mark.parametrize("batch_size", [0.5, 0.0, -3.0])
def test_train_config_refuses_fractional_batch(batch_size):
    with pytest.raises(ClipbiasError, match="batch_size|--batch-size"):
        TrainConfig(data="digits", model="logreg", algo="dpsgd", epsilon=3.0, batch_size=batch_size)


@pytest.mark.parametrize("x,y,match", [
    (torch.randn(5, 4), torch.zeros(4, dtype=torch.long), r"5 inputs, 4 labels"),
    (torch.randn(5, 4), torch.zeros(5), r"integer class indices .* y.long\(\)"),
    (torch.randn(5, 7), torch.zeros(5, dtype=torch.long), r"per-example gradients failed .*\(7,\)"),
    (torch.randn(5, 4), torch.full((5,), 9, dtype=torch.long), r"per-example gradients failed .*class indices"),
])
def test_step_misuse_is_a_clear_error_and_changes_nothing(x, y, match):
    eng = engine()
    before = [p.detach().clone() for p in eng.params]
    with pytest.raises(ConfigError, match=match):
        eng.step(x, y)
    assert eng.steps_taken == 0 and all(torch.equal(a, b) for a, b in zip(before, eng.params))


def test_training_past_the_planned_steps_is_refused_not_silently_skipped():
    """After the planned steps, train_epoch used to return 0.0 having done nothing (the loader yielded
    no batch): the caller believed it trained. Now it says the plan is done and what to do."""
    eng = engine(steps=3)  # 3 steps: under one epoch of 10
    x, y = torch.randn(100, 4), torch.zeros(100, dtype=torch.long)
    eng.train_epoch(x, y)
    assert eng.steps_taken == 3
    before = [p.clone() for p in eng.params]
    with pytest.raises(ConfigError, match=r"all 3 planned steps .* are taken.*build a new DPEngine"):
        eng.train_epoch(x, y)
    assert eng.steps_taken == 3 and all(torch.equal(a, b) for a, b in zip(before, eng.params))
    from clipbias.engine import run_steps
    with pytest.raises(ConfigError, match="planned steps"):
        run_steps(eng, x, y, 1)
