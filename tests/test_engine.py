"""The core engine: per-example gradients, stages, DPSGD/DiceSGD updates, sampling, resume, refusals."""

import math

import pytest
import torch
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError, NonFiniteGradientError, ResumeMismatchError, UnsupportedModelError
from clipbias.grads.rows import FuncGradients, ParamLayout
from clipbias.randomness import Purpose, SecretKey, inclusion_threshold, snapped_gaussian, uint64s
from clipbias.sampling.poisson import PoissonSampler
from clipbias.step import clip_rows


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))
    m[0].bias.requires_grad_(False)  # a frozen parameter must be excluded
    return m


def loop_grads(model: nn.Module, x, y, layout: ParamLayout) -> torch.Tensor:
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        rows.append(torch.cat([p.grad.flatten() for p in layout.params(model)]))
    return torch.stack(rows)


def test_per_example_gradients_equal_a_loop():
    m = small_cnn()
    x, y = torch.randn(5, 1, 6, 6), torch.randint(0, 4, (5,))
    fg = FuncGradients(m)
    assert "0.bias" not in fg.layout.names
    assert fg.layout.dim == sum(p.numel() for p in m.parameters() if p.requires_grad)
    g, losses = fg(x, y)
    assert torch.allclose(g, loop_grads(m, x, y, fg.layout), atol=1e-6)
    assert losses.shape == (5,)


def test_clipped_norms_at_most_c():
    g = torch.randn(50, 7) * torch.logspace(-2, 2, 50).unsqueeze(1)
    c = clip_rows(g, 1.5)
    assert (c.norm(dim=1) <= 1.5 + 1e-6).all()
    small = g.norm(dim=1) <= 1.5
    assert torch.allclose(c[small], g[small])  # rows inside the ball are untouched


class Linear1(nn.Module):
    """A linear model with known per-example gradients: loss_i = 0.5 (w . x_i - y_i)^2."""

    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w))

    def forward(self, x):
        return x @ self.w


def sq(out, y):
    return 0.5 * ((out - y) ** 2).sum()


def test_dpsgd_one_step_against_hand_values():
    x = torch.tensor([[3.0, 0.0], [0.0, 0.5], [1.0, 1.0]])
    y = torch.tensor([0.0, 2.0, 0.0])
    m = Linear1([1.0, 2.0])
    eng = DPEngine(m, "dpsgd", n=3, batch_size=2.0, steps=1, noise_multiplier=2.0, loss_fn=sq,
                   config=AlgoConfig(lr=0.1, clip=1.0), noise_seed=5)
    # hand: g_i = (w.x_i - y_i) x_i; clip to 1; sum / B (B = 2, the expected size, not 3)
    w = torch.tensor([1.0, 2.0])
    g = torch.stack([(w @ x[i] - y[i]) * x[i] for i in range(3)])
    clipped = torch.stack([gi * min(1.0, 1.0 / float(gi.norm())) for gi in g])
    released = snapped_gaussian(clipped.sum(0) / 2.0, 2.0 * 1.0 / 2.0, SecretKey.from_seed(5), 0)  # draw 0
    expected = w - 0.1 * released.float()
    eng.step(x, y)
    assert torch.allclose(m.w.detach(), expected, atol=1e-6)


