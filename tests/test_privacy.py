"""Accounting against published values and independent computations."""

import math

import numpy as np
import json

import pytest
from dp_accounting import dp_event as E
from dp_accounting.rdp import rdp_privacy_accountant as rdp_mod
from hypothesis import given, settings
from hypothesis import strategies as st

from clipbias.errors import ConfigError, PrivacyAccountingError
from clipbias.privacy import AccountingSpec, DiceParams, account, dice, gaussian


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


# ---------------------------------------------------------------- DiceSGD: the paper's (refuted) bound
CONFIGS = [
    # q, T, z, C1, C2, B, Gmax
    (0.01, 1000, 20.0, 1.0, 0.01, 100, None),
    (256 / 60000, 2000, 10.0, 1.0, 1 / 256, 256, None),
    (0.05, 300, 40.0, 0.5, 0.5, 50, 0.8),
    (0.004, 5000, 9.0, 1.0, 1.0, 240, 1.5),
]


@pytest.mark.parametrize("q,T,z,c1,c2,B,gmax", CONFIGS)
def test_paper_closed_form(q, T, z, c1, c2, B, gmax):
    """Against an independent evaluation of eq. (25): min over valid alpha of the converted bound."""
    p = DiceParams(q, T, c1, c2, B, gmax)
    eps, alpha = dice.paper_epsilon(p, z, 1e-5)
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


def test_paper_grad_bound_tightens():
    base = DiceParams(0.01, 1000, 1.0, 0.02, 100)  # r = 2: z = 20 passes the feedback check (20/4 >= 4)
    bounded = DiceParams(0.01, 1000, 1.0, 0.02, 100, grad_bound=1.0)  # G' = 0: no clipping error at all
    assert base.feedback_bound == 2 and bounded.feedback_bound == 0
    assert dice.paper_epsilon(bounded, 20.0, 1e-5)[0] < dice.paper_epsilon(base, 20.0, 1e-5)[0]


def test_paper_refusals():
    p = DiceParams(0.01, 100, 1.0, 0.01, 100)
    with pytest.raises(PrivacyAccountingError, match="z >= 8"):
        dice.paper_epsilon(p, 7.9, 1e-5)
    with pytest.raises(PrivacyAccountingError, match="1/5"):
        dice.paper_epsilon(DiceParams(0.25, 100, 1.0, 0.01, 25), 50.0, 1e-5)
    with pytest.raises(PrivacyAccountingError, match="2 Cbar2/B"):  # feedback term: z C1 / (2 G') < 4
        dice.paper_epsilon(DiceParams(0.01, 100, 1.0, 0.05, 100, grad_bound=3.0), 10.0, 1e-5)
    # without --grad-bound the feedback sensitivity is 2 B C2 / B: r = 4 needs z >= 8 r = 32
    r4 = DiceParams(0.01, 100, 1.0, 0.04, 100)
    with pytest.raises(PrivacyAccountingError, match="z >= 8 Cbar2/C1"):
        dice.paper_epsilon(r4, 27.0, 1e-5)
    assert dice.paper_epsilon(r4, 32.0, 1e-5)[0] > 0


def test_paper_calibration_never_overshoots_and_needs_more_noise_than_dpsgd():
    p = DiceParams(256 / 60000, 2340, 1.0, 1.0, 256)
    z = dice.calibrate(3.0, 1e-5, p, "paper")
    assert dice.paper_epsilon(p, z, 1e-5)[0] <= 3.0
    z_dpsgd = gaussian.calibrate(3.0, 1e-5, 256 / 60000, 2340, "rdp")
    assert z >= 8 * 256 and z > 50 * z_dpsgd  # C2 = C1 -> Cbar2 = B C1, z >= 8 r: see docs/privacy.md
    with pytest.raises(PrivacyAccountingError, match="Lemma A.11 needs >= 4"):  # the smallest, to 0.1%: here
        dice.paper_epsilon(p, z * (1 - 1e-3), 1e-5)  # the theorem's own condition z >= 8 r binds


