"""BLT noise (``clipbias.algorithms.blt``, ``step.BLTNoise``): the sensitivity over a class's
participations, the streamed C and C^{-1} against dense matrices, the accounting, the engine, resume
and refusals."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm
from torch import nn

from clipbias.algorithms import blt
from clipbias.algorithms.band_strategy import workload
from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError
from clipbias.randomness import Purpose, SecretKey, noise_grid, normals
from clipbias.step import BLTNoise

KEY = SecretKey.of(7)


def _dense(c: np.ndarray) -> np.ndarray:
    t = len(c)
    return np.array([[c[i - j] if i >= j else 0.0 for j in range(t)] for i in range(t)])


@pytest.mark.parametrize("steps,classes", [(17, 4), (30, 7), (12, 1), (9, 9)])
def test_class_sums_are_the_sums_of_the_absolute_gram_entries_over_each_class(steps, classes):
    rng = np.random.default_rng(steps)
    c = rng.normal(size=steps)
    x = np.abs(_dense(c).T @ _dense(c))
    want = [x[np.ix_(range(l, steps, classes), range(l, steps, classes))].sum() for l in range(classes)]
    assert np.allclose(blt.class_sums(c, classes), want, rtol=1e-12)


def test_no_participation_pattern_or_direction_exceeds_the_sensitivity_and_a_positive_strategy_attains_it():
    """||C U||_F over every subset of a class's steps, every sign pattern and random unit directions stays
    at or below Delta(T); with omegas >= 0 (C >= 0) all steps taken with equal u reach it."""
    steps, classes = 14, 4
    rng = np.random.default_rng(0)
    for omegas, thetas in (((0.4, 0.2), (0.5, 0.9)), ((-0.3, 0.9), (0.4, 0.95))):
        s = blt.normalised(omegas, thetas, classes, steps)
        c = _dense(s.column(steps))
        assert math.isclose(s.sensitivity(steps), 1.0, rel_tol=1e-12)
        worst = 0.0
        for l in range(classes):
            cls = list(range(l, steps, classes))
            for mask in itertools.product((0, 1, -1), repeat=len(cls)):
                u = np.zeros(steps)
                u[cls] = mask
                worst = max(worst, float(np.linalg.norm(c @ u)))
            for _ in range(200):  # directions in R^8 per participation
                u = np.zeros((steps, 8))
                d = rng.normal(size=(len(cls), 8))
                u[cls] = d / np.linalg.norm(d, axis=1, keepdims=True) * rng.uniform(0, 1, (len(cls), 1))
                worst = max(worst, float(np.linalg.norm(c @ u)))
        assert worst <= 1.0 + 1e-12
        if min(omegas) >= 0:
            assert worst > 1.0 - 1e-12


def test_the_sensitivity_grows_past_the_planned_steps():
    s = blt.optimize(40, 5, 0.9)
    assert s.sensitivity(20) < s.sensitivity(40) < s.sensitivity(60)
    assert s.sensitivity(40) == pytest.approx(1.0, rel=1e-12)


def test_error_is_the_dense_frobenius_norm_of_a_times_c_inverse():
    steps, omegas, thetas = 25, (0.3, -0.1), (0.6, 0.9)
    a = _dense(workload(steps, 0.9))
    c = _dense(blt._column(np.array(omegas), np.array(thetas), steps))
    want = float(np.linalg.norm(a @ np.linalg.inv(c)) ** 2)
    assert math.isclose(blt.error(omegas, thetas, steps, 0.9), want, rel_tol=1e-10)


def test_an_unstable_inverse_is_an_infinite_error():
    assert blt.error((-1.5,), (0.9,), 30) == math.inf  # C(x) = 1 - 1.5x / (1 - 0.9x): a zero at x = 1/2.4


@pytest.mark.parametrize("steps,classes", [(87, 29), (120, 10)])
def test_the_optimised_strategy_beats_the_banded_noise_of_equal_memory_and_independent_noise(steps, classes):
    """At unit sensitivity over the class, BLT with 2 buffers (4 state vectors) has less total squared error
    than banded Toeplitz noise with 3 bands (4 state vectors) accounted the same way (no amplification),
    and than independent noise (its sensitivity over a class: sqrt(participations))."""
    from clipbias.algorithms.band_strategy import optimize as banded
    s = blt.optimize(steps, classes, 0.9)
    mine = blt.objective(s.omegas, s.thetas, steps, classes, 0.9)
    a, w = workload(steps, 0.9), np.arange(steps, 0, -1.0)
    plain = float(w @ (a * a)) * math.ceil(steps / classes)
    c3 = np.array(banded(3, steps, 0.9))
    band3 = float(np.linalg.norm(_dense(a) @ np.linalg.inv(_dense(np.concatenate((c3, np.zeros(steps - 3)))))) ** 2) \
        * float(blt.class_sums(np.concatenate((c3, np.zeros(steps - 3))), classes).max())
    assert mine < band3 < plain
    assert mine < 0.5 * plain


def test_blt_noise_streams_y_as_c_v_plus_noise_and_returns_c_inverse_y():
    """g = v + C^{-1} std Z to within the release grid (each y_t rounded once by at most half a step,
    carried on by C^{-1}), with C the dense Toeplitz matrix of the strategy."""
    steps, d, std = 30, 40, 0.3
    s = blt.optimize(steps, 6, 0.9)
    stage = BLTNoise(std, KEY, s)
    v = torch.randn(steps, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = []
    for t in range(steps):
        out.append(stage(v[t]))
        stage.commit()
    out = torch.stack(out)
    c = torch.tensor(_dense(s.column(steps)))
    z = torch.stack([normals(KEY, Purpose.NOISE, t, 0, d) for t in range(steps)])
    cinv = torch.linalg.inv(c)
    want = v + cinv @ (std * z)
    bound = noise_grid(std) / 2 * float(cinv.abs().sum(1).max()) + 1e-10
    err = float((out - want).abs().max())
    assert 0 < err <= bound
    assert stage.draws == steps and len(stage.sums) == len(stage.out_sums) == 2


def test_blt_noise_state_round_trips_and_a_rolled_back_step_leaves_no_trace():
    s = blt.optimize(20, 4, 0.9)
    a, b = BLTNoise(0.5, KEY, s), BLTNoise(0.5, KEY, s)
    v = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    for t in range(3):
        a(v[t])
        a.commit()
    a(v[5])
    a.rollback()  # a failed step: nothing staged survives
    b.load_state_dict(a.state_dict())
    for t in range(3, 6):
        assert torch.equal(a(v[t]), b(v[t]))
        a.commit()
        b.commit()
    with pytest.raises(ConfigError, match="not BLT noise in 5 classes"):
        BLTNoise(0.5, KEY, blt.optimize(20, 5, 0.9)).load_state_dict(a.state_dict())
    from clipbias.algorithms.bands import BandedNoise, coefficients
    with pytest.raises(ConfigError, match="is BLT noise, this run 4-band taylor"):
        BandedNoise(0.5, KEY, coefficients(4, 0.9)).load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match="not BLT noise in 4 classes"):
        BLTNoise(0.5, KEY, s).load_state_dict(BandedNoise(0.5, KEY, coefficients(4, 0.9)).state_dict())


def _gauss_epsilon(mu: float, delta: float) -> float:
    """The Gaussian mechanism's exact epsilon at mu-GDP (Balle & Wang 2018)."""
    def excess(e):
        return norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta
    return brentq(excess, 0.0, 100.0)


