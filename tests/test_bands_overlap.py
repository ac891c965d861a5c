"""benchmarks/bands_overlap.py: the conditional-composition bound for bands wider than the class spacing and
the Monte Carlo epsilon of one canary, checked against the amplified bands' claim, against each other and
(the posterior cap, the lemma the bound rests on) against the exact posterior."""

import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from clipbias.algorithms.band_strategy import optimized
from clipbias.privacy import AccountingSpec, account

_SPEC = importlib.util.spec_from_file_location(
    "bands_overlap", Path(__file__).resolve().parents[1] / "benchmarks" / "bands_overlap.py")
bo = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bo)


def test_without_shared_rows_the_bound_is_the_amplified_bands_claim():
    steps, k, q, z = 40, 4, 0.05, 1.5
    c = np.array(optimized(k, steps, 0.9))
    claim = account(AccountingSpec("gaussian", q, z, bands=k), steps, 1e-5).epsilon
    for bound in (bo.conditional_bound(c, k, k * q, z, steps, 0.5, 0.1),
                  bo.conditional_bound(bo.scaled_tail(optimized(2 * k, steps, 0.9), k, 0.0), k, k * q, z, steps,
                                       0.5, 0.1)):
        assert bound == pytest.approx(claim, rel=2e-3)  # 1e-3 against the accountant's 1e-4 grid


def test_the_canary_estimate_matches_the_exact_claim_without_overlap_and_stays_below_the_bound_with_it():
    steps, k, z, delta = 24, 3, 1.2, 1e-3
    disjoint = np.array(optimized(k, steps, 0.9))
    claim = bo.conditional_bound(disjoint, k, 0.3, z, steps, 0.5, 0.1, delta=delta)
    estimate = bo.instance_epsilon(bo.class_gram(disjoint, k, steps), 0.3, z, delta=delta, n=200_000)
    assert estimate == pytest.approx(claim, rel=0.03)
    wide = np.array(optimized(2 * k, steps, 0.9))
    for p in (0.1, 0.3):
        exact = bo.instance_epsilon(bo.class_gram(wide, k, steps), p, z, delta=delta, n=200_000)
        assert exact < bo.conditional_bound(wide, k, p, z, steps, 0.5, 0.1, delta=delta)


def test_the_posterior_of_the_previous_participation_exceeds_its_cap_at_most_delta1_of_the_time():
    """Two shared participations and the one before them (k = 3, b = 6, T = 9, aligned unit canary): the
    exact posterior that x joined step 3, given rows 0..5, by enumerating the bits of steps 0 and 3, exceeds
    ``posterior_cap`` on at most delta_1 of the runs, in the world with x (every bit pattern) and without."""
    k, steps, z, p, delta1, n = 3, 9, 1.0, 0.3, 0.02, 200_000
    c = np.array(optimized(2 * k, steps, 0.9))
    head, tail = c[:k], c[k:]
    cap = bo.posterior_cap(p, float(np.linalg.norm(head)), abs(float(tail @ head)), z, delta1)
    col0, col3 = np.zeros(6), np.zeros(6)
    col0[:6], col3[3:6] = c, head
    rng = np.random.default_rng(1)

    def posterior(y):
        logs = {}
        for s0, s3 in itertools.product((0, 1), repeat=2):
            mean = s0 * col0 + s3 * col3
            logs[s0, s3] = (np.log(p if s0 else 1 - p) + np.log(p if s3 else 1 - p)
                            - ((y - mean) ** 2).sum(axis=1) / (2 * z * z))
        num = np.logaddexp(logs[0, 1], logs[1, 1])
        return np.exp(num - np.logaddexp(num, np.logaddexp(logs[0, 0], logs[1, 0])))

    worlds = [np.zeros(6)] + [s0 * col0 + s3 * col3 for s0, s3 in itertools.product((0, 1), repeat=2)]
    for mean in worlds:
        y = mean + z * rng.standard_normal((n, 6))
        over = float(np.mean(posterior(y) > cap))
        assert over <= delta1 + 4 * math.sqrt(delta1 / n), (mean, over)
    assert p < cap < 1


def test_the_calibration_finds_the_smallest_noise_within_its_tolerance_from_either_side():
    calls = []

    def epsilon_of(z):
        calls.append(z)
        return 3.0 * (2.0 / z) ** 1.7 + 0.01 * z

    for start in (0.5, 2.0, 9.0):
        calls.clear()
        z = bo.calibrate_z(epsilon_of, 3.0, start=start, rtol=0.003)
        assert epsilon_of(z) <= 3.0 < epsilon_of(z / 1.003)
        assert len(calls) <= 16
