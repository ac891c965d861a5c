"""The audits of banded noise (``--bands``): the adversary un-mixes the noise (y = C g) and scores the
canary's participation blocks; the claim (rate b q, ceil(T / b) compositions) survives, an accounting
that ignores the b-fold rate does not."""

import json
import math

import numpy as np
import pytest
import torch

from clipbias import audit, privacy
from clipbias.algorithms.bands import BandedNoise, coefficients
from clipbias.audit import banded
from clipbias.audit.canary import banded_statistic, step_llr
from clipbias.errors import ConfigError
from clipbias.randomness import SecretKey


@pytest.fixture(scope="module")
def noise_only():
    """4000 runs (columns) of 48 steps of the banded noise stage (b = 4, momentum 0.9) on a zero input."""
    coefs = coefficients(4, 0.9)
    stage = BandedNoise(0.7, SecretKey.from_seed(3), coefs)
    g = []
    for _ in range(48):
        g.append(stage(torch.zeros(4000, dtype=torch.float64)))
        stage.commit()
    return coefs, 0.7, torch.stack(g)


def test_the_releases_undo_the_mixing(noise_only):
    """y = C g is the stage's independent noise: mean 0, variance std^2 per step, uncorrelated across
    steps; the updates g themselves are correlated (lag 1 negative) with a different variance."""
    coefs, std, g = noise_only
    y = banded.releases(g, coefs).numpy() / std
    cov = np.cov(y)  # 48 x 48 over the 4000 runs
    assert np.abs(np.diag(cov) - 1).max() < 0.1 and np.abs(cov - np.diag(np.diag(cov))).max() < 0.08
    lag1 = np.corrcoef(g[10].numpy(), g[11].numpy())[0, 1]
    assert lag1 < -0.2  # the correlated noise the per-step statistic would have faced


def test_the_matched_sum_is_standard_normal_and_the_naive_sum_is_not(noise_only):
    coefs, std, g = noise_only
    s = np.ones(len(g))
    stat = banded.matched_sum(banded.releases(g, coefs), s, coefs, std).numpy()
    assert abs(stat.mean()) < 0.06 and abs(stat.std() - 1) < 0.04
    # the per-step sum sum_t g_t / (std sqrt T) has the variance ||C^-T 1||^2 / T of a dense inverse
    T = len(g)
    C = np.zeros((T, T))
    for k, c in enumerate(coefs):
        C += c * np.eye(T, k=-k)
    expected = np.linalg.norm(np.linalg.solve(C.T, np.ones(T))) / math.sqrt(T)
    naive = (g.sum(0) / (std * math.sqrt(T))).numpy()
    assert abs(naive.std() / expected - 1) < 0.05 and abs(expected - 1) > 0.3


def test_one_class_blocks_are_independent_with_the_truncated_norms(noise_only):
    """w_j = sum_k c_k y_(j+k): var n_j std^2 (n_j < 1 in the last b - 1 steps), independent for j, j + b,
    correlated (sum_k c_k c_(k+1)) for j, j + 1."""
    coefs, std, g = noise_only
    w, n = banded.block_projections(banded.releases(g, coefs), coefs)
    w = w.numpy() / std
    T = len(g)
    assert n[0] == pytest.approx(1.0) and n[T - 1] == pytest.approx(coefs[0] ** 2)
    assert np.allclose(w.var(1), n.numpy(), rtol=0.1)
    assert abs(np.corrcoef(w[8], w[12])[0, 1]) < 0.05
    assert np.corrcoef(w[8], w[9])[0, 1] == pytest.approx(sum(a * b for a, b in zip(coefs, coefs[1:])), abs=0.05)


def test_one_band_is_the_plain_statistic():
    """With coefficients (1,) the banded statistics are the plain ones: the summed projection and the
    standardised per-step likelihood ratio."""
    rng = np.random.default_rng(0)
    u = torch.from_numpy(rng.standard_normal((30, 50)) * 0.4 + 0.1)
    signs = np.where(np.arange(30) < 15, 1.0, -1.0)
    s_col = torch.from_numpy(signs).unsqueeze(1)
    plain_sum = (s_col * u).sum(0) / (0.4 * math.sqrt(30))
    assert torch.allclose(banded_statistic("sum", u, signs, (1.0,), 0.4, 0.3, 0.1), plain_sum)
    x, w = np.polynomial.hermite_e.hermegauss(80)
    w = w / w.sum()
    llr = step_llr(torch.from_numpy(x * 0.4), 0.3, 0.4, 0.1).numpy()
    mean, sd = w @ llr, math.sqrt(w @ (llr - w @ llr) ** 2)
    plain_lr = (step_llr(u, s_col * 0.3, 0.4, 0.1).sum(0) - 30 * mean) / (sd * math.sqrt(30))
    assert torch.allclose(banded_statistic("lr", u, signs, (1.0,), 0.4, 0.3, 0.1), plain_lr)