def test_dicesgd_two_steps_against_hand_values():
    """Alg. 2 exactly (noise 0): v = mean clip(g_i, C1) + clip(e, C2); x -= lr v; e += mean g - v."""
    x = torch.tensor([[4.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0.0, 0.0])
    m = Linear1([1.0, 1.0])
    c1, c2, lr, B = 1.0, 0.5, 0.1, 2.0
    eng = DPEngine(m, "ef-sgd", n=2, batch_size=B, steps=2, loss_fn=sq,
                   config=AlgoConfig(lr=lr, clip=c1, ef_clip=c2))

    def clip(v, c):
        return v * min(1.0, c / max(float(v.norm()), 1e-30))

    w, e = torch.tensor([1.0, 1.0]), torch.zeros(2)
    for _ in range(2):
        g = torch.stack([(w @ x[i] - y[i]) * x[i] for i in range(2)])
        v = sum(clip(gi, c1) for gi in g) / B + clip(e, c2)
        e = e + g.sum(0) / B - v
        w = w - lr * v
        eng.step(x, y)
        assert torch.allclose(m.w.detach(), w, rtol=1e-4, atol=2e-5)  # norms are upper bounds, 1.5e-5 above (grads/precision.py)
        assert torch.allclose(eng.pipeline.error_feedback.e, e, rtol=1e-4, atol=2e-5)


def test_feedback_decays_by_quarter_on_empty_batch():
    """||e|| = 4 C2 and an empty batch: v = clip(e, C2) = e/4, so the next e is 0.75 e."""
    m = Linear1([0.0, 0.0])
    eng = DPEngine(m, "ef-sgd", n=10, batch_size=1.0, steps=3, loss_fn=sq, config=AlgoConfig(lr=0.1, ef_clip=0.5))
    e0 = torch.tensor([1.2, 1.6])  # norm 2 = 4 * 0.5
    eng.pipeline.error_feedback.e = e0.clone()
    eng.step(torch.zeros(0, 2), torch.zeros(0))
    assert torch.allclose(eng.pipeline.error_feedback.e, 0.75 * e0, rtol=1e-4)  # norms are upper bounds, 1.5e-5 above (grads/precision.py)
    assert torch.allclose(m.w.detach(), -0.1 * e0 / 4, rtol=1e-4)


class Scalar(nn.Module):
    def __init__(self, x0):
        super().__init__()
        self.x = nn.Parameter(torch.tensor([x0]))

    def forward(self, xi):
        return self.x - xi


def run_full_batch(algo, data, loss_fn, x0, lr, steps, **cfg):
    m = Scalar(x0)
    d = torch.tensor(data).unsqueeze(1)
    eng = DPEngine(m, algo, n=len(data), batch_size=len(data), steps=steps, loss_fn=loss_fn,
                   config=AlgoConfig(lr=lr, **cfg))
    for _ in range(steps):
        eng.step(d, torch.zeros(len(data)))
    return float(m.x.detach())


def huber2(out, _):
    """App. B.1 with C = 1: per-example gradient x - xi, capped at +-C' with C' = ceil(C) + 1 = 2."""
    return nn.functional.huber_loss(out, torch.zeros_like(out), delta=2.0, reduction="sum")


def test_fixed_point_dice_b1():
    data = [-1.0, -1.0, 2.0]  # optimum 0
    assert run_full_batch("sgd", data, huber2, 1.0, 0.3, 300) == pytest.approx(0.0, abs=1e-4)
    x_clip = run_full_batch("clip-sgd", data, huber2, 1.0, 0.3, 300, clip=1.0)
    assert x_clip == pytest.approx(-0.5, abs=1e-3)
    x_dice = run_full_batch("ef-sgd", data, huber2, 1.0, 0.3, 600, clip=1.0, ef_clip=1.0)
    assert abs(x_dice) < 1e-3


def half_sq(out, _):
    return 0.5 * (out ** 2).sum()


def test_fixed_point_chen_example2():
    data = [-3.0, 3.0]  # f = 1/2 sum 1/2 (x - a_i)^2, optimum 0; start at 2, c = 1
    assert run_full_batch("clip-sgd", data, half_sq, 2.0, 0.1, 500, clip=1.0) == pytest.approx(2.0, abs=1e-6)
    assert abs(run_full_batch("ef-sgd", data, half_sq, 2.0, 0.1, 800, clip=1.0, ef_clip=1.0)) < 1e-3


def make_engine(model, algo="dice", **kw):
    x = torch.randn(64, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2))
    args = dict(n=64, batch_size=8.0, epochs=2, noise_multiplier=30.0, dice_accounting="conservative",
                config=AlgoConfig(lr=0.2, clip=0.5, ef_clip=0.05), noise_seed=3,
                max_physical_batch=3) | kw
    return DPEngine(model, algo, **args), x, y


