"""One-run epsilon estimators from canary scores: the published reference values, soundness on
simulated Gaussian mechanisms, the candidate thresholds, refusals."""

import itertools
import math

import numpy as np
import pytest
from scipy.stats import norm

from clipbias import audit
from clipbias.audit.estimators import _hull
from clipbias.errors import ConfigError
from clipbias.privacy.pld import gaussian_exact_epsilon


def deterministic_normal(shift: float, n: int) -> np.ndarray:
    """n scores at the mid-quantiles (i + 1/2) / n of N(shift, 1)."""
    return norm.ppf((np.arange(n) + 0.5) / n) + shift


# jax_privacy tests/auditing_test.py, test_epsilon_one_run_close: 10,000 in and 10,000 out scores,
# significance 0.05, delta 1e-6
REFERENCE = [("one-run", 1, 1.13346), ("one-run", 2, 2.311945), ("one-run", 4, 4.395568),
             ("one-run-fdp", 1, 2.164749), ("one-run-fdp", 2, 4.7218075), ("one-run-fdp", 4, 9.133752)]


@pytest.mark.parametrize("method,shift,expected", REFERENCE)
def test_deterministic_normal_matches_the_published_values(method, shift, expected):
    eps = audit.epsilon_from_scores(deterministic_normal(shift, 10_000), deterministic_normal(0, 10_000),
                                    delta=1e-6, significance=0.05, method=method)
    assert eps == pytest.approx(expected, rel=1e-4)


def test_no_shift_no_bound():
    x = deterministic_normal(0, 10_000)
    for method in ("one-run", "one-run-fdp"):
        assert audit.epsilon_from_scores(x, x, delta=1e-6, method=method) == 0.0


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0, 4.0])
def test_simulated_gaussian_mechanism_never_exceeds_the_true_epsilon(mu):
    """m canaries, each in with probability 1/2, scored by the Gaussian mechanism's output
    N(mu * in, 1): the release is mu-GDP for every canary, so its true epsilon at delta is the
    Gaussian mechanism's (computed independently of the estimators); neither 95 % bound may pass
    it in any of 8 seeded experiments, and the f-DP bound is at least the plain one."""
    delta, m = 1e-5, 4000
    true_eps = gaussian_exact_epsilon(1 / mu, 1, delta)
    rng = np.random.default_rng(int(mu * 10))
    for _ in range(8):
        inside = rng.random(m) < 0.5
        scores = rng.standard_normal(m) + mu * inside
        plain = audit.epsilon_from_scores(scores[inside], scores[~inside], delta=delta)
        fdp = audit.epsilon_from_scores(scores[inside], scores[~inside], delta=delta, method="one-run-fdp")
        assert plain <= fdp <= true_eps, (plain, fdp, true_eps)
    if mu >= 2:
        assert fdp > 0.3 * true_eps  # informative, not just sound


def test_the_fdp_bound_is_about_twice_as_tight_and_44_percent_of_the_truth_at_shift_2():
    """The idealised case: deterministic normal scores at shift 2 are a 2-GDP release."""
    a, b = deterministic_normal(2, 10_000), deterministic_normal(0, 10_000)
    plain = audit.epsilon_from_scores(a, b, delta=1e-6)
    fdp = audit.epsilon_from_scores(a, b, delta=1e-6, method="one-run-fdp")
    true_eps = gaussian_exact_epsilon(0.5, 1, 1e-6)
    assert 1.9 < fdp / plain < 2.2 and 0.4 < fdp / true_eps < 0.45