def test_banded_canary_refutes_an_accounting_that_ignores_the_band_rate():
    """b = 16, q = 1/16, T = 16, z = 1.5: the canary (class known) joins its one step surely and its
    block is a Gaussian release of mu = 1/z: the claim (rate 1, one composition) is 2.75 and holds;
    accounting the T steps at rate q instead (0.96, the plain claim) is refuted."""
    a = audit.CanaryAudit("dpsgd", 1.5, 1 / 16, 16, 10.0, trials=30000, statistic="lr", bands=16, band_class=0)
    r = audit.canary_audit(a)
    ignoring = audit.claim(audit.CanaryAudit("dpsgd", 1.5, 1 / 16, 16, 10.0)).epsilon
    assert r["epsilon_claimed"] == pytest.approx(2.753, abs=2e-3) and ignoring == pytest.approx(0.964, abs=2e-3)
    assert ignoring < r["epsilon_lower_bound"] <= r["epsilon_claimed"] and not r["refuted"]


def test_banded_canary_with_subsampling_stays_below_the_claim():
    """q = 0.1, b = 4 (rate b q = 0.4 at the steps of the class), T = 40, z = 1: both statistics, the
    class drawn per run or known to the adversary: no bound passes the claim."""
    base = dict(algo="dpsgd", noise_multiplier=1.0, sample_rate=0.1, steps=40, batch_size=10.0, trials=4000, bands=4)
    null = audit.simulate(audit.CanaryAudit(**base, statistic="lr"), False)
    assert abs(null.mean()) < 0.3 and 0.6 < null.std() < 1.3  # a fixed scale, not the runs'
    for kw in ({}, {"statistic": "lr"}, {"statistic": "lr", "band_class": 3}):
        r = audit.canary_audit(audit.CanaryAudit(**base, **kw))
        assert r["certified"] and 0 < r["epsilon_lower_bound"] < r["epsilon_claimed"]
        assert r["bands"] == 4


def test_white_box_one_run_with_bands_reads_the_banded_claim():
    """The engine's own sampler draws the classes (q = 0.25, b = 4: every canary joins both steps of
    its class, T = 8, z = 1): the claim is the Gaussian mechanism composed twice (mu = sqrt 2), the
    in-canaries' mixture LR is higher, no bound passes the claim."""
    r = audit.white_box_one_run(audit.CanaryAudit("dpsgd", 1.0, 0.25, 8, 10.0, statistic="lr", bands=4),
                                canaries=2000)
    spec = privacy.AccountingSpec(kind="gaussian", sample_rate=1.0, noise_multiplier=1.0)
    assert r["epsilon_claimed"] == pytest.approx(privacy.account(spec, 2, 1e-5, "pld").epsilon, rel=1e-6)
    assert r["bands"] == 4 and r["score_gap"] > 0.5
    assert 0 < r["epsilon_lower_bound"] <= r["epsilon_lower_bound_fdp"] < r["epsilon_claimed"] and not r["refuted"]


def test_cli_audit_bands(capsys):
    from clipbias.cli import main
    assert main(["audit", "--algo", "dpsgd", "--noise-multiplier", "1", "--sample-rate", "0.05", "--steps", "40",
                 "--batch-size", "10", "--trials", "1000", "--bands", "4", "--band-class", "1", "--statistic", "lr",
                 "--quiet", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bands"] == 4 and d["band_class"] == 1 and d["settings"]["band_momentum"] == 0.9
    assert "4-banded" in d["basis"] and not d["refuted"]


def test_refusals_name_the_problem(capsys):
    with pytest.raises(ConfigError, match="`bands=4` is not available for dice"):
        audit.CanaryAudit("dice", 1.0, 0.1, 10, 10.0, bands=4)
    with pytest.raises(ConfigError, match="bands x q"):
        audit.CanaryAudit("dpsgd", 1.0, 0.5, 10, 10.0, bands=4)
    with pytest.raises(ConfigError, match="`band_class`"):
        audit.CanaryAudit("dpsgd", 1.0, 0.1, 10, 10.0, bands=4, band_class=4)
    from clipbias.cli import main
    assert main(["audit", "--mode", "one-run-ideal", "--algo", "dpsgd", "--noise-multiplier", "1", "--sample-rate",
                 "0.1", "--steps", "8", "--batch-size", "10", "--bands", "4", "--band-class", "0", "--quiet"]) != 0
    assert "--band-class fixes the canary's class in the canary mode" in capsys.readouterr().err
