"""The typed mechanisms (``clipbias.privacy.mechanisms``, ``privacy.dice.BASES``,
``algorithms.bands.NOISE_STRATEGIES``):
the spellings of ``dice_accounting``, ``bands_strategy`` and an ``AccountingSpec``'s kind name one object each, an
unknown spelling is refused in the caller's words, each mechanism's dp-accounting event accounts like its report,
and the numbers are the ones the string-keyed accounting gave (pinned below, computed by it)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from torch import nn

from clipbias import algorithms, privacy
from clipbias.algorithms.bands import (BLT_NOISE, NOISE_STRATEGIES, OPTIMIZED, TAYLOR, NoiseStrategy, band_coefficients,
                                       noise_strategy)
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.errors import ConfigError, PrivacyAccountingError
from clipbias.privacy import AccountingSpec, DiceParams, account, calibrate, dice
from clipbias.privacy.mechanisms import (ERROR_FEEDBACK, NON_PRIVATE, SUBSAMPLED_GAUSSIAN, Banded, BLTStrategy, Cyclic,
                                         ErrorFeedback, Independent, NonPrivate, Poisson, SubsampledGaussian)
from clipbias.sampling.poisson import band_rate

# what the accounting gave before the mechanisms were typed (the same code paths, keyed by strings): bit for bit
BEFORE = {"gaussian_pld": 0.7179522896695628, "gaussian_rdp": 0.8711577312366436, "banded": 1.671791254734986,
          "dice_sound": 2.6173814571402567, "dice_conservative": 46.48933383124121,
          "dice_authors": 0.2117438397011959, "dice_paper": 1.6337135717419944,
          "cal_gaussian": 1.1014360142333532, "cal_banded": 1.7360265266241874,
          "cal_dice_conservative": 26.507601526833856, "engine_dice_z": 12.868453127613236,
          "engine_dice_eps": 1.9989106250712672}
GAUSS = AccountingSpec("gaussian", 0.01, 1.3, "clip", sensitivity=1.0)
DICE = AccountingSpec("dice", 0.01, 3.0, "DiceSGD", DiceParams(0.01, 1, 1.0, 0.005, 10))
PAPER = AccountingSpec("dice", 0.01, 8.0, "DiceSGD", DiceParams(0.01, 1, 1.0, 0.1, 10, 1e4))


def _epsilon(event: dp_event.DpEvent, interval: float = 1e-4) -> float:
    acc = PLDAccountant(value_discretization_interval=interval)
    acc.compose(event)
    return acc.get_epsilon(1e-5)


def test_every_spelling_names_one_object_and_the_objects_pass_as_themselves():
    assert tuple(dice.BASES) == privacy.DICE_ACCOUNTING == ("sound", "conservative", "paper", "authors")
    for name in privacy.DICE_ACCOUNTING:
        b = dice.basis(name)
        assert b is dice.BASES[name] and b.name == name and dice.basis(b) is b and dice.check_basis(b) == name
    assert dice.basis(privacy.DEFAULT_DICE_ACCOUNTING) is dice.SOUND
    assert tuple(NOISE_STRATEGIES) == ("taylor", "optimized", "blt")
    assert noise_strategy("taylor") is TAYLOR and noise_strategy("optimized") is OPTIMIZED
    assert noise_strategy("blt") is BLT_NOISE and noise_strategy(BLT_NOISE) is BLT_NOISE
    assert all(isinstance(s, NoiseStrategy) and s.name == n for n, s in NOISE_STRATEGIES.items())
    assert tuple(privacy.MECHANISMS) == ("gaussian", "dice", "none")
    assert GAUSS.mechanism is SUBSAMPLED_GAUSSIAN and AccountingSpec("none", 0.1).mechanism is NON_PRIVATE
    assert DICE.mechanism is ERROR_FEEDBACK and DICE.mechanism.basis is dice.SOUND
    assert privacy.mechanism("dice", "paper") == ErrorFeedback(dice.PAPER) == privacy.mechanism("dice", dice.PAPER)
    assert privacy.mechanism("gaussian", "paper") is SUBSAMPLED_GAUSSIAN  # the basis is error feedback's alone


def test_an_unknown_spelling_is_refused_in_the_callers_words():
    with pytest.raises(ConfigError, match="`dice_accounting` must be one of sound, conservative, paper, authors, "
                                          "got 'sond'"):
        account(DICE, 10, 1e-5, dice_accounting="sond")
    with pytest.raises(ConfigError, match="`dice_accounting` 'certified' was renamed 'paper'"):
        dice.basis("certified")
    with pytest.raises(ConfigError, match="`bands_strategy` must be one of taylor, optimized, blt, got 'blt2'"):
        band_coefficients(4, 0.0, "blt2", 10)
    with pytest.raises(ConfigError, match="`kind` must be one of gaussian, dice, none, got 'gausian'"):
        AccountingSpec("gausian", 0.1)
    kw = dict(n=100, batch_size=10, steps=5, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="`dice_accounting` must be one of"):
        DPEngine(nn.Linear(2, 2), "dice", dice_accounting="nope", **kw)
    with pytest.raises(ConfigError, match="`bands_strategy` must be one of taylor, optimized, blt, got 'nope'"):
        DPEngine(nn.Linear(2, 2), "dpsgd", bands_strategy="nope", **kw)


def test_each_mechanism_accounts_as_before_and_its_event_accounts_like_its_report():
    assert account(GAUSS, 400, 1e-5).epsilon == BEFORE["gaussian_pld"]
    assert account(GAUSS, 400, 1e-5, "rdp").epsilon == BEFORE["gaussian_rdp"]
    assert _epsilon(GAUSS.dp_event(400)) == pytest.approx(BEFORE["gaussian_pld"], rel=1e-9)
    banded = AccountingSpec("gaussian", 0.01, 1.3, bands=4)
    assert account(banded, 400, 1e-5).epsilon == BEFORE["banded"]
    assert _epsilon(banded.dp_event(400)) == pytest.approx(BEFORE["banded"], rel=1e-9)
    for name in ("sound", "conservative", "authors"):
        rep = account(DICE, 300, 1e-5, dice_accounting=dice.basis(name))
        assert rep.epsilon == BEFORE[f"dice_{name}"] == account(DICE, 300, 1e-5, dice_accounting=name).epsilon
        assert rep.certified is dice.basis(name).certified
    assert _epsilon(DICE.dp_event(300), dice.SOUND_DISCRETIZATION) == pytest.approx(BEFORE["dice_sound"], rel=1e-9)
    paper = account(PAPER, 1000, 1e-5, dice_accounting=dice.PAPER)
    assert paper.epsilon == BEFORE["dice_paper"] and not paper.certified and "REFUTED" in paper.basis
    for basis in (dice.CONSERVATIVE, dice.PAPER, dice.AUTHORS):  # a formula of its own: no event
        assert isinstance(DICE.dp_event(300, basis), dp_event.UnsupportedDpEvent)
    none = AccountingSpec("none", 0.1)
    assert math.isinf(account(none, 10, 1e-5).epsilon) and not account(none, 10, 1e-5).certified
    assert isinstance(none.dp_event(10), dp_event.NonPrivateDpEvent)
    assert isinstance(replace(GAUSS, noise_multiplier=0.0).accounted_as(), NonPrivate)  # no noise: no guarantee


def test_the_blt_mechanism_is_one_gaussian_at_its_sensitivity():
    shape = band_coefficients(4, 0.9, BLT_NOISE, 63)
    spec = algorithms.get("dpsgd").spec(AlgoConfig(clip=1.0), 0.25, 1.0, 4.0, 4, shape)
    assert isinstance(spec.noise, BLTStrategy) and spec.noise.participation == Cyclic(4)
    delta_t = spec.noise.sensitivity(63)
    assert spec.rate_and_steps(63) == (1.0, 1) and spec.multiplier(63) == 1.0 / delta_t  # no amplification
    assert spec.dp_event(63) == dp_event.GaussianDpEvent(1.0 / delta_t)
    assert _epsilon(spec.dp_event(63), 1e-5) == pytest.approx(account(spec, 63, 1e-5).epsilon, rel=1e-3)


def test_participation_and_strategies_carry_their_constraints():
    assert Poisson().amplified(0.01, 7) == (0.01, 7) and Independent().sensitivity(100) == 1.0
    assert Cyclic(4).amplified(0.01, 10) == (band_rate(4, 0.01), 3) == Banded(4).rate_and_steps(0.01, 10)
    assert AccountingSpec("gaussian", 0.01, 1.0).noise == Independent()
    assert AccountingSpec("gaussian", 0.01, 1.0, bands=3).noise == Banded(3)
    assert BLT_NOISE.min_bands == 2 and not BLT_NOISE.amplified and BLT_NOISE.accounted_by_shape
    assert TAYLOR.amplified and OPTIMIZED.amplified and not OPTIMIZED.accounted_by_shape
    with pytest.raises(ConfigError, match="needs `bands` >= 2"):
        BLT_NOISE.shape(1, 0.0, 10)
    with pytest.raises(ConfigError, match="shapes the noise for the run's length"):
        OPTIMIZED.shape(3, 0.0, None)
    assert TAYLOR.shape(1) == OPTIMIZED.shape(1, 0.5, None) == (1.0,)  # one band: independent noise
    with pytest.raises(PrivacyAccountingError, match="does not even claim"):  # the paper's bound claims less
        dice.PAPER.check_claims(False, "its rows are not per example")


def test_calibration_is_as_before_whichever_way_the_basis_is_spelled():
    assert calibrate(AccountingSpec("gaussian", 0.05), 2.0, 1e-5, 40) == BEFORE["cal_gaussian"]
    assert calibrate(AccountingSpec("gaussian", 0.05, bands=4), 2.0, 1e-5, 40) == BEFORE["cal_banded"]
    assert calibrate(DICE, 3.0, 1e-5, 300, dice_accounting="conservative") == BEFORE["cal_dice_conservative"] \
        == calibrate(DICE, 3.0, 1e-5, 300, dice_accounting=dice.CONSERVATIVE)
    with pytest.raises(ConfigError, match="no noise to calibrate"):
        calibrate(AccountingSpec("none", 0.1), 1.0, 1e-5, 10)


def test_the_plan_holds_the_typed_mechanism_and_strategy():
    kw = dict(n=1000, batch_size=50, epochs=2, epsilon=2.0)
    e = DPEngine(nn.Linear(3, 2), "dice", dice_accounting="conservative", **kw)
    assert e.plan.mechanism == ErrorFeedback(dice.CONSERVATIVE) and e.plan.basis is dice.CONSERVATIVE
    assert e.plan.strategy is TAYLOR and e.dice_accounting == "conservative" and e.bands_strategy == "taylor"
    assert e.noise_multiplier == BEFORE["engine_dice_z"] and e.privacy(40).epsilon == BEFORE["engine_dice_eps"]
    typed = DPEngine(nn.Linear(3, 2), "dice", dice_accounting=dice.CONSERVATIVE, bands_strategy=TAYLOR, **kw)
    assert typed.plan.to_dict() == e.plan.to_dict() and typed.settings == e.settings
    assert isinstance(DPEngine(nn.Linear(3, 2), "dpsgd", **kw).plan.mechanism, SubsampledGaussian)
    assert isinstance(DPEngine(nn.Linear(3, 2), "clip-sgd", n=1000, batch_size=50, epochs=2).plan.mechanism,
                      NonPrivate)
    d = e.plan.to_dict()
    assert d["dice_accounting"] == "conservative" and d["bands_strategy"] == "taylor"  # the spellings, as saved


def test_the_clis_choices_are_the_registries():
    from clipbias.cli import _choices
    live = _choices.live()
    assert live["dice_accounting"] == list(dice.BASES) and live["default_dice_accounting"] == dice.SOUND.name
    assert live["bands_strategies"] == list(NOISE_STRATEGIES) and live["default_bands_strategy"] == TAYLOR.name
    assert live["shape_accounted_strategies"] == [BLT_NOISE.name]