@pytest.mark.parametrize("algo", ["dice", "dice-adam", "dpsgd"])
def test_resume_equals_uninterrupted(algo, tmp_path):
    m1 = small_cnn()
    e1, x, y = make_engine(m1, algo)
    for _ in range(2):
        e1.train_epoch(x, y)

    m2 = small_cnn()
    e2, _, _ = make_engine(m2, algo)
    e2.train_epoch(x, y)
    torch.save({"model": m2.state_dict(), "engine": e2.state_dict()}, tmp_path / "ckpt.pt")
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    m3 = small_cnn()
    m3.load_state_dict(ck["model"])
    e3, _, _ = make_engine(m3, algo)
    e3.load_state_dict(ck["engine"])
    e3.train_epoch(x, y)
    for a, b in zip(m1.parameters(), m3.parameters()):
        assert torch.equal(a, b)
    assert e1.privacy().epsilon == e3.privacy().epsilon
    assert e3.steps_taken == e1.steps_taken == 16


def test_resume_with_changed_settings_is_refused():
    e1, _, _ = make_engine(small_cnn())
    e2, _, _ = make_engine(small_cnn(), config=AlgoConfig(lr=0.2, clip=1.0, ef_clip=0.05))
    with pytest.raises(ResumeMismatchError, match="clip"):
        e2.load_state_dict(e1.state_dict())


@pytest.mark.parametrize("saved_kw,now_kw", [({"momentum": 0.9}, {"optimizer": "adam"}),
                                              ({"optimizer": "adam"}, {"momentum": 0.9})])
@pytest.mark.parametrize("legacy", [False, True])
def test_resume_into_another_base_optimizer_is_refused_and_loads_nothing(saved_kw, now_kw, legacy):
    e1, x, y = make_engine(small_cnn(), "dpsgd", config=AlgoConfig(lr=0.2, clip=0.5, **saved_kw))
    e1.step(x[:8], y[:8], torch.arange(8))
    state = e1.state_dict()
    assert state["optimizer_class"] == type(e1.optimizer).__name__
    if legacy:  # a state saved before the class (and the format) was recorded: told apart by betas / momentum
        del state["optimizer_class"], state["format"]
    e2, _, _ = make_engine(small_cnn(), "dpsgd", config=AlgoConfig(lr=0.2, clip=0.5, **now_kw))
    before = e2.state_dict()
    with pytest.raises(ResumeMismatchError, match=r"base optimizer is (SGD|Adam|another kind).*this engine's is"):
        e2.load_state_dict(state)
    assert e2.steps_taken == 0 and e2.optimizer.state_dict() == before["optimizer"]
    e3, _, _ = make_engine(small_cnn(), "dpsgd", config=AlgoConfig(lr=0.2, clip=0.5, **saved_kw))
    e3.load_state_dict(state)  # the same optimizer resumes
    assert e3.steps_taken == 1


def test_a_batch_no_poisson_sample_holds_is_refused_before_anything_changes():
    e, x, y = make_engine(small_cnn(), "dpsgd")
    w = [p.detach().clone() for p in e.params]
    for idx, msg in [(torch.tensor([0, 1, 2, 2, 3, 4, 5, 6]), "example 2 appears 2 times"),
                     (torch.tensor([0, 1, 2, 3, 4, 5, 6, 64]), r"index 64 is outside \[0, 64\)"),
                     (torch.tensor([-1, 1, 2, 3, 4, 5, 6, 7]), "index -1 is outside"),
                     (torch.arange(8.0), "integer tensor")]:
        with pytest.raises(ConfigError, match=msg):
            e.step(x[:8], y[:8], idx)
    assert e.steps_taken == 0 and all(torch.equal(a, p) for a, p in zip(w, e.params))
    e.step(x[:8], y[:8], torch.arange(8))
    assert e.steps_taken == 1


def test_micro_batching_does_not_change_the_math():
    ms = [small_cnn(), small_cnn()]
    outs = []
    for m, mpb in zip(ms, [1, 100]):
        eng, x, y = make_engine(m, "dice", max_physical_batch=mpb)
        eng.step(x[:7], y[:7])
        outs.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert torch.allclose(outs[0], outs[1], atol=1e-6)


