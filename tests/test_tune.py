"""Private hyperparameter tuning (Papernot & Steinke 2022): the accounting equals their Theorem 2
computed independently from the trial's Renyi curve, the number of trials follows the accounted
distribution, calibration never overshoots, and a tuning run outputs the best trial only."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from clipbias.errors import ConfigError
from clipbias.privacy import tuning
from clipbias.randomness import SecretKey
from clipbias.run import TrainConfig
from clipbias.run.tuning import TuneConfig, tune

TRAINING = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(1.2)), 60)


def _theorem_2(orders, curve, lam_index, mean, shape):
    """eps' at order orders[lam_index] by the formula of Papernot & Steinke, Thm. 2, minimised over the
    same orders for lambda-hat (dp-accounting's choice of grid), then the monotone envelope."""
    gamma = tuning.gamma_of(mean, shape)
    c = (1 + shape) * min((1 - 1 / lh) * e - math.log(gamma) / lh for lh, e in zip(orders, curve))
    raw = [e + math.log(mean) / (lam - 1) + c for lam, e in zip(orders, curve)]
    return min(raw[j] for j in range(len(orders)) if orders[j] >= orders[lam_index])


@pytest.mark.parametrize("shape", [0.0, 1.0, 3.0])
def test_the_tuning_epsilon_is_theorem_2_of_the_trial_curve(shape):
    acc = rdp.RdpAccountant()
    acc.compose(tuning.trial_event(TRAINING, 25.0))
    orders, curve = list(acc._orders), list(acc._rdp)
    ours = [_theorem_2(orders, curve, i, 8.0, shape) for i in range(len(orders))]
    eps, _ = rdp.compute_epsilon(orders, ours, 1e-5)
    assert tuning.tuned_epsilon(TRAINING, 25.0, 1e-5, 8.0, shape) == pytest.approx(eps, rel=1e-9)
    single = rdp.RdpAccountant()
    single.compose(tuning.trial_event(TRAINING, 25.0))
    assert eps > single.get_epsilon(1e-5)  # tuning costs privacy


@pytest.mark.parametrize("shape", [0.0, 1.0, 2.5])
def test_the_number_of_trials_follows_the_accounted_distribution(shape):
    """K by the inverse CDF at uniforms: its distribution is the truncated negative binomial that
    dp-accounting's gamma describes (pmf recomputed here), and its mean is the requested mean."""
    mean, gamma = 6.0, tuning.gamma_of(6.0, shape)
    us = (np.arange(20000) + 0.5) / 20000
    ks = np.array([tuning.trial_count(float(u), mean, shape) for u in us])
    assert ks.min() >= 1 and ks.mean() == pytest.approx(mean, rel=0.02)
    k = np.arange(1, 8)
    if shape == 0:
        pmf = (1 - gamma) ** k / k / -math.log(gamma)
    else:
        pmf = np.array([(1 - gamma) ** i * math.exp(math.lgamma(i + shape) - math.lgamma(shape) - math.lgamma(i + 1))
                        for i in k]) / (gamma ** -shape - 1)
    emp = np.array([(ks == i).mean() for i in k])
    assert np.allclose(emp, pmf, atol=2e-4)


def test_calibration_never_overshoots():
    def event_of(z):
        return dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(z)), 60)
    for target in (1.0, 3.0, 8.0):
        z = tuning.calibrate(event_of, target, 1e-5, 10.0, 1.0, 25.0)
        assert tuning.tuned_epsilon(event_of(z), 25.0, 1e-5, 10.0, 1.0) <= target
        assert tuning.tuned_epsilon(event_of(z / 1.01), 25.0, 1e-5, 10.0, 1.0) > target
    with pytest.raises(ConfigError, match="cannot reach"):
        tuning.calibrate(event_of, 0.05, 1e-5, 10.0, 1.0, 25.0)


BASE = TrainConfig(data="digits", model="logreg", algo="dpsgd", epsilon=3.0, delta=1e-5, epochs=2, batch_size=64,
                   lr=0.5, clip=1.0, accountant="rdp")


def test_a_tuning_outputs_the_best_trial_only_and_meets_its_budget():
    tc = TuneConfig(BASE, (0.05, 5.0), (0.1, 10.0), trials=3.0)
    a, b = tune(tc, SecretKey.from_seed(7)), tune(tc, SecretKey.from_seed(7))
    assert a["epsilon"] <= 3.0 and a["best"] == b["best"] and a["noise_multiplier"] == b["noise_multiplier"]
    assert a["certified"] is False and a["caveats"]  # a seeded key
    assert set(a) == {"best", "weights", "noise_multiplier", "epsilon", "delta", "accountant", "certified", "caveats",
                      "basis", "secret", "n_train", "n_validation", "outside_guarantee"}  # nothing per trial, no wall time
    assert a["outside_guarantee"][0].startswith("n_train, n_validation:")  # the realised sizes are private
    assert a["n_train"] + a["n_validation"] == 1347 and 0.5 * 0.1 * 1347 < a["n_validation"] < 1.5 * 0.1 * 1347
    assert 0.05 <= a["best"]["lr"] <= 5.0 and 0.1 <= a["best"]["clip"] <= 10.0
    assert a["best"]["config"]["noise_multiplier"] == a["noise_multiplier"] and a["best"]["test_accuracy"] > 0.5
    fresh = tune(TuneConfig(BASE, (0.05, 5.0), (0.1, 10.0), trials=1.0))
    assert fresh["certified"] is True and fresh["caveats"] == []


