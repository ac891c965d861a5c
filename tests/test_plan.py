"""The run's plan (``clipbias.engine.plan``): made before the first step, from the settings alone (no model, no
data), frozen, JSON-serialisable, and what the engine executes."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from clipbias import privacy
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.engine.plan import StepPlan, make_plan
from clipbias.errors import ConfigError

KW = dict(n=1000, batch_size=50, epochs=2, steps=None, delta=1e-5, noise_multiplier=None, accountant="pld",
          dice_accounting=privacy.DEFAULT_DICE_ACCOUNTING, bands=1, sample_rate=None, bands_strategy="taylor")


def test_a_plan_is_made_from_the_settings_alone_and_calibrated():
    plan = make_plan("dpsgd", AlgoConfig(clip=1.0), epsilon=2.0, **KW)
    assert isinstance(plan, StepPlan) and plan.total_steps == 40 and plan.sample_rate == 0.05
    report = privacy.account(plan.spec, plan.total_steps, plan.delta, plan.accountant, plan.dice_accounting)
    assert report.epsilon <= 2.0 and report.epsilon > 1.9  # calibrated to the target, never above
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.noise_multiplier = 0.1
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["noise_multiplier"] == plan.noise_multiplier and d["total_steps"] == 40 and d["noise_shape"] == [1.0]
    assert make_plan("dpsgd", AlgoConfig(clip=1.0), **{**KW, "epochs": None, "noise_multiplier": 1.0},
                     epsilon=None).total_steps == math.inf


def test_the_engine_executes_its_plan():
    model = nn.Linear(3, 2)
    engine = DPEngine(model, "dpsgd", n=1000, batch_size=50, epochs=2, epsilon=2.0, config=AlgoConfig(clip=1.0))
    plan = make_plan("dpsgd", AlgoConfig(clip=1.0), epsilon=2.0, **KW)
    assert engine.plan == plan  # the same plan, the same calibrated noise (bit for bit)
    assert (engine.noise_multiplier, engine.sample_rate, engine.total_steps, engine.spec) == \
        (plan.noise_multiplier, plan.sample_rate, plan.total_steps, plan.spec)
    assert engine.settings == plan.settings and engine.settings.noise_multiplier == plan.noise_multiplier
    with pytest.raises(ConfigError, match="either epsilon"):
        make_plan("dpsgd", AlgoConfig(), epsilon=1.0, **{**KW, "noise_multiplier": 1.0})
    x, y = torch.randn(50, 3), torch.randint(0, 2, (50,))
    engine.step(x, y, torch.arange(50))  # (indices the sampler did not draw: uncertified, but it runs)
    assert engine.steps_taken == 1


def test_the_plan_holds_the_gradient_path_and_its_reason_as_data():
    """``engine.plan.path`` (``PathChoice``): which path the step's sums take and why, the header's words made
    from it (``grad_path_note``)."""
    import torch.nn as nn

    from clipbias.engine import DPEngine
    from clipbias.engine.plan import PathChoice

    class Mixer(nn.Module):  # (not in the structural proof: the fast path rests on run-time checks)
        def forward(self, x):
            return x

    mlp = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 4))
    e = DPEngine(mlp, "dpsgd", n=256, batch_size=32, noise_multiplier=1.0, grad_path="fast")
    assert e.plan.path == PathChoice("fast", "fast", checked="structure")
    assert e.grad_path_note == e.plan.path.note and e.grad_path_note.startswith("fast (per-layer norms")
    e = DPEngine(nn.Sequential(nn.Linear(20, 4), Mixer()), "dpsgd", n=256, batch_size=32, noise_multiplier=1.0,
                 grad_path="fast")
    assert e.plan.path.checked == "runtime" and "run-time checks" in e.grad_path_note
    e = DPEngine(nn.Sequential(nn.Linear(20, 4)), "disk", n=256, batch_size=32, noise_multiplier=1.0, grad_path="rows")
    assert e.plan.path.path == "sums" and e.plan.path.two_point and "at two points" in e.grad_path_note
    e = DPEngine(nn.Sequential(nn.Linear(20, 4)), "dpsgd", n=256, batch_size=32, noise_multiplier=1.0,
                 grad_path="fast", sum_precision="float32")
    assert e.plan.path.sum_precision == "float32" and e.grad_path_note.endswith("the noise scaled to it)")
