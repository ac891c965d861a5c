"""Crafted-gradient adversaries of the canary audit: the likelihood-ratio statistic, a per-step
gradient schedule, the anti-canary; the idealised white-box one-run audit. Every certified claim
survives every adversary; DiceSGD's paper bound stays refuted."""


import pytest

from clipbias import audit
from clipbias.errors import ConfigError

DICE = dict(algo="dice", noise_multiplier=8.0, sample_rate=0.02, steps=300, batch_size=10.0, clip=1.0,
            ef_clip=0.1, grad_bound=1e4, trials=1500)
ADVERSARIES = {"dirac": {}, "anti-canary": {"anti_norm": 1000.0}, "charge-drain": {"schedule": "charge-drain"},
               "lr": {"statistic": "lr"}}


@pytest.fixture(scope="module")
def dice_bounds():
    out = {}
    for name, kw in ADVERSARIES.items():
        a = audit.CanaryAudit(**DICE, **kw)
        null, alt = audit.simulate(a, False), audit.simulate(a, True)
        out[name] = (audit.epsilon_lower_bound(null, alt, a.delta)["epsilon_lower_bound"], alt.mean() - null.mean(),
                     audit.stats.gdp_epsilon_lower_bound(null, alt, a.delta)["epsilon_lower_bound_gdp"])
    return out


@pytest.mark.parametrize("name", list(ADVERSARIES))
def test_every_adversary_leaves_the_sound_dice_claim_standing(dice_bounds, name):
    """Also the GDP reading (which presumes a Gaussian trade-off curve, not DiceSGD's)."""
    lb, _, gdp = dice_bounds[name]
    for basis in ("sound", "conservative"):
        rep = audit.claim(audit.CanaryAudit(**DICE, dice_accounting=basis))
        assert rep.certified and lb <= gdp < rep.epsilon


def test_the_anti_canary_doubles_the_feedback_contrast_and_the_paper_bound_stays_refuted(dice_bounds):
    """Under D the anti-canary (gradient -1000, a tenth of the canary's) drives the clipped buffer to
    release -C2 at every step after its first inclusion; under D' the canary's larger residual flips
    it to +C2: the mean shift of S doubles (1.8 -> 3.5 standard deviations) and so does the
    margin of the refutation of Thm 3.8's bound."""
    paper = audit.claim(audit.CanaryAudit(**DICE, dice_accounting="paper"))
    assert not paper.certified
    (lb0, shift0, _), (lb1, shift1, _) = dice_bounds["dirac"], dice_bounds["anti-canary"]
    assert 1.7 < shift1 / shift0 < 2.1
    assert paper.epsilon < lb0 < lb1 and lb1 - paper.epsilon > 2 * (lb0 - paper.epsilon)


@pytest.mark.parametrize("algo", ["dpsgd", "normalized", "perturb"])
def test_gaussian_claims_survive_every_adversary(algo):
    base = dict(algo=algo, noise_multiplier=1.0, sample_rate=0.1, steps=50, batch_size=10.0, trials=2000)
    claimed = audit.claim(audit.CanaryAudit(**base)).epsilon
    for kw in ADVERSARIES.values():
        r = audit.canary_audit(audit.CanaryAudit(**base, **kw))
        assert r["certified"] and r["epsilon_lower_bound"] <= claimed == r["epsilon_claimed"]
        assert r["epsilon_lower_bound_gdp"] <= claimed


def test_the_likelihood_ratio_statistic_is_standardised_and_beats_the_sum_for_dpsgd():
    """Under D the LR statistic is standardised by quadrature moments (not by the runs): mean 0, std 1
    over 4000 runs; the LR test catches a z = 0.5 run claiming z = 2 that the summed statistic misses."""
    a = audit.CanaryAudit("dpsgd", 1.0, 0.05, 60, 10.0, trials=4000, statistic="lr")
    null = audit.simulate(a, False)
    assert abs(null.mean()) < 0.05 and abs(null.std() - 1) < 0.04
    cheat = dict(algo="dpsgd", noise_multiplier=0.5, claim_noise_multiplier=2.0, sample_rate=0.05, steps=60,
                 batch_size=10.0, trials=4000)
    by_sum = audit.canary_audit(audit.CanaryAudit(**cheat))
    by_lr = audit.canary_audit(audit.CanaryAudit(**cheat, statistic="lr"))
    assert by_lr["refuted"] and by_lr["epsilon_lower_bound"] > 1.3 * by_sum["epsilon_lower_bound"]