def test_candidate_thresholds_are_the_vertices_of_the_upper_concave_hull():
    """Brute force on small ties-heavy data: a threshold is a candidate exactly when its point
    (missed in, rejected out) lies strictly above every chord between a point on its left and one on
    its right; the endpoints (threshold -inf-like min score and +inf) are always candidates."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        pos, neg = rng.integers(0, 12, 15).astype(float) + 1.5, rng.integers(0, 10, 12).astype(float)
        t_all = np.concatenate([np.unique(np.concatenate([pos, neg])), [math.inf]])
        pts = np.array([[(pos < t).sum(), (neg < t).sum()] for t in t_all], dtype=float)
        keep = []
        for i in range(len(pts)):
            above = all(
                (pts[k, 0] - pts[j, 0]) * (pts[i, 1] - pts[j, 1]) > (pts[k, 1] - pts[j, 1]) * (pts[i, 0] - pts[j, 0])
                for j, k in itertools.product(range(i), range(i + 1, len(pts))))
            keep.append(above)
        t, tp, fp = _hull(pos, neg)
        assert np.array_equal(t, t_all[keep])
        assert np.array_equal(tp, [(pos >= x).sum() for x in t]) and np.array_equal(fp, [(neg >= x).sum() for x in t])


def test_the_witness_is_reported_and_consistent():
    a, b = deterministic_normal(2, 2000), deterministic_normal(0, 2000)
    r = audit.one_run_estimate(a, b, delta=1e-6)
    assert r["correct"] == (a >= r["threshold"]).sum() and r["guesses"] == r["correct"] + (b >= r["threshold"]).sum()
    # the bound is the one of the witness alone at the Bonferroni share of the significance
    alone = audit.one_run_epsilon_lower_bound(4000, r["guesses"], r["correct"], 1e-6, 1 - 0.05 / r["candidates"])
    assert r["epsilon_lower_bound"] == pytest.approx(alone, abs=2e-4)


@pytest.mark.parametrize("kw,match", [
    (dict(in_scores=[]), "in_scores"), (dict(out_scores=[[1.0, 2.0]]), "out_scores"),
    (dict(in_scores=[1.0, math.nan]), "non-finite"), (dict(method="fdp"), "method"),
    (dict(delta=0.0), "delta"), (dict(significance=1.0), "significance")])
def test_refusals_name_the_problem(kw, match):
    args = {"in_scores": [1.0, 2.0], "out_scores": [0.0, 0.5], "delta": 1e-5, **kw}
    with pytest.raises(ConfigError, match=match):
        audit.epsilon_from_scores(args.pop("in_scores"), args.pop("out_scores"), **args)


def test_clipbias_audit_one_run_reports_both_estimates(capsys):
    """The one-run mode prints the plain and the f-DP bound; the verdict is the plain bound's (here
    a run at z = 0.3 claiming z = 20, epsilon 0.04, is refuted by both: the plain bound was 0.76-1.49
    in 8 runs, each under its own secret key)."""
    from clipbias.cli import main
    argv = ["audit", "--mode", "one-run", "--quiet", "--algo", "dpsgd", "--data", "digits", "--model", "mlp",
            "--noise-multiplier", "0.3", "--claim-noise-multiplier", "20", "--sample-rate", "0.05", "--steps", "40",
            "--canaries", "1000", "--clip", "1", "--lr", "0.5", "--seed", "1"]  # 200 canaries: bound 0 in 1 of 16 runs
    assert main(argv) == 0
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    plain, fdp = (float(rows[k].split()[0]) for k in ("epsilon lower bound", "epsilon lower bound, f-DP"))
    claimed = float(rows["epsilon claimed"])
    assert fdp >= plain > claimed and rows["verdict"].strip().startswith("REFUTED")


def test_gdp_reading_of_the_many_run_audit_is_tight_and_sound_on_gaussian_pairs():
    """N(0, 1) vs N(mu, 1), 20,000 samples each (a mu-GDP pair): the GDP reading of the canary
    audit's tests lies between 80 % and 100 % of the true epsilon, where the distribution-free bound
    reaches about 47 %; identical worlds give (almost) nothing."""
    rng = np.random.default_rng(5)
    for mu in (0.5, 1.0, 2.0):
        true_eps = gaussian_exact_epsilon(1 / mu, 1, 1e-5)
        null, alt = rng.standard_normal(20000), mu + rng.standard_normal(20000)
        r = audit.stats.gdp_epsilon_lower_bound(null, alt, 1e-5)
        assert r["mu_lower_bound"] < mu and 0.8 * true_eps < r["epsilon_lower_bound_gdp"] < true_eps
        assert audit.epsilon_lower_bound(null, alt, 1e-5)["epsilon_lower_bound"] < 0.6 * true_eps
    same = audit.stats.gdp_epsilon_lower_bound(rng.standard_normal(20000), rng.standard_normal(20000), 1e-5)
    assert same["mu_lower_bound"] < 0.1


def test_the_union_bound_over_every_threshold():
    """correction="all" splits the significance among all m + 1 thresholds (a union bound over a
    family fixed before the scores): never above the reference's hull split; on the deterministic-
    normal case at shift 2 the f-DP bound drops from 4.72 to 3.92 and the plain one-run bound to 0
    (level 0.05 / 20,001 is below Thm 5.2's delta term 2 m delta max_i ...)."""
    a, b = deterministic_normal(2, 10_000), deterministic_normal(0, 10_000)
    fdp = audit.epsilon_from_scores(a, b, delta=1e-6, method="one-run-fdp", correction="all")
    assert fdp == pytest.approx(3.9176, abs=1e-3) and fdp < audit.epsilon_from_scores(a, b, delta=1e-6,
                                                                                        method="one-run-fdp")
    assert audit.epsilon_from_scores(a, b, delta=1e-6, correction="all") == 0.0
    assert audit.one_run_p_value(20_000, 4666, 4499, 0.0, 1e-6) > 0.05 / 20_001  # the delta term alone
    with pytest.raises(ConfigError, match="correction"):
        audit.epsilon_from_scores(a, b, delta=1e-6, correction="none")
