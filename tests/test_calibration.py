"""Noise calibration: never above the target epsilon, the smallest noise to 0.1 %, the vectorised
one-step PLD equal to dp-accounting's, the search itself on known functions, a progress line for a
slow calibration, and one calibration shared by the ranks of a process group.

The exhaustive sweep (40 grid configurations and 12 random ones, through the CLI, timed) is
``benchmarks/calibration.py``; here a handful of the same kind keeps the suite fast."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from clipbias import privacy
from clipbias.errors import ConfigError
from clipbias.privacy import AccountingSpec, fast_pld, gaussian, pld, search

TOL = search.REL_TOL


def _check_smallest(eps: float, q: float, steps: int, delta: float, accountant: str = "pld") -> float:
    gaussian.calibrate.cache_clear()
    z = gaussian.calibrate(eps, delta, q, steps, accountant)
    assert gaussian.epsilon(z, q, steps, delta, accountant) <= eps  # never overshoots
    if z * (1 - TOL) >= (pld.PLD_MIN_NOISE if accountant == "pld" else 0):  # and is the smallest, to 0.1%
        assert gaussian.epsilon(z * (1 - TOL), q, steps, delta, accountant) > eps
    return z


# corners and middle of the supported range (epsilon in [0.5, 10], q in [1e-3, 0.1], T <= 10^4), cheap ones
@pytest.mark.parametrize("eps,q,steps", [(0.5, 0.1, 10000), (10.0, 0.1, 10), (3.0, 0.01, 1000), (0.5, 0.01, 1)])
def test_pld_calibration_never_overshoots_and_is_the_smallest(eps, q, steps):
    _check_smallest(eps, q, steps, 1e-5)


def test_untuned_configurations():
    """Configurations nobody picked: drawn log-uniformly (a fixed public seed; nothing secret here)."""
    rng = np.random.default_rng(28)
    for _ in range(2):
        eps, q = float(np.exp(rng.uniform(math.log(0.5), math.log(10)))), float(10 ** rng.uniform(-3, -1))
        steps, delta = int(10 ** rng.uniform(1, 4)), float(10 ** rng.uniform(-7, -4))
        _check_smallest(eps, q, steps, delta)
        _check_smallest(eps, q, steps, delta, "rdp")


def test_full_batch_calibration_uses_the_exact_formula():
    z = _check_smallest(2.0, 1.0, 50, 1e-5)
    assert pld.gaussian_exact_epsilon(z, 50, 1e-5) <= 2.0


@pytest.mark.parametrize("z,q,grid", [(0.4, 0.001, 1e-3), (0.25, 0.02, 1e-3), (3.0, 0.1, 1e-4),
                                      (1.0, 1.0, 1e-3), (70.0, 0.1, 1e-4)])
def test_vectorised_pld_is_dp_accountings_bit_for_bit(z, q, grid):
    """``fast_pld.gaussian_pld`` equals the library's public constructor: the same grid, the same
    probabilities and infinity mass in both directions, the same epsilon after composition."""
    from dp_accounting.pld import privacy_loss_distribution as PLD
    ref, mine = PLD.from_gaussian_mechanism(z, value_discretization_interval=grid, sampling_prob=q), \
        fast_pld.gaussian_pld(z, q, grid)
    for a, b in [(ref._pmf_remove, mine._pmf_remove), (ref._pmf_add, mine._pmf_add)]:
        a, b = a.to_dense_pmf(), b.to_dense_pmf()
        assert a._lower_loss == b._lower_loss and a._infinity_mass == b._infinity_mass
        assert np.array_equal(a._probs, b._probs)
    assert ref.self_compose(30).get_epsilon_for_delta(1e-5) == mine.self_compose(30).get_epsilon_for_delta(1e-5)


@pytest.mark.parametrize("z,shifts,probs,grid", [
    (1.0, (1.0, 2.0), (0.99, 0.01), 1e-2),             # DiceSGD's sound step, r = 0.5
    (2.3, (0.2, 1.2), (0.9, 0.1), 1e-3),
    (0.7, (0.05, 1.05), (0.996, 0.004), 1e-2),         # the calibration's coarse grid
    (1.0, (0.0, 1.0), (0.9, 0.1), 1e-3),               # a zero shift: the subsampled Gaussian's range
    (1.0, (0.3, 1.3, 2.0), (0.5, 0.3, 0.2), 1e-2)])    # three components
def test_vectorised_mixture_pld_is_dp_accountings_bit_for_bit(z, shifts, probs, grid):
    """``fast_pld.mixture_pld`` equals ``from_mixture_gaussian_mechanism``: the same grid, probabilities
    and infinity mass in both directions, the same epsilon after composition (grids coarser than the
    report's 1e-3 keep the library's scalar search short here)."""
    from dp_accounting.pld import privacy_loss_distribution as PLD
    ref = PLD.from_mixture_gaussian_mechanism(z, list(shifts), list(probs), value_discretization_interval=grid)
    mine = fast_pld.mixture_pld(z, shifts, probs, grid)
    for a, b in [(ref._pmf_remove, mine._pmf_remove), (ref._pmf_add, mine._pmf_add)]:
        a, b = a.to_dense_pmf(), b.to_dense_pmf()
        assert a._lower_loss == b._lower_loss and a._infinity_mass == b._infinity_mass
        assert np.array_equal(a._probs, b._probs)
    assert ref.self_compose(30).get_epsilon_for_delta(1e-5) == mine.self_compose(30).get_epsilon_for_delta(1e-5)


def test_vectorised_mixture_search_is_the_librarys_recursion_point_by_point():
    """The inverse search alone, both directions, on losses the grid never holds too (unsorted, a NaN,
    outside the range): every output equals the library's recursion's, bit for bit."""
    from dp_accounting.pld import privacy_loss_mechanism as mech
    losses = np.array([3.0, -1.0, 0.3, np.nan, 2.0, 0.30000001, -7.5, 40.0])
    for adjacency in (mech.AdjacencyType.ADD, mech.AdjacencyType.REMOVE):
        args = (0.8, [0.5, 1.5, 1.7], [0.9, 0.07, 0.03])
        ref = mech.MixtureGaussianPrivacyLoss(*args, adjacency_type=adjacency)
        mine = fast_pld._VectorMixtureLoss(*args, adjacency_type=adjacency)
        for bounds, precision in [((-20.0, 20.0), 1e-6), ((-3.0, 5.0), 1e-3), ((0.0, 1e-7), 1e-6)]:
            want = ref._inverse_privacy_losses_with_range(losses, bounds, precision)
            got = mine._inverse_privacy_losses_with_range(losses, bounds, precision)
            assert np.array_equal(want, got), (adjacency, bounds, want, got)


def test_the_search_on_known_functions():
    """``search.calibrate_levels`` against thresholds known in closed form: the answer meets the target
    (it was evaluated), lies within 0.1 % of the true threshold, and a cheap level that is off by 30 %
    (a looser bound) or by a shifted slope only costs evaluations, never the answer."""
    def exact(z):
        return 3.0 / z ** 2 + 0.5 / z  # decreasing, log-log slope between -1 and -2, like epsilon
    thr = (0.5 + math.sqrt(0.25 + 4 * 2.0 * 3.0)) / (2 * 2.0)  # exact(thr) = 2
    seen = []

    def final(z):
        seen.append(z)
        return exact(z)
    for cheap in (lambda z: 1.3 * exact(z), lambda z: exact(z) ** 1.5, lambda z: 0.5 / z):
        seen.clear()
        z = search.calibrate_levels(2.0, [(cheap, 1e-2)], final)
        assert z in seen and exact(z) <= 2.0 and thr <= z <= thr * (1 + TOL)
        assert len(seen) <= 12
    # the floor meets the target: returned after one evaluation of the final function
    seen.clear()
    assert search.calibrate_levels(100.0, [(exact, 1e-2)], final, floor=0.5) == 0.5 and seen == [0.5]
    # a target no noise up to the ceiling reaches: inf, for the caller's error
    assert search.calibrate_levels(1e-9, [(exact, 1e-2)], exact, ceiling=1e3) == math.inf
    # a final function with a step (a discretised bound): still the smallest evaluated point meeting it
    def stepped(z):
        return math.ceil(exact(z) * 50) / 50
    z = search.confirm(stepped, 2.0, thr, -1.5)
    assert stepped(z) <= 2.0 < stepped(z * (1 - TOL))


def test_unreachable_target_is_a_clear_error():
    with pytest.raises(ConfigError, match="unreachable"):
        gaussian.calibrate(1e-9, 1e-5, 1.0, 10000, "pld")  # the exact formula: z ~ 10^11


def test_a_slow_calibration_says_so_on_stderr(capsys, monkeypatch):
    monkeypatch.setattr(privacy, "PROGRESS_AFTER_S", 0.0)
    gaussian.calibrate.cache_clear()
    z = privacy.calibrate(AccountingSpec("gaussian", 0.05), 2.0, 1e-5, 20, "pld")
    err = capsys.readouterr().err
    assert "calibrating the noise multiplier to epsilon 2 (delta 1e-05, 20 steps at q = 0.05, pld)" in err
    assert "calibrated in" in err and z > 0


def ranks_scenario(rank: int, out: str) -> None:
    """Run by both ranks of the session's process group (conftest's ``two_ranks``): an engine calibrated to
    epsilon 2, counting this rank's calls of the calibration."""
    from clipbias.engine.core import DPEngine
    calls = []
    real = privacy.calibrate
    privacy.calibrate = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        engine = DPEngine(torch.nn.Linear(3, 2), "dpsgd", n=100, batch_size=10, steps=20, epsilon=2.0, delta=1e-5)
        torch.save({"calls": len(calls), "z": engine.noise_multiplier}, f"{out}/r.{rank}")
    finally:
        privacy.calibrate = real


@pytest.mark.slow
def test_ranks_of_a_process_group_share_rank_0s_calibration(two_ranks):
    r0, r1 = (torch.load(two_ranks / "test_calibration" / f"r.{i}") for i in range(2))
    assert (r0["calls"], r1["calls"]) == (1, 0)
    gaussian.calibrate.cache_clear()
    assert r0["z"] == r1["z"] == privacy.calibrate(AccountingSpec("gaussian", 0.1), 2.0, 1e-5, 20)