def _engine(strategy="blt", bands=8, **kw):
    cfg = kw.pop("config", AlgoConfig(lr=0.1, clip=1.0, momentum=0.9))
    return DPEngine(nn.Linear(6, 3), kw.pop("algo", "dpsgd"), n=400, batch_size=50.0, epochs=3, epsilon=2.0,
                    bands=bands, bands_strategy=strategy, config=cfg, **kw)


def test_the_engine_accounts_blt_noise_as_one_gaussian_mechanism_at_the_strategys_sensitivity():
    eng = _engine()
    steps, z = eng.total_steps, eng.noise_multiplier
    s = eng.pipeline.noise.blt
    assert isinstance(eng.pipeline.noise, BLTNoise) and eng.sampler.bands == 8 and s.classes == 8
    assert s.steps == steps and eng.spec.blt == (s.scale, *s.omegas, *s.thetas)
    rep = eng.privacy(steps)
    assert rep.certified and "BLT noise" in rep.basis and rep.noise_multiplier == z
    assert 1.99 < rep.epsilon <= 2.0
    assert rep.epsilon == pytest.approx(_gauss_epsilon(1 / z, 1e-5), rel=2e-3)
    x, y = torch.randn(400, 6), torch.randint(0, 3, (400,))
    for _ in range(5):
        idx = eng.sampler.sample()
        eng.step(x[idx], y[idx], idx)
    assert eng.privacy().epsilon == pytest.approx(_gauss_epsilon(s.sensitivity(5) / z, 1e-5), rel=2e-3)
    assert eng.privacy(2 * steps).epsilon > rep.epsilon  # a longer run: Delta(2T) > 1