def test_empty_batch_is_a_noise_only_accounted_step():
    m = small_cnn()
    eng, x, y = make_engine(m, "dpsgd")
    before = [p.detach().clone() for p in m.parameters()]
    eng.step(x[:0], y[:0])
    assert eng.steps_taken == 1 and eng.privacy().epsilon > 0
    moved = [not torch.equal(a, b) for a, b, p in zip(before, m.parameters(), m.parameters()) if p.requires_grad]
    assert all(moved)


def test_batchnorm_is_refused_with_the_fix():
    m = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(32, 2))
    with pytest.raises(UnsupportedModelError, match=r"'1'.*BatchNorm2d.*GroupNorm"):
        DPEngine(m, "dpsgd", n=10, batch_size=2, epochs=1, noise_multiplier=1.0)


def test_nan_gradient_is_refused_before_any_state_changes():
    m = small_cnn()
    eng, x, y = make_engine(m, "dice")
    eng.step(x[:8], y[:8])
    params = [p.detach().clone() for p in m.parameters()]
    e = eng.pipeline.error_feedback.e.clone()
    opt_state = str(eng.optimizer.state_dict())
    x_bad = x[:8].clone()
    x_bad[5, 0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"\[5\]"):
        eng.step(x_bad, y[:8], torch.arange(8))
    assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
    assert torch.equal(eng.pipeline.error_feedback.e, e)
    assert eng.steps_taken == 1 and str(eng.optimizer.state_dict()) == opt_state


def test_poisson_sampler_rate_and_reproducibility():
    s = PoissonSampler(2000, 0.05, SecretKey.from_seed(4))
    assert len(s) == 20
    sizes = [len(s.sample()) for _ in range(200)]
    assert sum(sizes) / len(sizes) == pytest.approx(100, rel=0.05)
    state = s.state_dict()
    a = s.sample()
    s.load_state_dict(state)
    assert torch.equal(a, s.sample())


@pytest.mark.parametrize("kw,flag", [
    (dict(batch_size=0), "`batch_size`"), (dict(batch_size=100), "`batch_size`"),
    (dict(delta=1.5), "`delta`"), (dict(config=None, epochs=0), "`epochs`"),
])
def test_engine_rejects_bad_settings(kw, flag):
    args = dict(n=64, batch_size=8.0, epochs=1, noise_multiplier=1.0) | kw
    with pytest.raises(ConfigError, match=flag):
        DPEngine(small_cnn(), "dpsgd", **args)


@pytest.mark.parametrize("cfg,flag", [(dict(clip=0.0), "`AlgoConfig.clip`"), (dict(lr=-1.0), "`AlgoConfig.lr`"),
                                      (dict(ef_clip=-1.0), "`AlgoConfig.ef_clip`"),
                                      (dict(momentum=1.0), "`AlgoConfig.momentum`")])
def test_config_rejects_bad_values(cfg, flag):
    with pytest.raises(ConfigError, match=flag):
        AlgoConfig(**cfg)


def test_calibrated_engine_reaches_target_and_non_private_reports_inf():
    eng = DPEngine(small_cnn(), "dpsgd", n=640, batch_size=32, epochs=2, epsilon=2.0, delta=1e-5,
                   accountant="rdp")
    assert eng.privacy(eng.total_steps).epsilon <= 2.0
    sgd = DPEngine(small_cnn(), "sgd", n=640, batch_size=32, epochs=1)
    assert math.isinf(sgd.privacy().epsilon) and sgd.privacy().certified is False


def test_paper_dice_bound_refused_at_construction_when_it_does_not_apply():
    from clipbias.errors import PrivacyAccountingError
    with pytest.raises(PrivacyAccountingError, match="z >= 8"):
        DPEngine(small_cnn(), "dice", n=640, batch_size=32, epochs=1, noise_multiplier=2.0,
                 dice_accounting="paper")
    eng = DPEngine(small_cnn(), "dice", n=640, batch_size=32, epochs=1, noise_multiplier=2.0)
    assert eng.dice_accounting == "sound" and eng.privacy(20).certified
    assert eng.config.ef_clip == pytest.approx(0.01 * 1.0 / 32)  # default feedback ratio r = 0.01