def test_paper_calibration_is_the_smallest_and_at_its_floor():
    """z = 8 is the smallest noise the paper's bound applies to: a loose target returns it; a tight one
    returns a z whose bound meets it while a z 0.1% smaller does not."""
    p = DiceParams(0.01, 10, 1.0, 1e-4, 10)
    assert dice.calibrate(50.0, 1e-5, p, "paper") == 8.0 and dice.paper_epsilon(p, 8.0, 1e-5)[0] <= 50.0
    p = DiceParams(0.01, 1000, 1.0, 1e-3, 10)
    z = dice.calibrate(0.5, 1e-5, p, "paper")
    assert z > 8 and dice.paper_epsilon(p, z, 1e-5)[0] <= 0.5 < dice.paper_epsilon(p, z * (1 - 1e-3), 1e-5)[0]


def test_conservative_and_authors():
    p = DiceParams(0.01, 500, 1.0, 0.02, 100)  # r = B C2 / C1 = 2
    assert p.ratio == pytest.approx(2.0)
    z = 30.0
    assert dice.conservative_epsilon(p, z, 1e-5) == pytest.approx(gaussian.epsilon(z / 5, 1.0, 500, 1e-5))
    assert dice.authors_factor(p) == pytest.approx(math.sqrt(5))
    z_auth = dice.calibrate(2.0, 1e-5, p, "authors", "rdp")
    assert z_auth == pytest.approx(gaussian.calibrate(2.0, 1e-5, 0.01, 500, "rdp") * math.sqrt(5))
    rep = dice.report(p, z_auth, 1e-5, "authors", "rdp")
    assert rep.certified is False and "NOT a proof" in rep.basis and "REFUTED" in rep.basis and rep.epsilon <= 2.0
    zc = dice.calibrate(2.0, 1e-5, p, "conservative")
    assert dice.conservative_epsilon(p, zc, 1e-5) <= 2.0


def test_dice_auto_outside_the_paper_bound_and_sound_in_normalised_units():
    from clipbias import algorithms
    from clipbias.config import AlgoConfig
    spec = algorithms.get("dice-auto").spec(AlgoConfig(), 0.01, 20.0, 5)
    with pytest.raises(PrivacyAccountingError, match="non-expansive"):
        account(spec, 100, 1e-5, dice_accounting="paper")
    assert account(spec, 100, 1e-5, dice_accounting="conservative").certified
    # normalised rows (norm < 1) and feedback e/(||e|| + gamma) (norm < 1 on the average scale): r = B
    assert spec.dice.ratio == pytest.approx(5)
    rep = account(spec, 100, 1e-5)
    assert rep.certified and rep.epsilon == pytest.approx(dice.sound_epsilon(DiceParams(0.01, 100, 1.0, 0.2, 25),
                                                                             20.0, 1e-5))


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
    with pytest.raises(ConfigError, match="`accountant='rdp'`"):
        gaussian.epsilon(1e-3, 0.1, 10, 1e-5, "pld")


# ---------------------------------------------------------------- DiceSGD: the sound bound (default)
SOUND = [  # q, T, z, C1, C2, B
    (0.01, 1000, 8.0, 1.0, 0.1, 10),              # the canary configuration of docs/privacy.md
    (256 / 60000, 2340, 1.5, 1.0, 0.01 / 256, 256),  # Fashion-MNIST scale, r = 0.01
    (0.05, 300, 3.0, 0.5, 0.002, 50),
]


@pytest.mark.parametrize("q,T,z,c1,c2,B", SOUND)
def test_sound_lies_between_dpsgd_and_conservative(q, T, z, c1, c2, B):
    p = DiceParams(q, T, c1, c2, B)
    eps = dice.sound_epsilon(p, z, 1e-5)
    assert gaussian.epsilon(z, q, T, 1e-5, "pld") <= eps <= dice.conservative_epsilon(p, z, 1e-5) * (1 + 1e-3)