def test_blt_noise_is_refused_where_its_accounting_does_not_hold():
    with pytest.raises(ConfigError, match="needs `bands` >= 2"):
        _engine(bands=1)
    with pytest.raises(ConfigError, match="not available for dice"):
        _engine(algo="dice")
    with pytest.raises(ConfigError, match="length"):
        DPEngine(nn.Linear(6, 3), "dpsgd", n=400, batch_size=50.0, noise_multiplier=1.0, bands=8,
                 bands_strategy="blt")
    from clipbias.run.training import TrainConfig
    from clipbias.run.tuning import TuneConfig
    with pytest.raises(ConfigError, match="not BLT noise"):
        TuneConfig(TrainConfig(data="digits", model="logreg", algo="dpsgd", epsilon=3.0, bands=4,
                               bands_strategy="blt"), lr_range=(0.1, 1.0), clip_range=(0.1, 1.0))


def test_the_optimised_strategy_is_cached_and_a_damaged_entry_costs_only_time(tmp_path, monkeypatch):
    import json
    monkeypatch.setenv("CLIPBIAS_CACHE", str(tmp_path))
    first = blt.optimized(50, 5, 0.9)
    path = tmp_path / "blt_strategies.json"
    table = json.loads(path.read_text())
    assert len(table) == 1
    assert blt.optimized(50, 5, 0.9) == first
    key = next(iter(table))
    table[key] = {"omegas": [0.9, 0.9], "thetas": [0.99, 0.99]}  # another strategy: its own scale is recomputed
    path.write_text(json.dumps(table))
    other = blt.optimized(50, 5, 0.9)
    assert other.omegas == (0.9, 0.9) and other.sensitivity(50) == pytest.approx(1.0, rel=1e-12)
    table[key] = {"omegas": [-3.0, 0.0], "thetas": [0.5, 0.5]}  # unstable: recomputed
    path.write_text(json.dumps(table))
    assert blt.optimized(50, 5, 0.9) == first


def test_a_resumed_engine_accounts_with_the_strategy_its_noise_stage_loaded():
    """A strategy recomputed on another machine may differ in its last bits: the run goes on with the
    saved one, and the accounting reads that one."""
    eng = _engine()
    state = eng.state_dict()
    saved = state["pipeline"]["noise"]["blt"]
    saved["omegas"] = [saved["omegas"][0] * 0.999, saved["omegas"][1]]  # another (valid) strategy
    saved["scale"] = blt.normalised(tuple(saved["omegas"]), tuple(saved["thetas"]), 8, saved["steps"]).scale
    fresh = _engine()
    fresh.load_state_dict(state)
    assert fresh.pipeline.noise.blt.omegas[0] == saved["omegas"][0]
    assert fresh.spec.blt[1] == saved["omegas"][0] and fresh.spec.blt[0] == saved["scale"]