@pytest.mark.parametrize("change,flag", [(dict(algo="dice"), "DiceSGD"), (dict(epsilon=None, noise_multiplier=1.0),
                                                                           "`epsilon`")])
def test_refusals(change, flag):
    import dataclasses
    with pytest.raises(ConfigError, match=flag):
        TuneConfig(dataclasses.replace(BASE, **change), (0.1, 1.0), (0.1, 1.0))
    with pytest.raises(ConfigError, match="`lr_range`"):
        TuneConfig(BASE, (1.0, 0.1), (0.1, 1.0))


def test_the_command_line_takes_the_ranges_alone_and_refuses_a_fixed_lr(tmp_path, capsys):
    from clipbias.cli import main
    argv = ["tune", "--data", "digits", "--model", "logreg", "--algo", "dpsgd", "--epsilon", "3", "--epochs", "1",
            "--batch-size", "64", "--lr-range", "0.05", "5", "--clip-range", "0.1", "10", "--trials", "1",
            "--accountant", "rdp", "--threads", "1", "--out", str(tmp_path / "t"), "--json"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert 0.05 <= res["best"]["lr"] <= 5.0 and 0.1 <= res["best"]["clip"] <= 10.0 and res["epsilon"] <= 3.0
    assert (tmp_path / "t" / "tune.json").exists() and (tmp_path / "t" / "model.pt").exists()
    assert main(argv[:-3] + ["--lr", "1", "--clip", "1"]) != 0
    assert "drop --lr and --clip" in capsys.readouterr().err
    banded = argv[:-3] + ["--momentum", "0.9", "--bands-choices", "1", "2", "--strategy-choices", "taylor"]
    assert main(banded + ["--out", str(tmp_path / "b"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["best"]["bands"] in (1, 2) and res["best"]["bands_strategy"] == "taylor" and res["epsilon"] <= 3.0
    assert main(banded + ["--bands-choices", "0", "--out", str(tmp_path / "c")]) != 0
    assert "--bands-choices must hold" in capsys.readouterr().err


def test_a_refused_trial_stops_the_search_without_naming_examples():
    """A trial refused on a non-finite gradient named the example's position in the secret training
    part (revealing the split and that a trial ran; red team): the search stops with no position."""
    from clipbias.errors import ConfigError
    from clipbias.run.splits import prepare_splits
    splits = prepare_splits(BASE)
    splits.x_train[:] = float("inf")  # every example (one alone may fall in the secret validation part or go unsampled)
    with pytest.raises(ConfigError, match="tune stopped") as err:
        tune(TuneConfig(BASE, (0.05, 5.0), (0.1, 10.0), trials=1.0), splits=splits)
    assert not any(ch.isdigit() for ch in str(err.value).split("(docs")[0].replace("NonFinite", ""))
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_a_banded_tuning_accounts_each_trial_with_its_bands():
    """With --bands b every trial runs b-banded noise; the tuning's calibration reads the trial's banded
    event (rate b q, ceil(T / b) steps), not the plain one: its epsilon is what that event gives."""
    import dataclasses
    from clipbias.algorithms.bands import banded_spec
    from clipbias.run import tuning as tune_module
    base = dataclasses.replace(BASE, bands=3, momentum=0.9)
    tc = TuneConfig(base, (0.05, 5.0), (0.1, 10.0), trials=2.0)
    part = tune_module.prepare_splits(dataclasses.replace(base, validation=0))
    z, event_of, noise_of = tune_module._calibrate(tc, base, part, 20.0)
    assert noise_of(z) == {3: z}
    q, steps = base.batch_size / part.n, base.epochs * round(part.n / base.batch_size)
    from clipbias import algorithms
    want = banded_spec(algorithms.get("dpsgd").spec(base.algo_config(), q, z, base.batch_size), 3).dp_event(steps)
    assert event_of(z) == want and want.event.sampling_probability == 3 * q
    assert tuning.tuned_epsilon(event_of(z), 20.0, base.delta, 2.0, tc.shape) <= base.epsilon


def test_trials_that_choose_among_events_are_accounted_at_the_largest_renyi_curve():
    """A trial that draws its number of bands is a mixture of the events; the tuning is accounted at the
    pointwise largest of their curves (Thm. 2 of that curve, recomputed here), which is at least each
    event alone and at most their composition. One event gives dp-accounting's own RepeatAndSelect."""
    other = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.15, dp_event.GaussianDpEvent(1.2)), 20)
    assert tuning.tuned_epsilon([TRAINING], 25.0, 1e-5, 8.0, 1.0) == tuning.tuned_epsilon(TRAINING, 25.0, 1e-5, 8.0, 1.0)
    curves = []
    for e in (TRAINING, other):
        acc = rdp.RdpAccountant()
        acc.compose(tuning.trial_event(e, 25.0))
        orders, c = list(acc._orders), list(acc._rdp)
        curves.append(c)
    worst = list(np.maximum(*curves))
    assert curves[0] != worst and curves[1] != worst  # neither curve dominates: the maximum is pointwise
    ours = [_theorem_2(orders, worst, i, 8.0, 1.0) for i in range(len(orders))]
    eps, _ = rdp.compute_epsilon(orders, ours, 1e-5)
    both = tuning.tuned_epsilon([TRAINING, other], 25.0, 1e-5, 8.0, 1.0)
    assert both == pytest.approx(eps, rel=1e-9)
    singles = [tuning.tuned_epsilon(e, 25.0, 1e-5, 8.0, 1.0) for e in (TRAINING, other)]
    composed = tuning.tuned_epsilon(dp_event.ComposedDpEvent([TRAINING, other]), 25.0, 1e-5, 8.0, 1.0)
    assert max(singles) <= both + 1e-12 and both < composed


def test_a_tuning_searches_the_bands_with_keyed_draws_and_one_calibration():
    """``bands_choices``: each trial draws its bands from the tuning's key (not from its position), the
    calibration covers every choice, and the best trial's bands are released with it."""
    import dataclasses
    from clipbias.run import tuning as tune_module
    base = dataclasses.replace(BASE, momentum=0.9)
    tc = TuneConfig(base, (0.05, 5.0), (0.1, 10.0), trials=2.0, bands_choices=(1, 3), strategy_choices=("taylor",))
    key = SecretKey.from_seed(3)
    drawn = {tune_module._trial_config(tc, key, t, 1.0).bands for t in range(40)}
    assert drawn == {1, 3}
    other = {t: tune_module._trial_config(tc, SecretKey.from_seed(4), t, 1.0).bands for t in range(40)}
    assert other != {t: tune_module._trial_config(tc, key, t, 1.0).bands for t in range(40)}  # keyed, not by position
    part = tune_module.prepare_splits(dataclasses.replace(base, validation=0))
    s, event_of, noise_of = tune_module._calibrate(tc, base, part, 20.0)
    zs = noise_of(s)
    # each number of bands trains at its own noise multiplier: the ratio a search over it alone would take
    alone = {b: tune_module._calibrate(dataclasses.replace(tc, bands_choices=(b,)), base, part, 20.0)[0] for b in (1, 3)}
    assert zs[1] == s and zs[3] / zs[1] == pytest.approx(alone[3] / alone[1], rel=1e-12) and zs[3] > zs[1]
    assert s >= alone[1] * (1 - 1e-2) and zs[3] >= alone[3] * (1 - 1e-2)  # the mixture costs at least either alone
    events = event_of(s)
    assert len(events) == 2 and events[1].event.sampling_probability == pytest.approx(3 * events[0].event.sampling_probability)
    eps = tuning.tuned_epsilon(events, 20.0, base.delta, 2.0, tc.shape)
    assert eps <= base.epsilon and all(tuning.tuned_epsilon(e, 20.0, base.delta, 2.0, tc.shape) <= eps + 1e-12
                                       for e in events)
    res = tune(tc, key)
    assert res["best"]["bands"] in (1, 3) and res["best"]["config"]["bands"] == res["best"]["bands"]
    assert res["noise_multiplier"] == pytest.approx(res["noise_multipliers"][str(res["best"]["bands"])])
    assert "noise bands among 1, 3: accounted at the largest of their Renyi curves" in res["basis"]
    assert res["epsilon"] <= base.epsilon


@pytest.mark.parametrize("kw, match", [({"bands_choices": (1, 3), "base_algo": "dice"}, "tune accounts"),
                                       ({"bands_choices": (0,)}, "`bands_choices` must hold"),
                                       ({"bands_choices": (2, 2)}, "must not repeat"),
                                       ({"strategy_choices": ("nope",)}, "`bands_strategy` must be one of"),
                                       ({"bands_choices": (2,), "base_algo": "adaptive"}, "not available for adaptive")])
def test_band_search_refusals(kw, match):
    import dataclasses
    kw = dict(kw)
    base = dataclasses.replace(BASE, algo=kw.pop("base_algo")) if "base_algo" in kw else BASE
    with pytest.raises(ConfigError, match=match):
        TuneConfig(base, (0.05, 5.0), (0.1, 10.0), **kw)