def test_sound_value_of_the_canary_configuration():
    """docs/privacy.md: 64.65 (conservative 120.03) where the paper's bound claims 1.63."""
    p = DiceParams(0.01, 1000, 1.0, 0.1, 10, grad_bound=1e4)
    assert dice.sound_epsilon(p, 8.0, 1e-5) == pytest.approx(64.65, abs=0.02)
    assert dice.conservative_epsilon(p, 8.0, 1e-5) == pytest.approx(120.03, abs=0.02)
    assert dice.paper_epsilon(p, 8.0, 1e-5)[0] == pytest.approx(1.634, abs=2e-3)


def test_sound_limits_are_independent_closed_forms():
    """r -> 0: the mixture is the subsampled Gaussian (DPSGD's PLD); q = 1: T Gaussians of shift
    (1 + 2r)/z, which the code computes with the exact mu-GDP formula: checked against the PLD of the
    one-component mixture event."""
    tiny = DiceParams(0.02, 200, 1.0, 1e-9, 10)
    assert dice.sound_epsilon(tiny, 1.2, 1e-5) == pytest.approx(gaussian.epsilon(1.2, 0.02, 200, 1e-5), rel=2e-3)
    full = DiceParams(1.0, 50, 1.0, 0.05, 10)  # r = 0.5
    from dp_accounting import pld as pld_mod
    acc = pld_mod.PLDAccountant(value_discretization_interval=dice.SOUND_DISCRETIZATION)
    acc.compose(dice.sound_event(full, 20.0))
    assert dice.sound_epsilon(full, 20.0, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=2e-3)
    assert dice.sound_epsilon(full, 20.0, 1e-5) == pytest.approx(dice.conservative_epsilon(full, 20.0, 1e-5))


def test_sound_with_a_huge_feedback_shift_is_the_conservative_bound_and_fast():
    """dice-auto's feedback has r = B: a shift of 2r/z = 256 noise stds per step. The PLD grid would
    take minutes (it did: a hang); the conservative GDP bound is proven, instant, and must be used."""
    import time
    p = DiceParams(128 / 1347, 22, 1.0, 1.0, 128)  # r = 128
    t0 = time.perf_counter()
    eps = dice.sound_epsilon(p, 1.0, 1e-5)
    assert time.perf_counter() - t0 < 1.0
    assert eps == dice.conservative_epsilon(p, 1.0, 1e-5) > 1e5
    rep = dice.report(p, 1.0, 1e-5)
    assert rep.certified and "GDP" in rep.basis and rep.epsilon == eps
    below = DiceParams(0.01, 100, 1.0, 0.2, 10)  # r = 2, 2r/z = 4/1 < 5: still the PLD mixture
    assert dice.sound_epsilon(below, 1.0, 1e-5) < dice.conservative_epsilon(below, 1.0, 1e-5)


def _hockey_stick_mixture_1d(q, m0, m1, eps, remove):
    """delta(eps) of (1-q) N(m0, 1) + q N(m1, 1) vs N(0, 1) by quadrature (one direction)."""
    from scipy import integrate
    from scipy.stats import norm
    p = lambda x: (1 - q) * norm.pdf(x - m0) + q * norm.pdf(x - m1)  # noqa: E731
    f = (lambda x: max(p(x) - math.exp(eps) * norm.pdf(x), 0.0)) if remove else (
        lambda x: max(norm.pdf(x) - math.exp(eps) * p(x), 0.0))
    return integrate.quad(f, -30, 40, limit=400, points=[0, m0, m1])[0]


def test_sound_one_step_matches_quadrature():
    """T = 1: the PLD delta(eps) of the sound step, as the reports build it (``pld.one_step_pld``, equal to
    dp-accounting's constructor bit for bit: tests/test_calibration.py), agrees with direct
    quadrature of the hockey-stick divergence of the mixture pair (both directions), and is never below
    it (pessimistic)."""
    from clipbias.privacy import pld
    q, z, r = 0.1, 1.0, 0.3
    step = dice.sound_step_event(DiceParams(q, 1, 1.0, r / 10, 10), z)
    one = pld.one_step_pld("mixture", z, tuple(step.sensitivities), tuple(step.sampling_probs),
                           dice.SOUND_DISCRETIZATION)
    for eps in (0.1, 0.5, 1.0):
        exact = max(_hockey_stick_mixture_1d(q, 2 * r / z, (2 * r + 1) / z, eps, rm) for rm in (True, False))
        got = one.get_delta_for_epsilon(eps)
        assert exact * (1 - 1e-6) <= got <= exact * 1.01 + 1e-6