def test_compare_and_train_take_blt_noise_by_name():
    from clipbias.cli.compare import parse_variant
    assert parse_variant("dpsgd:bands=29:blt") == ("dpsgd:bands=29:blt", {"algo": "dpsgd", "bands": 29,
                                                                           "bands_strategy": "blt"})
    with pytest.raises(ConfigError, match="taylor, optimized or blt"):
        parse_variant("dpsgd:bands=29:bltx")


def ranks_scenario(rank: int, out: str) -> None:
    """Run by both ranks of the session's process group (conftest's ``two_ranks``): the BLT strategy each rank
    takes."""
    from clipbias.algorithms import bands
    from clipbias.algorithms import blt as mod
    own = mod.optimized
    if rank == 1:  # a rank whose own optimisation would differ: it must take rank 0's strategy
        mod.optimized = lambda t, k, m: mod.normalised((0.5, 0.0), (0.5, 0.5), k, t)
    try:
        torch.save(bands.band_coefficients(4, 0.9, "blt", 63).to_dict(), f"{out}/c.{rank}")
    finally:
        mod.optimized = own


@pytest.mark.slow
def test_under_torchrun_every_rank_uses_rank_0s_blt_strategy(two_ranks):
    """2 gloo processes: rank 1's own strategy is never used (the accounting and the noise are rank 0's)."""
    got = [torch.load(two_ranks / "test_blt" / f"c.{r}") for r in range(2)]
    assert got[0] == got[1] == blt.optimized(63, 4, 0.9).to_dict()


def test_account_and_calibrate_take_blt_noise(capsys):
    """At the planned T the strategy has sensitivity 1: the Gaussian mechanism's epsilon and multiplier."""
    import json

    from clipbias.cli import main
    args = ["--sample-rate", "0.03", "--steps", "90", "--delta", "1e-5", "--bands", "33", "--bands-strategy", "blt",
            "--json"]
    assert main(["account", *args, "--noise-multiplier", "1.5"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["epsilon"] == pytest.approx(_gauss_epsilon(1 / 1.5, 1e-5), rel=1e-6) and "BLT noise" in got["basis"]
    assert main(["calibrate", *args, "--epsilon", "3"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert 2.99 < _gauss_epsilon(1 / got["noise_multiplier"], 1e-5) <= 3.0
    assert main(["calibrate", "--sample-rate", "0.03", "--steps", "90", "--delta", "1e-5", "--bands-strategy", "blt",
                 "--epsilon", "3"]) != 0
    assert "needs --bands >= 2" in capsys.readouterr().err


def test_the_accounted_sensitivity_is_rounded_up_above_the_exact_sum():
    """``BLT.sensitivity`` adds the float64 sums' worst rounding: it is never below sum |X| computed in
    extended precision, and above it by less than 1e-10 (what that costs in epsilon)."""
    for omegas, thetas, k, t in (((0.3, -0.2), (0.9, 0.5), 5, 200), ((1.0, 0.5), (0.99, 0.3), 3, 300)):
        s = blt.normalised(omegas, thetas, k, t)
        c = np.array(s.column(t), dtype=np.longdouble)
        dense = np.array([[c[i - j] if i >= j else 0 for j in range(t)] for i in range(t)], dtype=np.longdouble)
        x = np.abs(dense.T @ dense)
        exact = max(x[np.ix_(range(l, t, k), range(l, t, k))].sum() for l in range(k))
        got = np.longdouble(s.sensitivity(t)) ** 2
        assert exact <= got <= exact * (1 + 1e-10)


def test_fewer_classes_than_one_over_q_are_taken_with_a_warning():
    with pytest.warns(UserWarning, match=r"bands = floor\(1 / q\) = 8"):
        _engine(bands=4)  # q = 50 / 400
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _engine(bands=8)
