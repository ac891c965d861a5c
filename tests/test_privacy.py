"""Accounting against published values and independent computations."""

import math

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_mod
from hypothesis import given, settings
from hypothesis import strategies as st

from clipbias.errors import ConfigError, PrivacyAccountingError
from clipbias.privacy import AccountingSpec, DiceParams, account, calibrate, dice, gaussian


@pytest.mark.parametrize("q,z,T,acc,expected,tol", [
    (0.04, 1.5, 2250, "rdp", 7.3291, 1e-3),
    (0.04, 1.5, 2250, "pld", 6.77, 0.01),
    (256 / 60000, 1.1, 14063, "rdp", 2.597, 1e-3),
    (256 / 60000, 1.1, 14063, "pld", 2.382, 1e-3),
])
def test_published_values(q, z, T, acc, expected, tol):
    assert gaussian.epsilon(z, q, T, 1e-5, acc) == pytest.approx(expected, abs=tol)


@pytest.mark.parametrize("z,T", [(20.0, 100), (1.0, 1), (3.0, 50)])
def test_full_batch_exact_matches_dp_accounting_pld(z, T):
    """q = 1 uses the exact mu-GDP formula; dp-accounting's PLD is the independent check."""
    from dp_accounting import dp_event, pld
    acc = pld.PLDAccountant()
    acc.compose(dp_event.GaussianDpEvent(z), T)
    assert gaussian.epsilon(z, 1.0, T, 1e-5, "pld") == pytest.approx(acc.get_epsilon(1e-5), rel=2e-3)


@settings(max_examples=8, deadline=None)
@given(q=st.floats(1e-3, 0.5), T=st.integers(1, 3000), eps=st.floats(0.3, 8.0))
def test_calibration_never_overshoots_rdp(q, T, eps):
    z = gaussian.calibrate(eps, 1e-5, q, T, "rdp")
    assert gaussian.epsilon(z, q, T, 1e-5, "rdp") <= eps
    assert gaussian.epsilon(z * 0.99, q, T, 1e-5, "rdp") > eps * 0.999  # and is not far too noisy


@pytest.mark.parametrize("q,T,eps", [(0.01, 500, 1.0), (256 / 60000, 2000, 3.0)])
def test_calibration_never_overshoots_pld(q, T, eps):
    z = gaussian.calibrate(eps, 1e-5, q, T, "pld")
    assert gaussian.epsilon(z, q, T, 1e-5, "pld") <= eps


def test_zero_noise_is_infinite_epsilon():
    rep = account(AccountingSpec("none", 0.1), 10, 1e-5)
    assert math.isinf(rep.epsilon) and not rep.certified and rep.accountant == "none"


@pytest.mark.parametrize("bad", [dict(delta=0.0), dict(delta=1.0), dict(q=0.0), dict(q=1.5), dict(T=0)])
def test_invalid_inputs(bad):
    args = dict(z=1.0, q=0.1, T=10, delta=1e-5) | bad
    with pytest.raises(ConfigError):
        gaussian.epsilon(args["z"], args["q"], args["T"] if args["T"] else -1, args["delta"])


# ---------------------------------------------------------------- Lemma A.11 (Mironov et al. 2019 Thm 11)
@pytest.mark.parametrize("q,sigma", [(0.01, 4.0), (0.004, 5.0), (0.1, 8.0), (0.2, 4.5)])
def test_lemma_a11_region_is_sound(q, sigma):
    """Where our condition check says Thm 11 applies, the exact RDP is below 2 q^2 alpha / sigma^2."""
    alphas = np.array([1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256])
    valid = dice.lemma_a11_valid(q, sigma, alphas)
    assert valid.any()
    exact = rdp_mod._compute_rdp_poisson_subsampled_gaussian(q, sigma, alphas)
    bound = 2 * q**2 * alphas / sigma**2
    assert np.all(exact[valid] <= bound[valid] * (1 + 1e-9))


def test_lemma_a11_refuses_outside_conditions():
    a = np.array([2.0, 4.0, 8.0])
    assert not dice.lemma_a11_valid(0.21, 10.0, a).any()   # q > 1/5
    assert not dice.lemma_a11_valid(0.01, 3.99, a).any()   # sigma < 4


def test_rdp_conversion_tighter_than_lemma_a6():
    alphas = np.array([1.5, 2.0, 10.0, 64.0])
    rdp = np.array([0.1, 0.3, 1.0, 2.0])
    ours = dice.rdp_to_dp(alphas, rdp, 1e-5)
    a6 = rdp + math.log(1e5) / (alphas - 1)
    assert np.all(ours <= a6)
    # and equals dp-accounting's own conversion
    for a, r in zip(alphas, rdp):
        ref, _ = rdp_mod.compute_epsilon([a], [r], 1e-5)
        assert ours[list(alphas).index(a)] == pytest.approx(ref, rel=1e-9)


# ---------------------------------------------------------------- DiceSGD certified accountant
CONFIGS = [
    # q, T, z, C1, C2, B, Gmax
    (0.01, 1000, 20.0, 1.0, 0.01, 100, None),
    (256 / 60000, 2000, 10.0, 1.0, 1 / 256, 256, None),
    (0.05, 300, 40.0, 0.5, 0.5, 50, 0.8),
    (0.004, 5000, 9.0, 1.0, 1.0, 240, 1.5),
]