def test_white_box_one_run_dpsgd_full_batch():
    """Full-batch DPSGD (q = 1, T = 4, z = 1: the Gaussian mechanism, mu = 2, claim 10.0), one run of
    the engine with 4000 Dirac canaries: the f-DP bound reaches at least 35 % of the claim and stays
    below it, above the plain one-run bound; the score gap is mu; a run at z = 0.3 that claims z = 3
    is refuted."""
    r = audit.white_box_one_run(audit.CanaryAudit("dpsgd", 1.0, 1.0, 4, 10.0), canaries=4000)
    assert r["epsilon_claimed"] == pytest.approx(9.997, abs=1e-3) and r["score_gap"] == pytest.approx(2.0, abs=0.1)
    assert 0 < r["epsilon_lower_bound"] < r["epsilon_lower_bound_fdp"] < r["epsilon_claimed"]
    assert r["epsilon_lower_bound_fdp"] > 0.35 * r["epsilon_claimed"] and not r["refuted"]
    cheat = audit.white_box_one_run(audit.CanaryAudit("dpsgd", 0.3, 1.0, 4, 10.0, claim_noise_multiplier=3.0),
                                    canaries=1000)
    assert cheat["refuted"] and cheat["epsilon_lower_bound"] > cheat["epsilon_claimed"]


HIDDEN_STATE = [("dpgd-momentum", 1.0, 2.0, 8), ("inner-outer", 0.2, 1.0, 20), ("perturb", 0.2, 1.0, 20),
                ("adaptive", 0.2, 1.0, 20), ("dice", 0.2, 1.0, 20), ("dice-auto", 0.2, 1.0, 20),
                ("dice-adam", 0.2, 1.0, 20), ("dice-perturb", 0.2, 1.0, 20)]


@pytest.mark.parametrize("algo,q,z,steps", HIDDEN_STATE)
def test_white_box_one_run_every_hidden_state_claim_survives_crafted_canaries(algo, q, z, steps):
    """Each algorithm's own engine (per-example or inner momentum, perturbation, the moving clip,
    error feedback), 400 Dirac canaries with a constant and a charge-drain gradient, both statistics:
    no bound passes the claim; the constant canaries are seen (the in-canaries score higher; the
    charge-drain statistic weighs the second half by -1, which a momentum still pushing +C cancels)."""
    for kw in ({}, {"schedule": "charge-drain", "statistic": "lr"}):
        r = audit.white_box_one_run(audit.CanaryAudit(algo, z, q, steps, 10.0, **kw), canaries=400)
        assert r["certified"] and r["epsilon_lower_bound"] <= r["epsilon_lower_bound_fdp"] < r["epsilon_claimed"]
        assert r["score_gap"] > 0.2 or kw


def test_refusals_name_the_problem():
    with pytest.raises(ConfigError, match="`statistic`"):
        audit.CanaryAudit("dpsgd", 1.0, 0.1, 10, 10.0, statistic="max")
    with pytest.raises(ConfigError, match="`schedule`"):
        audit.CanaryAudit("dpsgd", 1.0, 0.1, 10, 10.0, schedule="random")
    with pytest.raises(ConfigError, match="`CanaryAudit.anti_norm`"):
        audit.CanaryAudit("dpsgd", 1.0, 0.1, 10, 10.0, anti_norm=-1.0)
    with pytest.raises(ConfigError, match="anti-canary"):
        audit.white_box_one_run(audit.CanaryAudit(**DICE, anti_norm=1.0))