def _hockey_stick_2d(q, a, b, eps, remove, h=0.01, lim=9.0):
    """delta(eps) of (1-q) N(b, I) + q N(a + b, I) vs N(0, I) on a 2-D grid (vectors a, b in R^2)."""
    xs = np.arange(-lim, lim + 3, h)
    g1 = lambda m: np.exp(-0.5 * (xs - m) ** 2) / math.sqrt(2 * math.pi)  # noqa: E731
    g = lambda m: np.outer(g1(m[0]), g1(m[1]))  # noqa: E731  the 2-D density on the grid, separable
    P = (1 - q) * g(b) + q * g(a + b)
    Q = g(np.zeros(2))
    diff = P - math.exp(eps) * Q if remove else Q - math.exp(eps) * P
    return float(np.clip(diff, 0, None).sum() * h * h)


@pytest.mark.parametrize("q,na,nb", [(0.3, 1.0, 0.6), (0.05, 2.0, 0.5), (0.6, 0.7, 1.2)])
def test_aligned_shifts_are_the_worst_case(q, na, nb):
    """The dominating pair puts a (norm <= C1/B) and b (norm <= 2 C2) on one ray at full norm: check,
    over the angle between them and over smaller norms, that no configuration has a larger
    hockey-stick divergence, in either direction (docs/privacy.md, "Sound accounting")."""
    for eps in (0.2, 1.0):
        for remove in (True, False):
            worst = _hockey_stick_2d(q, np.array([na, 0.0]), np.array([nb, 0.0]), eps, remove)
            for theta in np.linspace(0, math.pi, 7)[1:]:
                a = na * np.array([math.cos(theta), math.sin(theta)])
                assert _hockey_stick_2d(q, a, np.array([nb, 0.0]), eps, remove) <= worst + 1e-9
            for sa, sb in ((0.5, 1.0), (1.0, 0.5), (0.0, 1.0), (1.0, 0.0)):
                smaller = _hockey_stick_2d(q, np.array([sa * na, 0.0]), np.array([sb * nb, 0.0]), eps, remove)
                assert smaller <= worst + 1e-9


def test_sound_calibration_never_overshoots():
    p = DiceParams(0.01, 500, 1.0, 0.002, 10)  # r = 0.02
    z = dice.calibrate(3.0, 1e-5, p, "sound")
    assert dice.sound_epsilon(p, z, 1e-5) <= 3.0
    assert dice.sound_epsilon(p, z * (1 - 1e-3), 1e-5) > 3.0  # and not wastefully large (0.1% tolerance)
    assert z > gaussian.calibrate(3.0, 1e-5, 0.01, 500, "pld")


@pytest.mark.parametrize("eps,q,T,c1,c2,B", [
    (1.0, 0.05, 300, 0.5, 0.002, 50),     # r = 0.2
    (3.0, 0.01, 1000, 1.0, 0.1, 10),      # r = 1
    (2.0, 1.0, 50, 1.0, 0.05, 10),        # q = 1: the exact GDP branch
])
def test_sound_calibration_is_the_smallest_that_meets_the_target(eps, q, T, c1, c2, B):
    """At the report's grid: epsilon(z) <= target < epsilon(z (1 - 0.1%)), and z within its bracket."""
    p = DiceParams(q, T, c1, c2, B)
    z = dice.calibrate(eps, 1e-5, p, "sound")
    assert dice.sound_epsilon(p, z, 1e-5) <= eps < dice.sound_epsilon(p, z * (1 - 1e-3), 1e-5)
    assert gaussian.calibrate(eps, 1e-5, q, T, "pld") * (1 - 1e-3) <= z <= dice.calibrate(eps, 1e-5, p, "conservative") * 1.01