def test_dice_adam_one_step_against_hand_adam():
    """Alg. 3: Adam consumes v + w; e is updated with the noise-free v."""
    x = torch.tensor([[4.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0.0, 0.0])
    m = Linear1([1.0, 1.0])
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    eng = DPEngine(m, "dice-adam", n=2, batch_size=2.0, steps=1, noise_multiplier=3.0,
                   dice_accounting="conservative", loss_fn=sq, config=AlgoConfig(lr=lr, clip=1.0, ef_clip=0.5),
                   noise_seed=0)
    w = torch.tensor([1.0, 1.0])
    g = torch.stack([(w @ x[i]) * x[i] for i in range(2)])
    v = sum(gi * min(1.0, 1.0 / float(gi.norm())) for gi in g) / 2.0  # e_0 = 0
    u = snapped_gaussian(v, 3.0 * 1.0 / 2.0, SecretKey.from_seed(0), 0).float()
    m1, m2 = (1 - b1) * u, (1 - b2) * u**2
    expected = w - lr * (m1 / (1 - b1)) / ((m2 / (1 - b2)).sqrt() + eps)
    eng.step(x, y)
    assert torch.allclose(m.w.detach(), expected, rtol=1e-4, atol=2e-5)  # norms are upper bounds, 1.5e-5 above (grads/precision.py)
    assert torch.allclose(eng.pipeline.error_feedback.e, g.sum(0) / 2.0 - v, rtol=1e-4, atol=2e-5)


def test_resume_with_changed_method_setting_is_refused():
    e1, _, _ = make_engine(small_cnn(), "perturb", config=AlgoConfig(lr=0.2, clip=0.5, extra={"k": 0.1}))
    e2, _, _ = make_engine(small_cnn(), "perturb", config=AlgoConfig(lr=0.2, clip=0.5, extra={"k": 0.2}))
    with pytest.raises(ResumeMismatchError, match="extra"):
        e2.load_state_dict(e1.state_dict())


def test_resume_treats_int_and_float_method_settings_alike():
    e1, _, _ = make_engine(small_cnn(), "p-avg", config=AlgoConfig(lr=0.2, clip=0.5, extra={"p": 4}))
    e2, _, _ = make_engine(small_cnn(), "p-avg", config=AlgoConfig(lr=0.2, clip=0.5, extra={"p": 4.0}))
    e2.load_state_dict(e1.state_dict())


def test_a_core_algorithm_refuses_a_method_setting():
    """A setting an algorithm does not read would be recorded but change nothing: refused."""
    with pytest.raises(ConfigError, match="`algo='dpsgd'` does not take setting.*'k'"):
        make_engine(small_cnn(), "dpsgd", config=AlgoConfig(lr=0.2, clip=0.5, extra={"k": 0.1}))


def test_batches_and_noise_are_secret_by_default_and_reproducible_on_request():
    """Default: the key comes from the OS CSPRNG, so two engines with the same public seed draw
    different batches and noise; with noise_seed they are identical (and reported uncertified)."""
    def first_update(**kw):
        m = Linear1([0.0, 0.0])
        eng = DPEngine(m, "dpsgd", n=200, batch_size=20.0, steps=1, noise_multiplier=1.0, loss_fn=sq,
                       config=AlgoConfig(lr=1.0, clip=1.0), **kw)
        idx = eng.sampler.sample()
        eng.step(torch.ones(len(idx), 2), torch.zeros(len(idx)), idx)
        return idx, m.w.detach().clone()

    (i1, w1), (i2, w2) = first_update(), first_update()
    assert not torch.equal(i1, i2) and not torch.equal(w1, w2)
    (i3, w3), (i4, w4) = first_update(noise_seed=7), first_update(noise_seed=7)
    assert torch.equal(i3, i4) and torch.equal(w3, w4)
    assert SecretKey.from_seed(7) == SecretKey.from_seed(7) and SecretKey.generate() != SecretKey.generate()
    for bad in (-1, 1 << 256, 1.5, True):
        with pytest.raises(ConfigError, match="noise seed"):
            SecretKey.from_seed(bad)


def test_engine_refuses_epsilon_and_noise_multiplier_together():
    with pytest.raises(ConfigError, match="not both"):
        DPEngine(Linear1([0.0, 0.0]), "dpsgd", n=10, batch_size=2.0, steps=1, epsilon=1.0,
                 noise_multiplier=1.0, loss_fn=sq)


def test_poisson_inclusion_compares_64_bit_uniforms_with_q():
    """Batch t includes i iff the i-th 64-bit ChaCha20 uniform at (SAMPLE, t) is below q 2^64 rounded
    (P(include) = q exactly for q >= 2^-11); recomputed here from the key."""
    n, q, key = 100_000, 256 / 60000, SecretKey.from_seed(11)
    s = PoissonSampler(n, q, key)
    for t in range(2):
        u = uint64s(key, Purpose.SAMPLE, t, 0, n)
        want = [i for i, v in enumerate(u.tolist()) if v < inclusion_threshold(q)]
        assert s.sample().tolist() == want
    from fractions import Fraction
    assert Fraction(inclusion_threshold(q), 1 << 64) == Fraction(q)
    assert len(PoissonSampler(10, 1.0, key).sample()) == 10


def test_feedback_state_loaded_on_cpu_follows_the_update_device():
    """Checkpoints are saved on the CPU; resumed on another device, the error-feedback buffer and the
    outer momentum move to the update's device (the 'meta' device stands in for CUDA here: mixing
    it with CPU tensors raises exactly as CUDA does)."""
    from clipbias.algorithms import OuterMomentum
    from clipbias.step import ErrorFeedback

    a = torch.zeros(3, device="meta")
    with pytest.raises(RuntimeError):
        a + torch.ones(3)
    ef = ErrorFeedback(c2=1.0)
    ef.load_state_dict({"e": torch.ones(3)})
    assert ef(a, a).device.type == "meta"
    om = OuterMomentum(0.9)
    om.load_state_dict({"m": torch.ones(3)})
    assert om(a).device.type == "meta"


def test_sensitivity_is_the_last_stage_bound():
    """An unbounded stage after a Clip voids the Clip's bound: the pipeline has no sensitivity."""
    from clipbias.algorithms import Perturb
    from clipbias.step import Clip, Pipeline

    assert Pipeline([Perturb(0.1), Clip(2.0)], 1.0).sensitivity == 2.0
    assert Pipeline([Clip(2.0), Perturb(0.1)], 1.0).sensitivity is None


@pytest.mark.parametrize("stage", ["clip", "normalize"])
def test_fused_scale_and_sum_equals_the_rows_it_replaces(stage):
    """The pipeline sums ``min(1, C/||g_i||) @ g`` (or ``1/(||g_i|| + gamma) @ g``) in one pass instead of
    clipping every row then summing: the same update to float rounding, with or without the norms the
    finiteness check computed, for [b, d] rows and for a leading axis of independent runs."""
    from clipbias.grads.rows import check_finite
    from clipbias.step import Clip, Normalize, Pipeline, StepContext, clip_rows, normalize_rows
    g = torch.randn(3, 50, 700, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 50)[:, None]
    st = Clip(1.5) if stage == "clip" else Normalize(0.01)
    rows = clip_rows(g, 1.5) if stage == "clip" else normalize_rows(g, 0.01)
    want = rows.double().sum(-2)
    pipe = Pipeline([st], 50.0)
    _, fused = pipe.rows(g, StepContext())
    torch.testing.assert_close(fused.double(), want, rtol=1e-6, atol=1e-6)
    _, with_norms = pipe.rows(g[0], StepContext(norms=check_finite(g[0])))
    torch.testing.assert_close(with_norms.double(), want[0], rtol=1e-6, atol=1e-6)
    _, empty = pipe.rows(g[0, :0], StepContext())
    assert empty.shape == (700,) and not empty.any()


def test_calibration_cache_is_keyed_verified_and_survives_corruption(tmp_path, monkeypatch):
    """A repeated configuration reads z from disk without calibrating; a tampered value that would
    overshoot epsilon, or a corrupt file, is recomputed: the cache can cost time, never privacy."""
    import json
    from clipbias import privacy
    from clipbias.privacy import AccountingSpec
    monkeypatch.setenv("CLIPBIAS_CACHE", str(tmp_path))
    calls = []
    real = privacy._calibrate
    monkeypatch.setattr(privacy, "_calibrate", lambda *a: calls.append(a) or real(*a))
    spec = AccountingSpec("gaussian", 0.01, sensitivity=1.0)
    z = privacy.calibrate(spec, 2.0, 1e-5, 300, "rdp")
    assert privacy.calibrate(spec, 2.0, 1e-5, 300, "rdp") == z and len(calls) == 1
    assert privacy.calibrate(spec, 2.0, 1e-5, 301, "rdp") > 0 and len(calls) == 2  # another key
    table = json.loads((tmp_path / "calibrations.json").read_text())
    json.dump({k: v / 2 for k, v in table.items()}, (tmp_path / "calibrations.json").open("w"))  # tampered
    assert privacy.calibrate(spec, 2.0, 1e-5, 300, "rdp") == z and len(calls) == 3
    (tmp_path / "calibrations.json").write_text("{not json")
    assert privacy.calibrate(spec, 2.0, 1e-5, 300, "rdp") == z and len(calls) == 4


def test_clip_and_normalize_factors_never_round_above_the_bound():
    """A subnormal float32 factor rounds by up to 100 % (red team: a norm-1 row contributed 1.96 C at
    C = 0.51 * 2^-149, which adaptive clipping reached; a one-parameter row of norm 1.7e38 contributed
    1.20 C at C = 1e-6): such factors are 0, a non-finite row contributes 0 (not NaN), and every
    contribution stays within the bound across the float32 range."""
    from clipbias.step import clip_scale, normalize_rows
    tiny = torch.finfo(torch.float32).tiny
    for c in (0.51 * 2.0 ** -149, 2.0 ** -140, 1e-30, 1e-6, 1e-3, 1.0):
        for v in (2.0 ** -30, 1.0, 3.0, 1e20, 1.7e38):
            g = torch.tensor([[v]])
            out = clip_rows(g, c)
            assert torch.isfinite(out).all() and float(out.double().norm()) <= c * (1 + 2 ** -23), (c, v)
    assert float(clip_scale(torch.tensor([1.0]), tiny / 4)) == 0.0
    rows = torch.tensor([[float("inf"), 1.0], [3e38, 3e38], [1.0, 0.0]])
    for out in (clip_rows(rows, 1.0), normalize_rows(rows, 0.01)):
        assert torch.isfinite(out).all() and torch.equal(out[:2], torch.zeros(2, 2)) and float(out[2].norm()) <= 1


@pytest.mark.parametrize("algo", ["perturb", "dice-perturb"])
def test_a_row_the_perturbation_overflows_contributes_nothing(algo):
    """Finite rows of +-3.4e38 pass the finiteness check, then g + k zeta overflows: the Clip made
    0 * inf = NaN and every later release NaN (red team). The row now contributes 0."""
    m = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m.weight.zero_()
    eng = DPEngine(m, algo, n=8, batch_size=4.0, steps=3, noise_multiplier=1.0, accountant="rdp",
                   loss_fn=lambda out, y: (out * y).sum(1), config=AlgoConfig(lr=1.0, clip=1.0, extra={"k": 1e32}))
    big = float(torch.finfo(torch.float32).max)
    eng.step(torch.ones(4, 1), torch.tensor([[big], [big], [-big], [-big]]), torch.arange(4))
    eng.step(torch.ones(4, 1), torch.full((4, 1), 0.1), torch.arange(4, 8))
    assert torch.isfinite(m.weight).all()


def test_the_fast_path_one_position_sum_cannot_round_up_through_the_subnormals():
    """Linear on [b, k]: a_j s_i rounded in float32 could land in the subnormals before meeting output
    gradients near float32's maximum (red team: 1.96 C released). The sum runs in float64 and the
    factor is 0 below float32's smallest normal number: the contribution stays within C."""
    from clipbias.grads.fast import BookKeeping
    from clipbias.step import clip_scale
    k = o = 256
    big = float(torch.finfo(torch.float32).max)
    m = nn.Linear(k, o, bias=False)
    bk = BookKeeping(m, lambda out, y: (out * y).sum(1))
    for ulps in (0.51, 1.5, 2.0 ** 30):
        c = ulps * 2.0 ** -149 * big * (o * k) ** 0.5 * 4  # a_j s_i = ulps * 2^-149 for a = 2^-12 below
        x, y = torch.full((2, k), 2.0 ** -12), torch.full((2, o), big)
        x[1], y[1] = 0, 0
        proc, _, _, _ = bk(x, y, lambda n, c=c: clip_scale(n, c), False)
        assert torch.isfinite(proc).all() and float(proc.double().norm()) <= c * (1 + 1e-6), ulps


def test_a_step_that_raises_anything_leaves_nothing_staged():
    """An out-of-memory error (not a clipbias refusal) in the middle of a step used to leave adaptive
    clipping's partial count behind: the next step's noisy count held the failed step's examples
    too, twice the sensitivity of one example (red team). Every exception now drops what was staged."""
    calls = []  # (outside the module: the state guard refuses a forward that writes a module attribute)

    class Flaky(nn.Module):  # the second micro-batch runs out of memory, after the first was counted
        def __init__(self):
            super().__init__()
            self.lin, self.fail_at = nn.Linear(4, 3), 2

        @property
        def calls(self):
            return len(calls)

        def forward(self, x):
            calls.append(1)
            if self.calls == self.fail_at:
                raise MemoryError("simulated out of memory")
            return self.lin(x)

    m = Flaky()
    eng = DPEngine(m, "adaptive", n=40, batch_size=8.0, steps=3, noise_multiplier=0.5, accountant="rdp",
                   config=AlgoConfig(lr=0.1, clip=1.0), max_physical_batch=4)
    stage = eng.pipeline.per_sample[-1]
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(MemoryError):
        eng.step(x, y, torch.arange(8))
    assert m.calls == 2 and stage._partial == 0.0 and eng.steps_taken == 0
    eng.step(x, y, torch.arange(8))
    assert eng.steps_taken == 1 and stage.releases == 1


def test_a_noisy_update_the_optimizer_failed_on_is_never_drawn_again(monkeypatch):
    """The optimizer failing (out of memory) after the noise was drawn left the draw uncommitted and the
    noisy update in param.grad: the next step drew the same noise, and the two releases' difference
    was noise-free (red team). The failed step now counts as released: its draws advance, it is
    accounted, and the gradients are cleared."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    eng = DPEngine(m, "dpsgd", n=40, batch_size=8.0, steps=3, noise_multiplier=50.0, accountant="rdp",
                   config=AlgoConfig(lr=1.0, clip=0.1))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    real = eng.optimizer.step
    seen = []

    def fails(*a, **k):
        seen.append(torch.cat([p.grad.flatten() for p in m.parameters()]).clone())
        raise MemoryError("simulated out of memory")
    monkeypatch.setattr(eng.optimizer, "step", fails)
    with pytest.raises(MemoryError):
        eng.step(x, y, torch.arange(8))
    assert eng.steps_taken == 1 and all(p.grad is None for p in m.parameters())
    monkeypatch.setattr(eng.optimizer, "step", lambda *a, **k: (seen.append(torch.cat(
        [p.grad.flatten() for p in m.parameters()]).clone()), real(*a, **k)))
    eng.step(x, y, torch.arange(8))
    # the same batch: with the same noise the two updates would agree to within the clipped sums' scale
    assert float((seen[1] - seen[0]).norm()) > 10 * 0.1 * 2 / 8
