"""The canary audit: it refutes the paper's DiceSGD bound and never a bound we certify.

The attack (docs/privacy.md, "Audits") runs the library's own pipeline stages over thousands of
independent runs at once: one-parameter model, D = {} vs D' = {canary}, canary gradient 1e4
(the paper's bounded-gradient assumption holds with --grad-bound 1e4).
"""

import json
import math

import numpy as np
import pytest

from clipbias import algorithms, audit
from clipbias.errors import ConfigError

CANARY = dict(algo="dice", noise_multiplier=8.0, sample_rate=0.01, steps=1000, batch_size=10.0, clip=1.0,
              ef_clip=0.1, grad_bound=1e4, trials=4000)


@pytest.fixture(scope="module")
def dice_runs():
    a = audit.CanaryAudit(**CANARY)
    return a, audit.simulate(a, False), audit.simulate(a, True)


def test_null_statistic_is_standard_normal(dice_runs):
    """Under D the feedback buffer stays 0: S is the normalised noise sum, exactly N(0, 1)."""
    _, null, _ = dice_runs
    assert abs(null.mean()) < 0.06 and abs(null.std() - 1) < 0.04


def test_feedback_shift_matches_the_analysis(dice_runs):
    """Once the canary is sampled (after ~1/q steps), clip(e, C2) = C2 is released at every later step:
    the mean shift of S is about sum_t P(sampled before t) C2 / (sigma sqrt(T)) + q T (C1/B) / (...)."""
    a, null, alt = dice_runs
    sigma = a.noise_multiplier * a.clip / a.batch_size
    q, T = a.sample_rate, a.steps
    feedback = sum(1 - (1 - q) ** t for t in range(T)) * a.ef_clip
    own = q * T * a.clip / a.batch_size
    expected = (feedback + own) / (sigma * math.sqrt(T))
    assert alt.mean() - null.mean() == pytest.approx(expected, rel=0.05)  # ~3.6 standard deviations


@pytest.mark.parametrize("basis", ["paper", "authors", "sound", "conservative"])
def test_canary_refutes_exactly_the_refuted_bases(dice_runs, basis):
    a, null, alt = dice_runs
    lb = audit.epsilon_lower_bound(null, alt, a.delta, 0.95)["epsilon_lower_bound"]
    rep = audit.claim(audit.CanaryAudit(**{**CANARY, "dice_accounting": basis}))
    assert lb > 4.0  # the attack is strong: epsilon >= 4 at 95% confidence from 4,000 runs per world
    if rep.certified:
        assert rep.epsilon > lb
    else:
        assert basis in ("paper", "authors") and rep.epsilon < lb  # refuted, and labelled so


def test_every_certified_dice_variant_survives_the_attack():
    """dice-adam and the perturbation combination share the stages; dice-auto's normalised units."""
    for name in ("dice-adam", "dice-perturb", "dice-auto"):
        a = audit.CanaryAudit(**{**CANARY, "algo": name, "trials": 2000})
        r = audit.canary_audit(a)
        assert r["certified"] and r["epsilon_claimed"] > r["epsilon_lower_bound"]


def test_dpsgd_claim_holds_and_an_understated_noise_is_caught():
    honest = audit.canary_audit(audit.CanaryAudit("dpsgd", 1.0, 0.01, 300, 10.0, trials=4000))
    assert honest["certified"] and honest["epsilon_lower_bound"] <= honest["epsilon_claimed"]
    cheat = audit.canary_audit(audit.CanaryAudit("dpsgd", 0.3, 0.01, 1000, 10.0, trials=4000,
                                                 claim_noise_multiplier=3.0))
    assert cheat["refuted"] and cheat["epsilon_lower_bound"] > cheat["epsilon_claimed"]


def test_lower_bound_is_zero_for_identical_worlds():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(5000), rng.standard_normal(5000)
    assert audit.epsilon_lower_bound(x, y, 1e-5)["epsilon_lower_bound"] < 0.2


def test_lower_bound_against_a_known_gaussian_pair():
    """N(0,1) vs N(mu,1) is mu-GDP: the audit's bound must stay below the true epsilon."""
    from clipbias.privacy import pld
    rng = np.random.default_rng(1)
    mu, n = 3.0, 20000
    lb = audit.epsilon_lower_bound(rng.standard_normal(n), mu + rng.standard_normal(n), 1e-5)
    true_eps = pld.gaussian_exact_epsilon(1 / mu, 1, 1e-5)
    assert 2.0 < lb["epsilon_lower_bound"] < true_eps


def test_refusals_name_the_problem():
    with pytest.raises(ConfigError, match="not private"):
        audit.check_batched("sgd")
    with pytest.raises(ConfigError, match="one-run"):
        audit.check_batched("p-avg")
    with pytest.raises(ConfigError, match="`trials`"):
        audit.CanaryAudit("dpsgd", 1.0, 0.01, 10, 10.0, trials=3)
    assert algorithms.get("dice").private


