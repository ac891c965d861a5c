"""The red team's checks of BLT noise's claim (benchmarks/redteam/blt/README.md): no sign pattern or participation
subset beats sum |C^T C|; the streamed recursion releases C v to float64 accuracy; a resumed (extended) run is
accounted with the strategy its noise uses; wrong-class batches, failed steps and interrupted commits reuse no
noise draw."""

from __future__ import annotations

import itertools
import math
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from clipbias import privacy
from clipbias.step import Stage, noise
from clipbias.algorithms import blt
from clipbias.audit.blt import class_steps, dense
from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError
from clipbias.privacy.pld import gaussian_exact_epsilon
from clipbias.randomness import SecretKey


@pytest.mark.parametrize("omegas,thetas", [((-0.05, 0.1), (0.9, 0.3)), ((-0.3, 0.5), (0.6, 0.2))])
def test_no_sign_pattern_or_subset_beats_the_claimed_sensitivity(omegas, thetas):
    """(a) C with negative entries (X = C^T C has negative entries within a class): every participation subset
    and sign pattern of each class stays within max_l sum |X_ij| (the claim), which equals the dense sum."""
    b = blt.normalised(omegas, thetas, 4, 32)
    for t in (32, 48):
        c = dense(b, t)
        x, sums = c.T @ c, blt.class_sums(b.column(t), 4)
        negative = 0
        for cls in range(4):
            idx = class_steps(4, t, cls)
            xl = x[np.ix_(idx, idx)]
            negative += int((xl < 0).sum())
            assert np.abs(xl).sum() == pytest.approx(sums[cls], rel=1e-12)
            pats = np.array(list(itertools.product((1.0, -1.0, 0.0), repeat=len(idx))))
            assert np.einsum("pi,ij,pj->p", pats, xl, pats).max() <= sums.max() * (1 + 1e-12)
        assert negative > 0
    assert b.sensitivity(32) == pytest.approx(1.0)


def test_the_streamed_release_is_the_dense_product_to_float64_accuracy():
    """(c) 1000 steps (25 times the planned T) of all-ones and random inputs: the stage's noiseless release
    c_0 (v_t + sum_i omega_i s_i) against C v in extended precision, relative to (|C| |v|)_t."""
    b, T = blt.optimize(40, 4, 0.9), 1000
    rng = np.random.default_rng(0)
    v = np.concatenate((np.ones((T, 2)), rng.standard_normal((T, 2))), 1)
    stage, xs = noise.BLTNoise(1.0, SecretKey.from_seed(0), b), []

    def identity(x, *args, **kwargs):
        xs.append(x.clone())
        return x.clone()

    with mock.patch.object(noise, "snapped_gaussian", identity):
        for t in range(T):
            stage(torch.from_numpy(v[t]))
            stage.commit()
    x = torch.stack(xs).numpy().astype(np.longdouble)
    om, th = np.array(b.omegas, np.longdouble), np.array(b.thetas, np.longdouble)
    col = np.concatenate(([np.longdouble(1)], (om[:, None] * th[:, None] ** np.arange(T - 1)).sum(0)))
    col *= np.longdouble(b.scale)
    vl = v.astype(np.longdouble)
    for t in range(0, T, 37):
        ref, mag = col[:t + 1][::-1] @ vl[:t + 1], np.abs(col[:t + 1][::-1]) @ np.abs(vl[:t + 1])
        assert (np.abs(x[t] - ref) / mag).max() < 1e-14


def _engine(steps, seed=None, strategy="blt", **kw):
    torch.manual_seed(0)
    return DPEngine(nn.Linear(3, 2), "dpsgd", n=64, batch_size=16, steps=steps, bands=4, bands_strategy=strategy,
                    config=AlgoConfig(lr=0.1, clip=1.0, momentum=0.9), noise_seed=seed, **kw)


def _steps(e, count, x, y):
    for _ in range(count):
        idx = e.sampler.sample()
        e.step(x[idx], y[idx], idx)


