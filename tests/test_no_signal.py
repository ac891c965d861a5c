"""A budget that leaves only noise (issue 57): calibration to a tiny epsilon warns with the number and what it
means (``clipbias.engine.accounting.no_signal``), and the search reaches it without exhausting its cheap
accountants, which cannot resolve such epsilons (``search.approach``), still never below the accountant's z."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from clipbias.engine import DPEngine
from clipbias.engine.accounting import NoSignalWarning, no_signal
from clipbias.privacy import gaussian, search


def _engine(epsilon: float) -> DPEngine:
    return DPEngine(torch.nn.Linear(4, 2), "dpsgd", n=60000, batch_size=256, epochs=1, epsilon=epsilon)


def test_a_budget_that_leaves_only_noise_warns_with_the_number():
    with pytest.warns(NoSignalWarning) as record:
        engine = _engine(1e-4)
    [w] = [r for r in record if r.category is NoSignalWarning]
    z, B, T = engine.noise_multiplier, engine.expected_batch_size, engine.total_steps
    msg = str(w.message)
    assert z > B * math.sqrt(T) and f"{z:.6g}" in msg and f"B*C = {B:g}*C" in msg and f"{T} steps" in msg
    assert f"{z / B:.3g}x" in msg and f"{z / (B * math.sqrt(T)):.3g}x" in msg and "Raise epsilon" in msg


def test_a_small_but_useful_budget_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoSignalWarning)
        engine = _engine(1e-3)  # z about 237: 0.06x of the run's largest signal per coordinate
    assert engine.noise_multiplier < engine.expected_batch_size * math.sqrt(engine.total_steps)
    with warnings.catch_warnings():  # a given noise multiplier is the user's choice: no calibration, no warning
        warnings.simplefilter("error", NoSignalWarning)
        DPEngine(torch.nn.Linear(4, 2), "dpsgd", n=100, batch_size=10, steps=4, noise_multiplier=1e6)


def test_the_threshold_is_the_runs_best_case():
    """z > B sqrt(T): the noise of the whole run exceeds, per coordinate, its largest total clipped signal."""
    assert no_signal(159.9, 1.0, 16, 100) is None and no_signal(160.1, 1.0, 16, 100) is not None
    assert no_signal(1e9, 1.0, 16, 0) is None  # no planned steps: nothing to compare


def test_tiny_epsilon_calibrates_in_few_evaluations_and_as_soundly(monkeypatch):
    """Renyi DP and the coarse PLD answer 0 at such epsilons: each cheap level stops there instead of spending
    its 40 evaluations, and the report's PLD confirms: epsilon <= target, and 0.1% less noise exceeds it."""
    q, steps, delta, eps = 256 / 60000, 2350, 1e-5, 1e-4
    evals = {"approach": 0, "confirm": 0}

    def counted(name, phase):
        def run(eps_of, *a, **k):
            def one(z):
                evals[name] += 1
                return eps_of(z)
            return phase(one, *a, **k)
        return run
    monkeypatch.setattr(search, "approach", counted("approach", search.approach))
    monkeypatch.setattr(search, "confirm", counted("confirm", search.confirm))
    gaussian.calibrate.cache_clear()
    z = gaussian.calibrate(eps, delta, q, steps, "pld")
    assert evals["approach"] <= 20 and evals["confirm"] <= 10, evals  # 13 and 6 (before: 80 and 7)
    assert gaussian.epsilon(z, q, steps, delta, "pld") <= eps
    assert gaussian.epsilon(z * (1 - search.REL_TOL), q, steps, delta, "pld") > eps


def test_a_cheap_level_that_answers_zero_stops_at_the_last_z_it_resolved():
    seen = []

    def eps(z: float) -> float:
        seen.append(z)
        return 0.0 if z > 100 else 0.01  # flat, then nothing: an accountant at its resolution limit
    z, slope = search.approach(eps, 1e-4, 1.0, -1.0, 1e-2, 0.0, 1e6)
    assert z == 64.0 and slope == -1.0 and len(seen) == 5  # 1, 4, 16, 64, then 256 answers 0