@pytest.mark.parametrize("q,T,z,c1,c2,B,gmax", CONFIGS)
def test_certified_closed_form(q, T, z, c1, c2, B, gmax):
    """Against an independent evaluation of eq. (25): min over valid alpha of the converted bound."""
    p = DiceParams(q, T, c1, c2, B, gmax)
    eps, alpha = dice.certified_epsilon(p, z, 1e-5)
    cbar2 = B * c2 if gmax is None else min(B * c2, gmax - c1)
    per_alpha = lambda a: (16 * a * T * q**2 * (1 + 2 * (cbar2 / c1) ** 2) / z**2
                           + math.log((a - 1) / a) - (math.log(1e-5) + math.log(a)) / (a - 1))
    grid = np.linspace(1.001, 2000, 400000)
    ok = dice.lemma_a11_valid(q, z / 2, grid)
    if cbar2 > 0:  # the feedback term's Lemma A.11 application, at the sensitivity eq. (25) uses
        ok &= dice.lemma_a11_valid(q, z * c1 / (2 * cbar2), grid)
    best = min(per_alpha(a) for a in grid[ok][::50]) if ok.sum() > 50 else min(per_alpha(a) for a in grid[ok])
    assert eps == pytest.approx(best, rel=5e-3)
    assert eps <= per_alpha(alpha) + 1e-9


def test_certified_grad_bound_tightens():
    base = DiceParams(0.01, 1000, 1.0, 0.02, 100)  # r = 2: z = 20 passes the feedback check (20/4 >= 4)
    bounded = DiceParams(0.01, 1000, 1.0, 0.02, 100, grad_bound=1.0)  # G' = 0: no clipping error at all
    assert base.feedback_bound == 2 and bounded.feedback_bound == 0
    assert dice.certified_epsilon(bounded, 20.0, 1e-5)[0] < dice.certified_epsilon(base, 20.0, 1e-5)[0]


def test_certified_refusals():
    p = DiceParams(0.01, 100, 1.0, 0.01, 100)
    with pytest.raises(PrivacyAccountingError, match="z >= 8"):
        dice.certified_epsilon(p, 7.9, 1e-5)
    with pytest.raises(PrivacyAccountingError, match="1/5"):
        dice.certified_epsilon(DiceParams(0.25, 100, 1.0, 0.01, 25), 50.0, 1e-5)
    with pytest.raises(PrivacyAccountingError, match="2 Cbar2/B"):  # feedback term: z C1 / (2 G') < 4
        dice.certified_epsilon(DiceParams(0.01, 100, 1.0, 0.05, 100, grad_bound=3.0), 10.0, 1e-5)
    # without --grad-bound the feedback sensitivity is 2 B C2 / B: r = 4 needs z >= 8 r = 32
    r4 = DiceParams(0.01, 100, 1.0, 0.04, 100)
    with pytest.raises(PrivacyAccountingError, match="z >= 8 Cbar2/C1"):
        dice.certified_epsilon(r4, 27.0, 1e-5)
    assert dice.certified_epsilon(r4, 32.0, 1e-5)[0] > 0


def test_certified_calibration_never_overshoots_and_needs_more_noise_than_dpsgd():
    p = DiceParams(256 / 60000, 2340, 1.0, 1.0, 256)
    z = dice.calibrate(3.0, 1e-5, p, "certified")
    assert dice.certified_epsilon(p, z, 1e-5)[0] <= 3.0
    z_dpsgd = gaussian.calibrate(3.0, 1e-5, 256 / 60000, 2340, "rdp")
    assert z >= 8 * 256 and z > 50 * z_dpsgd  # C2 = C1 -> Cbar2 = B C1, z >= 8 r: see docs/privacy.md


def test_conservative_and_authors():
    p = DiceParams(0.01, 500, 1.0, 0.02, 100)  # r = B C2 / C1 = 2
    assert p.ratio == pytest.approx(2.0)
    z = 30.0
    assert dice.conservative_epsilon(p, z, 1e-5) == pytest.approx(gaussian.epsilon(z / 5, 1.0, 500, 1e-5))
    assert dice.authors_factor(p) == pytest.approx(math.sqrt(5))
    z_auth = dice.calibrate(2.0, 1e-5, p, "authors", "rdp")
    assert z_auth == pytest.approx(gaussian.calibrate(2.0, 1e-5, 0.01, 500, "rdp") * math.sqrt(5))
    rep = dice.report(p, z_auth, 1e-5, "authors", "rdp")
    assert rep.certified is False and "NOT a proof" in rep.basis and rep.epsilon <= 2.0
    zc = dice.calibrate(2.0, 1e-5, p, "conservative")
    assert dice.conservative_epsilon(p, zc, 1e-5) <= 2.0


def test_dice_auto_is_not_certifiable():
    from clipbias import algorithms
    from clipbias.algorithms import AlgoConfig
    spec = algorithms.get("dice-auto").spec(AlgoConfig(), 0.01, 20.0, 100)
    with pytest.raises(PrivacyAccountingError, match="non-expansive"):
        account(spec, 100, 1e-5, dice_accounting="certified")
    assert account(spec, 100, 1e-5, dice_accounting="conservative").certified


def test_spec_dp_event_accounts_like_the_report():
    from dp_accounting import pld
    spec = AccountingSpec("gaussian", 0.01, 1.3, "clip")
    acc = pld.PLDAccountant()
    acc.compose(spec.dp_event(400))
    assert acc.get_epsilon(1e-5) == pytest.approx(account(spec, 400, 1e-5).epsilon, rel=1e-9)


def test_pld_grid_too_large_is_a_clear_config_error(monkeypatch):
    """An accountant that runs out of memory (PLD grid of an extreme z, q) becomes a ConfigError
    naming the fix, never a raw MemoryError traceback."""
    from dp_accounting.pld import pld_privacy_accountant

    def boom(self, event, count=1):
        raise MemoryError

    monkeypatch.setattr(pld_privacy_accountant.PLDAccountant, "compose", boom)
    with pytest.raises(ConfigError, match="--accountant rdp"):
        gaussian.epsilon(1e-3, 0.1, 10, 1e-5, "pld")