def test_sound_calibration_evaluates_the_bound_fewer_times_than_a_bisection(monkeypatch):
    """The secant search (coarse grid to aim, report grid to confirm) against the plain bisection between
    DPSGD's z and the conservative z on the same configuration: fewer evaluations at the report's grid,
    and fewer in all (the coarse grid's cost 8x less each), and the same answer to 0.1%."""
    calls = []
    real = dice.sound_epsilon
    monkeypatch.setattr(dice, "sound_epsilon", lambda p, z, d, grid=dice.SOUND_DISCRETIZATION:
                        calls.append(grid) or real(p, z, d, grid))
    eps, p = 1.0, DiceParams(0.05, 300, 0.5, 0.002, 50)
    dice.calibrate.cache_clear()
    z = dice.calibrate(eps, 1e-5, p, "sound")
    ours = list(calls)
    calls.clear()
    lo = gaussian.calibrate(eps, 1e-5, 0.05, 300, "pld") * (1 - 2e-3)
    zb = gaussian.smallest_noise(lambda z: dice.sound_epsilon(p, z, 1e-5) <= eps, lo,
                                 dice.calibrate(eps, 1e-5, p, "conservative"))
    assert set(calls) == {dice.SOUND_DISCRETIZATION} and len(calls) >= 10
    assert ours.count(dice.SOUND_DISCRETIZATION) < len(calls) / 2 and len(ours) < len(calls)
    assert z == pytest.approx(zb, rel=1.1e-3)


def test_sound_is_the_default_and_refuted_bases_are_not_certified():
    spec = AccountingSpec("dice", 0.01, 8.0, "DiceSGD", DiceParams(0.01, 1, 1.0, 0.1, 10, 1e4))
    rep = account(spec, 1000, 1e-5)
    assert rep.certified and rep.epsilon == pytest.approx(64.65, abs=0.02) and "sound" in rep.basis
    for basis in ("paper", "authors"):
        r = account(spec, 1000, 1e-5, dice_accounting=basis)
        assert r.certified is False and "REFUTED" in r.basis
    with pytest.raises(ConfigError, match="renamed 'paper'"):
        account(spec, 1000, 1e-5, dice_accounting="certified")


def test_sound_dp_event_accounts_like_the_report():
    from dp_accounting import pld
    spec = AccountingSpec("dice", 0.01, 3.0, "DiceSGD", DiceParams(0.01, 1, 1.0, 0.005, 10))
    acc = pld.PLDAccountant(value_discretization_interval=dice.SOUND_DISCRETIZATION)
    acc.compose(spec.dp_event(300))
    assert acc.get_epsilon(1e-5) == pytest.approx(account(spec, 300, 1e-5).epsilon, rel=1e-9)


def test_the_one_bisection_finds_the_threshold_and_never_returns_a_failing_z():
    """``gaussian.smallest_noise`` (every calibrator's bisection): within 0.1% above a known threshold,
    and when ``ok(hi)`` is false at first (a discretised bound above its bracket) it moves up first."""
    thr = 1.2345
    z = gaussian.smallest_noise(lambda z: z >= thr, 0.0, 4.0)
    assert thr <= z <= thr * (1 + 1e-3)
    z = gaussian.smallest_noise(lambda z: z >= thr, 0.5, 1.2)  # hi fails: the bracket moves up
    assert thr <= z <= thr * (1 + 1e-3)
    calls = []
    assert gaussian.smallest_noise(lambda z: calls.append(z) or z >= 2.0, 1.0, 3.0, rel_tol=1e-6) >= 2.0
    assert all(v > 1.0 for v in calls)  # never evaluates below the bracket