# ---------------------------------------------------------------- one-run audit (Steinke et al. 2023)
def test_one_run_p_value_without_delta_is_the_binomial_tail():
    from scipy.stats import binom
    for eps in (0.0, 0.5, 2.0):
        p = 1 / (1 + math.exp(-eps))
        assert audit.one_run_p_value(1000, 200, 150, eps, 0.0) == pytest.approx(binom.sf(149, 200, p), rel=1e-9)
    # delta only adds: the bound is never below the pure-DP tail
    assert audit.one_run_p_value(1000, 200, 150, 1.0, 1e-5) >= audit.one_run_p_value(1000, 200, 150, 1.0, 0.0)


def test_one_run_bound_against_randomized_response():
    """Guesses right with probability e^eps0 / (1 + e^eps0) (the eps0-DP randomized response, which
    the theorem says is the worst case): the 95% lower bound exceeds eps0 in about 5% of experiments
    (here 1 of 20, seeded) and otherwise approaches it from below."""
    rng = np.random.default_rng(3)
    eps0, r = 2.0, 2000
    hits = []
    for _ in range(20):
        v = int(rng.binomial(r, 1 / (1 + math.exp(-eps0))))
        hits.append(audit.one_run_epsilon_lower_bound(r, r, v, 0.0, 0.95))
    assert sum(h > eps0 for h in hits) <= 2 and np.median(hits) < eps0 and min(hits) > 1.5
    assert audit.one_run_epsilon_lower_bound(1000, 100, 50, 1e-5) == 0.0  # chance guessing: no bound


def test_canary_gradients_insert_dirac_rows_and_keep_real_rows():
    import torch
    from clipbias.grads.rows import FuncGradients
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    inner = FuncGradients(model)
    coords = torch.tensor([4, 1, 7])
    cg = audit.CanaryGradients(inner, coords, 5.0)
    x = torch.randn(4, 3)
    y = torch.tensor([1, -1, 0, -3])  # examples 1 and 3 are canaries 0 and 2
    rows, _ = cg(x, y)
    real, _ = inner(x[[0, 2]], y[[0, 2]])
    assert torch.equal(rows[[0, 2]], real)
    expect = torch.zeros(2, inner.layout.dim)
    expect[0, 4], expect[1, 7] = 5.0, 5.0
    assert torch.equal(rows[[1, 3]], expect)


def test_cli_audit_json_keys(capsys):
    import json
    from clipbias.cli import main
    code = main(["audit", "--algo", "dpsgd", "--noise-multiplier", "0.3", "--claim-noise-multiplier", "3",
                 "--sample-rate", "0.01", "--steps", "500", "--batch-size", "10", "--trials", "2000",
                 "--quiet", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["refuted"] and d["method"] == "canary" and d["trials"] == 2000
    assert {"epsilon_lower_bound", "epsilon_claimed", "certified", "confidence"} <= set(d)


def test_one_run_audit_end_to_end_catches_understated_noise():
    """A real DPEngine run on digits with 400 Dirac gradient canaries: the run at z = 0.3 that claims
    z = 5 (epsilon 0.33) is refuted; the honest claim at z = 0.3 is not (it is far above what 400
    canaries can show). Each run draws a fresh secret key: with 200 canaries the cheat's bound ranged
    0.63-1.65 over eight runs, too close to the claim for a test that must never fail by chance."""
    kw = dict(algo="dpsgd", noise_multiplier=0.3, batch_size=67.35, steps=100, canaries=400, data="digits",
              model="mlp", lr=0.5, clip=1.0, seed=1)
    cheat = audit.one_run_audit(audit.OneRunAudit(**kw, claim_noise_multiplier=5.0))
    assert cheat["refuted"] and cheat["epsilon_lower_bound"] > cheat["epsilon_claimed"]
    assert cheat["canaries"] == 400 and 0 < cheat["correct"] <= cheat["guesses"]
    honest = audit.one_run_audit(audit.OneRunAudit(**kw))
    assert not honest["refuted"] and honest["epsilon_lower_bound"] < honest["epsilon_claimed"]


def test_one_run_audit_runs_the_fast_path_and_records_it(capsys):
    """`clipbias audit --mode one-run --grad-path fast` audits the book-keeping fast path (input
    canaries: the model's own gradients) and records the path in its settings."""
    from clipbias.cli import main
    assert main(["audit", "--mode", "one-run", "--json", "--quiet", "--algo", "dpsgd", "--data", "digits-image",
                 "--model", "mlp", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "5",
                 "--canaries", "20", "--canary-type", "input", "--grad-path", "fast", "--clip", "1", "--lr", "0.1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["grad_path"] == "fast" and out["certified"] and out["canaries"] == 20