def test_a_resumed_run_is_accounted_with_the_strategy_its_noise_uses():
    """(d) A run of 40 planned steps at z = 1, resumed as an extended run of 80 (allowed at a given z): the new
    engine's own strategy (planned for 80) is replaced by the saved one in the noise and in the accounting,
    which then reads Delta(80) = 1.44 of the saved strategy (not 1 of its own); a load that fails leaves the
    engine's own strategy in both."""
    x, y = torch.randn(64, 3), torch.randint(0, 2, (64,))
    a = _engine(40, noise_multiplier=1.0)
    _steps(a, 10, x, y)
    state = a.state_dict()
    b = _engine(80, noise_multiplier=1.0)
    own, own_eps = b.noise_shape, b.privacy(80).epsilon
    assert own != a.noise_shape
    b.load_state_dict(state)
    assert b.pipeline.noise.blt == b.noise_shape == a.noise_shape and b.spec.blt == a.spec.blt
    assert b.privacy(80).epsilon == privacy.account(a.spec, 80, 1e-5).epsilon > own_eps + 2
    _steps(b, 70, x, y)
    assert b.privacy().epsilon == pytest.approx(gaussian_exact_epsilon(1.0 / a.noise_shape.sensitivity(80), 1, 1e-5))

    c = _engine(80, noise_multiplier=1.0)
    bad = {**state, "sampler": {**state["sampler"], "n": 65}}  # fails after the noise stage has loaded
    with pytest.raises(ConfigError):
        c.load_state_dict(bad)
    assert c.pipeline.noise.blt == c.noise_shape and c.spec.blt[0] == c.noise_shape.scale
    assert c.privacy(80).epsilon == pytest.approx(own_eps)


def test_a_blt_state_is_not_loaded_by_banded_noise_and_the_reverse():
    a = _engine(40, noise_multiplier=1.0)
    with pytest.raises(Exception):  # noqa: B017 (today a KeyError 'coefs', not a ConfigError: see the README)
        _engine(40, strategy="optimized", noise_multiplier=1.0).load_state_dict(a.state_dict())
    with pytest.raises(ConfigError):
        _engine(40, noise_multiplier=1.0).load_state_dict(_engine(40, strategy="optimized",
                                                                  noise_multiplier=1.0).state_dict())


def test_a_batch_of_another_class_is_refused_and_a_failed_step_reuses_nothing():
    """(e) A batch drawn for the next step is refused at this one; a step that fails after its noise was
    computed (a post stage raising) is retried on the same batch and the run is the uninterrupted one's."""
    x, y = torch.randn(64, 3), torch.randint(0, 2, (64,))
    e = _engine(40, seed=1, noise_multiplier=1.0)
    e.sampler.sample()
    nxt = e.sampler.sample()
    assert len(nxt)
    with pytest.raises(ConfigError, match="class"):
        e.step(x[nxt], y[nxt], nxt)
    ref, e = _engine(40, seed=1, noise_multiplier=1.0), _engine(40, seed=1, noise_multiplier=1.0)
    fail = [True]

    class Post(Stage):
        def __call__(self, v):
            if fail[0]:
                fail[0] = False
                raise RuntimeError("post stage failed")
            return v

    _steps(ref, 3, x, y)
    _steps(e, 2, x, y)
    e.pipeline.post = Post()
    idx = e.sampler.sample()
    with pytest.raises(RuntimeError):
        e.step(x[idx], y[idx], idx)
    assert e.pipeline.noise.draws == 2 == e.steps_taken
    assert torch.equal(e.sampler.sample(), idx)  # the retry takes the failed step's batch
    e.step(x[idx], y[idx], idx)
    noise, other = e.pipeline.noise, ref.pipeline.noise
    assert all(torch.equal(s, r) for s, r in zip(noise.sums + noise.out_sums, other.sums + other.out_sums))
    assert all(torch.equal(p, q) for p, q in zip(e.model.parameters(), ref.model.parameters()))


def test_bad_step_counts_are_refused_by_the_accountant():
    """With BLT the accountant composes one event (t = 1), so it validates the steps themselves: a negative or
    fractional count is a ConfigError (it divided by a zero sensitivity, or failed in numpy, before)."""
    spec = _engine(40, noise_multiplier=1.0).spec
    assert privacy.account(spec, 0, 1e-5).epsilon == 0.0
    for bad in (-3, 2.5):
        with pytest.raises(ConfigError):
            privacy.account(spec, bad, 1e-5)
    assert math.isfinite(privacy.account(spec, 1, 1e-5).epsilon)