@pytest.mark.parametrize("z,q,steps", [(1.0, 256 / 60000, 234), (0.8, 0.01, 1000)])
def test_cached_one_step_pld_gives_the_accountants_epsilon(z, q, steps):
    """Epsilon from the per-process one-step PLD composed T times equals dp-accounting's
    PLDAccountant built from scratch for the same event (Gaussian and DiceSGD's sound mixture)."""
    from dp_accounting import dp_event as E
    from dp_accounting.pld import pld_privacy_accountant as P

    from clipbias.privacy import dice, gaussian
    a = P.PLDAccountant()
    a.compose(E.PoissonSampledDpEvent(q, E.GaussianDpEvent(z)), steps)
    assert gaussian.epsilon(z, q, steps, 1e-5, "pld") == pytest.approx(a.get_epsilon(1e-5), rel=1e-9)
    p = dice.DiceParams(q, steps, 1.0, 0.01, 1.0)
    b = P.PLDAccountant(value_discretization_interval=dice.SOUND_DISCRETIZATION)
    b.compose(dice.sound_event(p, z))
    assert dice.sound_epsilon(p, z, 1e-5) == pytest.approx(b.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("event", [
    E.SelfComposedDpEvent(E.PoissonSampledDpEvent(256 / 60000, E.GaussianDpEvent(0.9)), 2340),
    E.GaussianDpEvent(3.0),
    E.RepeatAndSelectDpEvent(E.ComposedDpEvent([E.SelfComposedDpEvent(E.PoissonSampledDpEvent(
        0.05, E.GaussianDpEvent(1.2)), 60), E.GaussianDpEvent(25.0)]), 8.0, 1.0),
    E.SelfComposedDpEvent(E.PoissonSampledDpEvent(0.3, E.ComposedDpEvent([E.GaussianDpEvent(2.0),
                                                                           E.GaussianDpEvent(4.0)])), 7)])
def test_the_rdp_accountant_with_kept_gaussian_leaves_is_dp_accountings_bit_for_bit(event):
    """``rdp.CachedRdpAccountant`` (the RDP accountant, the tuning's) keeps each Gaussian leaf's RDP per process:
    a first and a second (kept) composition give dp-accounting's RDP at every order and its epsilon exactly."""
    from dp_accounting.rdp import rdp_privacy_accountant as R

    from clipbias.privacy import rdp
    ref = R.RdpAccountant().compose(event)
    for _ in range(2):
        got = rdp.accountant().compose(event)
        assert isinstance(got, rdp.CachedRdpAccountant)
        assert np.array_equal(got._rdp, ref._rdp) and got.get_epsilon(1e-5) == ref.get_epsilon(1e-5)


def test_a_target_epsilon_that_does_not_bind_is_explained_on_the_spot(capsys, monkeypatch):
    """A target the PLD floor z = 0.1 cannot reach (epsilon(0.1) = 160 here: a stand-in accountant
    eps = 16 / z at every PLD grid, monotone like the real one, which takes seconds per evaluation at the
    floor; the real case is epsilon 500 in 10 steps at q = 0.01, which gives 160.2): calibrate never
    evaluates below the floor, confirms the floor with one evaluation of the accountant's grid, and says
    why the epsilon is far below the target."""
    from clipbias.cli import main
    from clipbias.privacy import gaussian, pld
    from clipbias.privacy.gaussian import floor_note
    calls = []
    monkeypatch.setattr(pld, "pld_epsilon", lambda z, q, t, d, grid: calls.append((z, grid)) or 16.0 / z)
    gaussian.calibrate.cache_clear()
    assert main(["calibrate", "--algo", "dpsgd", "--epsilon", "500", "--delta", "1e-5", "--sample-rate", "0.0123",
                 "--steps", "10", "--json"]) == 0
    gaussian.calibrate.cache_clear()
    out = capsys.readouterr()
    got = json.loads(out.out)
    assert got["noise_multiplier"] == 0.1 and got["epsilon"] == pytest.approx(160)
    assert min(z for z, _ in calls) == 0.1  # never below the floor
    # one evaluation at the accountant's grid confirms the floor, one more is the report's
    assert [z for z, grid in calls if grid == pld.PLD_DISCRETIZATION] == [0.1, 0.1]
    assert "epsilon 160 is far below the target 500" in out.err and "floor (0.1" in out.err
    assert "--accountant rdp" in out.err
    assert floor_note(3.0, 2.99, 1.1, "pld") is None and floor_note(None, 1.0, 0.1, "pld") is None
