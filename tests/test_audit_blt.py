"""The mechanism-level audit of BLT noise (``clipbias.audit.blt``): the adversary recovers the releases y = C g
from the stage's outputs and scores the matched statistic; it reads the claimed mu when the canary attains the
sensitivity (class 0), its own smaller mu in a late class, the engine's larger claim past the planned steps,
and never more than the claim. The red team's checks are in test_blt_redteam.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from clipbias.algorithms import blt
from clipbias.audit.blt import BLTAudit, blt_audit, contribution, dense, engine_for, outputs, worst_signs
from clipbias.errors import ConfigError
from clipbias.privacy.pld import gaussian_exact_epsilon
from clipbias.randomness import Purpose, SecretKey, normals
from clipbias.randomness.noise import noise_grid


def test_the_audit_reads_the_claim_and_never_more():
    """Class 0 (its steps reach furthest) attains Delta(T) = 1: the canary's exact mu is the claimed 1 / z, the
    null scores are N(0, 1), the shift is mu, and the GDP reading is within a few percent of the claim."""
    r = blt_audit(BLTAudit(4, 40, 1.0, 0, runs=20_000, momentum=0.9, seed=7))
    assert r["mu_canary"] == pytest.approx(r["mu_claimed"], rel=1e-9) and r["mu_claimed"] == pytest.approx(1.0)
    assert r["epsilon_canary"] == pytest.approx(r["epsilon_claimed"], rel=1e-9)
    assert abs(r["null_mean"]) < 0.03 and abs(r["null_std"] - 1) < 0.02 and abs(r["alt_std"] - 1) < 0.02
    assert r["mean_shift"] == pytest.approx(1.0, abs=0.04)
    assert not r["refuted"] and r["epsilon_lower_bound"] <= r["epsilon_claimed"]
    assert 0.85 * r["epsilon_claimed"] < r["epsilon_lower_bound_gdp"] <= r["epsilon_claimed"]


def test_a_late_class_reads_its_own_smaller_mu():
    r = blt_audit(BLTAudit(29, 87, 1.4, 28, runs=10_000, momentum=0.9, seed=3))
    assert r["mu_canary"] < 0.9 * r["mu_claimed"]
    assert r["epsilon_lower_bound_gdp"] <= r["epsilon_canary"] < r["epsilon_claimed"]


def test_a_run_past_its_planned_steps_is_accounted_at_its_own_sensitivity():
    """(b) 2T steps on the strategy planned for T: Delta(2T) = 1.44; the engine's claim at 2T is the Gaussian
    mechanism at z / Delta(2T), and the audit's GDP reading exceeds the claim at T (which a Delta = 1
    accounting would state) while staying under the claim at 2T."""
    r = blt_audit(BLTAudit(4, 40, 1.0, 0, runs=20_000, momentum=0.9, seed=5, run_steps=80))
    assert r["sensitivity"] == pytest.approx(1.4403, abs=1e-3)
    assert r["epsilon_planned"] < r["epsilon_lower_bound_gdp"] <= r["epsilon_claimed"]


def test_the_claim_is_the_gaussian_mechanism_at_the_sensitivity_over_the_steps_taken():
    e = engine_for(BLTAudit(4, 40, 1.5, momentum=0.9))
    shape = e.noise_shape
    assert isinstance(shape, blt.BLT) and e.pipeline.noise.blt == shape and e.pipeline.noise.std == 1.5
    for t in (1, 10, 40, 41, 80):
        d = shape.sensitivity(t)
        assert e.spec.blt_sensitivity(t) == d
        assert e.privacy(t).epsilon == pytest.approx(gaussian_exact_epsilon(1.5 / d, 1, 1e-5), rel=1e-9)
    assert shape.sensitivity(40) == pytest.approx(1.0, rel=1e-12) and shape.sensitivity(41) > 1.0
    assert max(shape.sensitivity(t) for t in range(1, 41)) <= 1.0 + 1e-12  # never more before T either


def test_the_recovered_releases_are_c_v_plus_the_keyed_noise_on_the_grid():
    """What the adversary computes, y = C g, is the stage's release round_g(C v + std Z_t), Z_t the key's
    draw t: the audit scores the very releases the claim is about."""
    b, std, runs, key = blt.optimize(24, 3, 0.9), 0.8, 64, SecretKey.from_seed(11)
    a = contribution(b, BLTAudit(3, 24, 0.8, 1, signs="plus"))
    y = torch.from_numpy(dense(b, 24)) @ outputs(b, std, a, runs, key)
    z = torch.stack([normals(key, Purpose.NOISE, t, 0, runs) for t in range(24)])
    exact = torch.from_numpy(dense(b, 24) @ a).unsqueeze(1) + std * z
    assert (y - exact).abs().max() <= noise_grid(std) * 0.5 + 1e-12


def test_the_worst_signs_are_found_and_all_plus_when_c_is_nonnegative():
    x = np.array([[2.0, -1.0, 0.5], [-1.0, 1.0, 0.2], [0.5, 0.2, 1.0]])
    s = worst_signs(x)
    best = max(np.array(p) @ x @ np.array(p) for p in itertools.product((1.0, -1.0), repeat=3))
    assert s @ x @ s == pytest.approx(best) and s.tolist() == [1.0, -1.0, 1.0]
    b = blt.optimize(40, 4, 0.9)
    assert b.column(40).min() >= 0
    assert (contribution(b, BLTAudit(4, 40, 1.0, 3, signs="worst")) == contribution(b, BLTAudit(4, 40, 1.0, 3))).all()


def test_the_cli_audits_blt_noise_in_the_canary_and_the_white_box_one_run_modes(capsys):
    """``clipbias audit --bands 4 --bands-strategy blt``: the canary mode runs the mechanism-level audit, the
    one-run-ideal mode the engine with BLT noise (the canaries' classes unknown to the adversary); neither
    refutes the engine's claim, which is the Gaussian mechanism's at mu = 1 / z."""
    import json

    from clipbias.cli import main
    common = ["audit", "--algo", "dpsgd", "--noise-multiplier", "1.0", "--sample-rate", "0.25", "--steps", "40",
              "--bands", "4", "--bands-strategy", "blt", "--json"]
    assert main([*common, "--mode", "canary", "--trials", "5000", "--seed", "3"]) == 0
    canary = json.loads(capsys.readouterr().out)
    assert canary["mode"] == "blt-mechanism" and not canary["refuted"]
    assert canary["epsilon_claimed"] == pytest.approx(gaussian_exact_epsilon(1.0, 1, 1e-5), rel=1e-6)
    assert main([*common, "--mode", "one-run-ideal", "--batch-size", "100", "--canaries", "2000"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["bands_strategy"] == "blt" and not one["refuted"] and one["score_gap"] > 0.3
    assert one["epsilon_claimed"] == pytest.approx(canary["epsilon_claimed"], rel=1e-9)
    assert main([*common, "--mode", "one-run"]) != 0
    assert "audit it with --mode canary (blt) or one-run-ideal" in capsys.readouterr().err


def test_the_simulated_canary_audit_refuses_a_strategy_it_does_not_simulate():
    from clipbias.audit import CanaryAudit, canary_audit
    with pytest.raises(ConfigError, match="Taylor coefficients"):
        canary_audit(CanaryAudit(algo="dpsgd", noise_multiplier=1.0, sample_rate=0.25, steps=8, batch_size=4.0,
                                 bands=4, bands_strategy="blt", trials=10))
