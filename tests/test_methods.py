"""The bias-reduction methods (clipbias.methods): each update against an independent computation,
empirical sensitivity of every aggregated quantity, brute-force inner momentum, BatchClipping never
reading a public label, refusals, resume exactness. Kept fast: tiny models, z given (no calibration)."""

import inspect
import math

import pytest
import torch
from torch import nn

from clipbias import algorithms
from clipbias.config import AlgoConfig
from clipbias.data.catalog import Dataset
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError, NonFiniteGradientError
from clipbias.algorithms import (CropFlip, GroupBatchNorm, batchclip_logits, batchclip_predict, batchnorm_variant,
                                 compose, noise_ratio_vs_dpsgd, num_groups, public_split)
from clipbias.analysis.diagnostics import clipped_quantity
from clipbias.analysis.diagnostics import sampling_noise_report as sampling_noise
from clipbias.privacy import pld
from clipbias.randomness import Purpose, SecretKey, keyed_ints, keyed_normal, snapped_gaussian

KEY0 = SecretKey.from_seed(0)  # the secret key of every draw in an engine with noise_seed=0
AUGMENT, GROUP, PERTURB, PUBLIC = Purpose.AUGMENT, Purpose.GROUP, Purpose.PERTURB, Purpose.PUBLIC
from clipbias.step import StepContext

N, D_IN, CLASSES = 24, 6, 3
Z = 5.0  # noise multiplier given directly: no calibration in the tests


def tiny_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.GroupNorm(1, 2), nn.Tanh(), nn.Flatten(),
                         nn.Linear(2 * 4 * 4, CLASSES))


def data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 1, D_IN, D_IN, generator=g), torch.randint(0, CLASSES, (N,), generator=g)


def engine(model, algo, batch_size=8.0, extra=None, seed=0, clip=0.5, lr=0.1, steps=6, **kw):
    cfg = AlgoConfig(lr=lr, clip=clip, extra=extra or {}, **kw.pop("cfg", {}))
    kw.setdefault("accountant", "rdp")
    # the accounting's N is 4x the data unless full batch: a small q keeps the RDP accountant fast
    n = kw.pop("n", N if batch_size == N else 4 * N)
    kw.setdefault("noise_seed", seed)  # reproducible batches and noise for the replicas below
    return DPEngine(model, algo, n=n, batch_size=batch_size, steps=steps, noise_multiplier=Z,
                    config=cfg, **kw)


def params_of(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])


def loop_grad(model, x, y, loss_rows=None) -> torch.Tensor:
    """Gradient of one example's loss by an ordinary backward pass (the independent computation)."""
    model.zero_grad()
    out = model(x)
    nn.functional.cross_entropy(out[:1], y.view(1), reduction="sum").backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def clip(v: torch.Tensor, c: float) -> torch.Tensor:
    n = float(v.norm())
    return v * min(1.0, c / n) if n > 0 else v


class NoiseReplica:
    """The engine's release of ``v``: ``round_g(v + std Z)``, Z the t-th noise draw of ``noise_seed``'s key."""

    def __init__(self, seed: int, d: int):
        self.key, self.d, self.t = SecretKey.from_seed(seed), d, 0

    def __call__(self, v: torch.Tensor, std: float) -> torch.Tensor:
        self.t += 1
        return snapped_gaussian(v, std, self.key, self.t - 1).float()


def processed_sum(eng, x, y, idx, step=0) -> torch.Tensor:
    """Sum of the rows after the per-example stages, for one batch, changing no state."""
    total = torch.zeros(eng.rows.layout.dim)
    for g, _, ids in eng.rows.iter_rows(x, y, idx, step, eng.max_physical_batch):
        total += eng.pipeline.rows(g, StepContext(ids, step))[1]
    eng.rows.rollback()  # drop anything the source or a stage staged
    eng.pipeline.rollback()
    return total


# ------------------------------------------------------------------ keyed randomness
def test_keyed_randomness_is_a_pure_function_of_key_step_example():
    k3, k4 = SecretKey.from_seed(3), SecretKey.from_seed(4)
    a = keyed_ints(k3, GROUP, 5, [1, 2, 3], 4, 10)
    assert torch.equal(a, keyed_ints(k3, GROUP, 5, [1, 2, 3], 4, 10))
    assert torch.equal(a[1:], keyed_ints(k3, GROUP, 5, [2, 3], 4, 10))  # independent of batch composition
    assert not torch.equal(a, keyed_ints(k3, GROUP, 6, [1, 2, 3], 4, 10))  # fresh per step
    assert not torch.equal(a, keyed_ints(k4, GROUP, 5, [1, 2, 3], 4, 10))  # and per key
    assert not torch.equal(a, keyed_ints(k3, AUGMENT, 5, [1, 2, 3], 4, 10))  # and per purpose
    z = keyed_normal(KEY0, PERTURB, 0, list(range(400)), 50)
    assert abs(float(z.mean())) < 0.02 and abs(float(z.var()) - 1) < 0.03


# ------------------------------------------------------------------ perturbation
def test_perturb_update_matches_independent_computation():
    x, y = data()
    m, ref = tiny_cnn(), tiny_cnn()
    k, lr, c = 0.3, 0.1, 0.5
    eng = engine(m, "perturb", extra={"k": k}, clip=c, lr=lr)
    d = eng.rows.layout.dim
    noise = NoiseReplica(0, d)
    for step, idx in enumerate([torch.tensor([0, 3, 5, 7]), torch.tensor([1, 2, 9])]):
        eng.step(x[idx], y[idx], idx)
        zeta = keyed_normal(KEY0, PERTURB, step, idx.tolist(), d)
        s = sum(clip(loop_grad(ref, x[i:i + 1], y[i]) + k * zeta[j], c) for j, i in enumerate(idx.tolist()))
        upd = noise(s / 8, Z * c / 8)
        with torch.no_grad():
            off = 0
            for p in ref.parameters():
                p -= lr * upd[off:off + p.numel()].view_as(p)
                off += p.numel()
    assert torch.allclose(params_of(m), params_of(ref), atol=1e-5)


def test_perturb_noise_is_fresh_per_example_and_step_and_independent_of_micro_batching():
    x, y = data()
    e1 = engine(tiny_cnn(), "perturb", extra={"k": 1.0}, max_physical_batch=64)
    e2 = engine(tiny_cnn(), "perturb", extra={"k": 1.0}, max_physical_batch=3)
    idx = torch.arange(10)
    assert torch.allclose(processed_sum(e1, x[idx], y[idx], idx), processed_sum(e2, x[idx], y[idx], idx),
                          atol=1e-6)
    st = e1.pipeline.per_sample[0]
    g = torch.zeros(2, 5)
    a = st(g, StepContext(torch.tensor([4, 4]), 0))
    assert torch.equal(a[0], a[1])  # same (step, example) -> same zeta
    assert not torch.equal(a[0], st(g, StepContext(torch.tensor([4, 5]), 0))[1])  # other example
    assert not torch.equal(a[0], st(g, StepContext(torch.tensor([4]), 1))[0])  # other step


# ------------------------------------------------------------------ dpgd-momentum (Alg. 1)
def test_dpgd_momentum_matches_brute_force_alg1():
    x, y = data()
    m, ref = tiny_cnn(), tiny_cnn()
    gm, lr, c = 0.3, 0.2, 0.5
    eng = engine(m, "dpgd-momentum", batch_size=float(N), extra={"gamma_m": gm}, clip=c, lr=lr, steps=2)
    assert eng.sample_rate == 1.0
    noise = NoiseReplica(0, eng.rows.layout.dim)
    mom = [loop_grad(ref, x[i:i + 1], y[i]) for i in range(N)]  # line 2: m_0 = grad f(w_0)
    for _ in range(2):
        eng.train_epoch(x, y)
        upd = noise(sum(clip(mi, c) for mi in mom) / N, Z * c / N)  # line 4 (clipped variant)
        with torch.no_grad():
            off = 0
            for p in ref.parameters():
                p -= lr * upd[off:off + p.numel()].view_as(p)
                off += p.numel()
        mom = [gm * loop_grad(ref, x[i:i + 1], y[i]) + (1 - gm) * mom[i] for i in range(N)]  # line 7
    assert torch.allclose(params_of(m), params_of(ref), atol=1e-5)


def test_dpgd_momentum_accounting_and_refusals():
    eng = engine(tiny_cnn(), "dpgd-momentum", batch_size=float(N), steps=7, accountant="pld")
    rep = eng.privacy(7)
    assert eng.spec.sample_rate == 1 and rep.epsilon == pytest.approx(
        pld.gaussian_exact_epsilon(Z, 7, 1e-5), rel=1e-9)
    with pytest.raises(ConfigError, match="full-batch.*`batch_size` to N = 96"):
        engine(tiny_cnn(), "dpgd-momentum", batch_size=8.0)
    with pytest.raises(ConfigError, match="stores one momentum vector per training example.*inner-outer"):
        engine(tiny_cnn(), "dpgd-momentum", batch_size=float(N), extra={"max_memory_gb": 1e-9})
    with pytest.raises(ConfigError, match="needs the example indices"):
        x, y = data()
        eng.step(x, y)


def test_failed_step_leaves_method_state_unchanged():
    """A NaN gradient in a later micro-batch: no momentum buffer, iterate history or weight changes."""
    from clipbias.errors import NonFiniteGradientError
    x, y = data()
    eng = engine(tiny_cnn(), "dpgd-momentum", batch_size=float(N), max_physical_batch=5)
    eng.train_epoch(x, y)
    mom = eng.pipeline.per_sample[0]
    buf, w = mom.buf.clone(), params_of(eng.model).clone()
    bad = x.clone()
    bad[-1, 0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        eng.train_epoch(bad, y)
    assert torch.equal(mom.buf, buf) and torch.equal(params_of(eng.model), w) and eng.steps_taken == 1
    eng.train_epoch(x, y)  # the retry starts afresh: what the failed attempt staged is dropped
    assert bool(mom.seen.all())
    twin = engine(tiny_cnn(), "dpgd-momentum", batch_size=float(N), max_physical_batch=5)
    twin.train_epoch(x, y)
    twin.train_epoch(x, y)  # the same two steps without the failed attempt in between: the same result
    assert torch.equal(twin.pipeline.per_sample[0].buf, mom.buf) and torch.equal(params_of(twin.model),
                                                                                 params_of(eng.model))
    io = engine(tiny_cnn(), "inner-outer", max_physical_batch=2)
    io.step(x[:4], y[:4], torch.arange(4))
    with pytest.raises(NonFiniteGradientError):
        io.step(bad[-4:], y[-4:], torch.arange(N - 4, N))
    assert len(io.rows.history) == 1 and io.pipeline.post.m is not None


# ------------------------------------------------------------------ inner-outer (Alg. 2)
def test_inner_momentum_equals_brute_force_recomputation():
    x, y = data()
    m = tiny_cnn()
    k0, g0 = 2, 0.5
    eng = engine(m, "inner-outer", extra={"K0": k0, "gamma0": g0}, lr=0.3, steps=8)
    iterates = [params_of(m).clone()]
    ref = tiny_cnn()
    for step in range(4):  # the history fills at step 3, then the oldest iterate drops out
        idx = torch.tensor([step, step + 11])
        # brute force: gradients of the batch at w_(k-1), ..., w_(k-1-K0) by ordinary backward passes
        expect = []
        for i in idx.tolist():
            tot = 0
            for j, w in enumerate(reversed(iterates[-(k0 + 1):])):
                torch.nn.utils.vector_to_parameters(w, ref.parameters())
                tot = tot + g0 ** j * loop_grad(ref, x[i:i + 1], y[i])
            expect.append(tot)
        got = eng.rows.inner(x[idx], y[idx])[0]
        assert torch.allclose(got, torch.stack(expect), atol=1e-5), step
        eng.step(x[idx], y[idx], idx)
        iterates.append(params_of(m).clone())
    assert len(eng.rows.history) == k0  # only K0 snapshots are stored


def test_outer_momentum_update_eq14():
    x, y = data()
    m, ref = tiny_cnn(), tiny_cnn()
    g1, lr, c = 0.9, 0.1, 0.5
    eng = engine(m, "inner-outer", extra={"K0": 1, "gamma0": 0.2, "gamma1": g1}, clip=c, lr=lr)
    noise = NoiseReplica(0, eng.rows.layout.dim)
    prev_w, M = None, None
    for step in range(3):
        idx = torch.tensor([step, step + 5])
        w_now = params_of(ref).clone()
        rows = []
        for i in idx.tolist():
            r = loop_grad(ref, x[i:i + 1], y[i])
            if prev_w is not None:
                torch.nn.utils.vector_to_parameters(prev_w, ref.parameters())
                r = r + 0.2 * loop_grad(ref, x[i:i + 1], y[i])
                torch.nn.utils.vector_to_parameters(w_now, ref.parameters())
            rows.append(clip(r, c))
        v = noise(sum(rows) / 8, Z * c / 8)
        M = v if M is None else (1 - g1) * M + v
        prev_w = w_now
        torch.nn.utils.vector_to_parameters(w_now - lr * M, ref.parameters())
        eng.step(x[idx], y[idx], idx)
    assert torch.allclose(params_of(m), params_of(ref), atol=1e-5)


def test_inner_outer_refuses_double_momentum():
    with pytest.raises(ConfigError, match="own outer momentum.*`AlgoConfig.momentum=0`"):
        engine(tiny_cnn(), "inner-outer", cfg={"momentum": 0.9})


# ------------------------------------------------------------------ p-avg
def test_p_avg_update_matches_independent_computation():
    x, y = data()
    m, ref = tiny_cnn(), tiny_cnn()
    p, lr, c = 3, 0.2, 0.5
    eng = engine(m, "p-avg", batch_size=12.0, extra={"p": p}, clip=c, lr=lr, max_physical_batch=5)
    groups = num_groups(p, 12.0)
    assert groups == 4 and eng.pipeline.divisor == 4
    assert eng.pipeline.noise.std == pytest.approx(Z * 2 * c / groups)
    noise = NoiseReplica(0, eng.rows.layout.dim)
    idx = torch.arange(13)
    gid = keyed_ints(KEY0, GROUP, 0, idx.tolist(), 1, groups).flatten()  # backend seed: the secret keyed stream
    s = 0
    for j in range(groups):
        members = idx[gid == j].tolist()
        if members:
            s = s + clip(sum(loop_grad(ref, x[i:i + 1], y[i]) for i in members) / len(members), c)
    upd = noise(s / groups, Z * 2 * c / groups)
    eng.step(x[idx], y[idx], idx)
    assert torch.allclose(params_of(m), params_of(ref) - lr * upd, atol=1e-5)


def test_p_avg_is_not_a_free_lunch_and_says_so():
    eng = engine(tiny_cnn(), "p-avg", batch_size=12.0, extra={"p": 3})
    assert "2C" in eng.spec.note and eng.spec.sensitivity == 2 * 0.5  # S = 2C, C = 0.5
    assert noise_ratio_vs_dpsgd(3, 12.0) == pytest.approx(6.0)  # 2p
    dp = engine(tiny_cnn(), "dpsgd", batch_size=12.0)
    # same z, same epsilon (z is relative to 2C), but 2p times the noise on the averaged update
    assert eng.privacy(6).epsilon == pytest.approx(dp.privacy(6).epsilon)
    assert eng.pipeline.noise.std / dp.pipeline.noise.std == pytest.approx(6.0)


# ------------------------------------------------------------------ self-augmentation
def test_crop_flip_matches_explicit_pad_slice_flip():
    x = torch.randn(3, 2, 5, 5)
    aug = CropFlip(pad=1, flip=True)
    codes = torch.tensor([[0, 5, 17], [3, 9, 12], [11, 16, 1]])
    out = aug(x, codes)
    oy, ox, fl = aug.decode(codes.flatten())
    for n in range(9):
        i = n // 3
        fill = float(x[i].min())
        xp = torch.full((2, 7, 7), fill)
        xp[:, 1:6, 1:6] = x[i]
        crop = xp[:, int(oy[n]):int(oy[n]) + 5, int(ox[n]):int(ox[n]) + 5]
        if fl[n]:
            crop = crop.flip(-1)
        assert torch.equal(out[n], crop)
    mirror = CropFlip(pad=0, flip=True)(x[:1], torch.tensor([[1]]))
    assert torch.equal(mirror[0], x[0].flip(-1))
    with pytest.raises(ConfigError, match="image inputs"):
        aug(torch.randn(3, 10), codes)


def test_self_aug_update_matches_independent_computation():
    x, y = data()
    m, ref = tiny_cnn(), tiny_cnn()
    K, lr, c = 3, 0.2, 0.5
    eng = engine(m, "self-aug", extra={"K": K, "pad": 1}, clip=c, lr=lr, max_physical_batch=4)
    noise = NoiseReplica(0, eng.rows.layout.dim)
    idx = torch.tensor([2, 4, 6, 8, 10])
    aug = CropFlip(pad=1, flip=True)
    codes = keyed_ints(KEY0, AUGMENT, 0, idx.tolist(), K, aug.choices)
    s = 0
    for j, i in enumerate(idx.tolist()):
        xa = aug(x[i:i + 1], codes[j:j + 1])
        s = s + clip(sum(loop_grad(ref, xa[r:r + 1], y[i]) for r in range(K)) / K, c)
    upd = noise(s / 8, Z * c / 8)
    eng.step(x[idx], y[idx], idx)
    assert torch.allclose(params_of(m), params_of(ref) - lr * upd, atol=1e-5)


# ------------------------------------------------------------------ BatchClipping
def bn_cnn(seed: int = 0) -> nn.Module:
    return batchnorm_variant(tiny_cnn(seed))


def test_batchnorm_variant_and_refusals():
    m = bn_cnn()
    assert isinstance(m[1], GroupBatchNorm) and not m[1].track_running_stats
    assert isinstance(tiny_cnn()[1], nn.GroupNorm)  # the original is untouched
    pub = torch.randn(5, 1, D_IN, D_IN)
    with pytest.raises(ConfigError, match="needs a BatchNorm network.*batchnorm_variant"):
        engine(tiny_cnn(), "batch-clip", extra={"public": pub})
    bad = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(32, 3))
    with pytest.raises(ConfigError, match="running statistics"):
        engine(bad, "batch-clip", extra={"public": pub})
    with pytest.raises(ConfigError, match=r"needs `AlgoConfig.extra\['public'\]`"):
        engine(bn_cnn(), "batch-clip")
    with pytest.raises(ConfigError, match="no GroupNorm"):
        batchnorm_variant(nn.Sequential(nn.Flatten(), nn.Linear(36, 3)))


def test_batch_clip_update_matches_independent_computation():
    x, y = data()
    m, ref = bn_cnn(), bn_cnn()
    ref.train()
    pub = torch.randn(7, 1, D_IN, D_IN, generator=torch.Generator().manual_seed(9))
    p, lr, c = 3, 0.2, 0.5
    eng = engine(m, "batch-clip", extra={"public": pub, "p": p}, clip=c, lr=lr, max_physical_batch=7)
    noise = NoiseReplica(0, eng.rows.layout.dim)
    idx = torch.tensor([1, 3, 5, 20])
    draws = keyed_ints(KEY0, PUBLIC, 0, idx.tolist(), p - 1, len(pub))
    s = 0
    for j, i in enumerate(idx.tolist()):
        group = torch.cat([x[i:i + 1], pub[draws[j]]])  # private example first, then p - 1 public
        s = s + clip(loop_grad(ref, group, y[i]), c)  # BN over the group; loss of row 0 only
    upd = noise(s / 8, Z * c / 8)
    eng.step(x[idx], y[idx], idx)
    assert torch.allclose(params_of(m), params_of(ref) - lr * upd, atol=1e-5)


class LabelTrap:
    """Labels that record which rows are read."""

    def __init__(self, y):
        self.y, self.read = y, set()

    def __getitem__(self, i):
        self.read.update(torch.as_tensor(i).flatten().tolist())
        return self.y[i]

    def __len__(self):
        return len(self.y)


def test_batch_clip_never_reads_a_public_label():
    x, y = data()
    trap = LabelTrap(torch.randint(0, CLASSES, (30,)))
    ds = Dataset("toy", x, y, torch.randn(30, 1, D_IN, D_IN), trap, CLASSES, (1, D_IN, D_IN))
    pub, rest = public_split(ds, 6, "test", seed=0)
    taken = [i for i in range(30) if any(torch.equal(ds.x_test[i], r) for r in pub)]
    assert len(taken) == 6 and not trap.read & set(taken)  # public rows' labels never touched
    assert len(rest.x_test) == 24 and not any(torch.equal(r, q) for r in rest.x_test for q in pub)
    # the API has no place for public labels at all
    for fn in (batchclip_predict, batchclip_logits, public_split):
        assert not {"y_public", "public_labels", "labels"} & set(inspect.signature(fn).parameters)
    eng = engine(bn_cnn(), "batch-clip", extra={"public": pub})
    eng.step(x[:8], y[:8], torch.arange(8))
    batchclip_predict(eng.model, rest.x_test, pub, 4, draws=3)
    assert not trap.read & set(taken)
    # holdout: public taken from the training split, N shrinks
    pub2, rest2 = public_split(ds, N // 2, "holdout", key=SecretKey.from_seed(0))
    assert rest2.num_train == N - len(pub2) and 0 < len(pub2) < N and pub2.shape[1:] == (1, D_IN, D_IN)
    with pytest.raises(ConfigError, match="key="):  # held-out private examples are chosen by a secret key only
        public_split(ds, 4, "holdout")


def test_batch_clip_majority_vote():
    m = bn_cnn()
    pub = torch.randn(9, 1, D_IN, D_IN)
    x = torch.randn(6, 1, D_IN, D_IN)
    pred = batchclip_predict(m, x, pub, 3, draws=5)
    votes = torch.stack([batchclip_logits(m, x, pub, 3, r).argmax(1) for r in range(5)], 1)
    for i in range(6):
        counts = torch.bincount(votes[i], minlength=CLASSES)
        assert int(pred[i]) == int(torch.nonzero(counts == counts.max())[0])  # ties -> smallest class
    # each draw runs x_i with p - 1 public features through BatchNorm: row 0 of that forward pass
    r0 = batchclip_logits(m, x[:1], pub, 3, 0)
    draws = keyed_ints(SecretKey.from_seed(0), Purpose.PREDICT, 0, [0], 2, 9)  # inference: the public seed 0
    with torch.no_grad():
        assert torch.allclose(r0[0], m(torch.cat([x[:1], pub[draws[0]]]))[0], atol=1e-5)


# ------------------------------------------------------------------ sensitivity, measured
SENS_CASES = [
    ("perturb", {"k": 0.5}, 8.0, 1.0),
    ("self-aug", {"K": 2, "pad": 1}, 8.0, 1.0),
    ("dpgd-momentum", {"gamma_m": 0.5}, float(N), 1.0),
    ("inner-outer", {"K0": 2, "gamma0": 0.5}, 8.0, 1.0),
    ("p-avg", {"p": 3}, 12.0, 2.0),
    ("batch-clip", {"p": 3}, 8.0, 1.0),
]


@pytest.mark.parametrize("algo,extra,bs,factor", SENS_CASES, ids=[c[0] for c in SENS_CASES])
def test_measured_sensitivity_never_exceeds_the_stated_bound(algo, extra, bs, factor):
    """max over neighbouring batches (one example added) of ||change of the summed rows||."""
    x, y = data()
    x = x * 3  # large gradients: everything gets clipped
    c = 0.5
    model = bn_cnn() if algo == "batch-clip" else tiny_cnn()
    if algo == "batch-clip":
        extra = {**extra, "public": torch.randn(6, 1, D_IN, D_IN)}
    eng = engine(model, algo, batch_size=bs, extra=extra, clip=c,
                 dice_accounting="conservative", max_physical_batch=16)
    # some history first (momentum buffers, past iterates)
    for step in range(2):
        eng.train_epoch(x, y) if algo == "dpgd-momentum" else eng.step(x[:10], y[:10], torch.arange(10))
    bound = eng.pipeline.sensitivity
    assert bound == pytest.approx(factor * c)
    worst = 0.0
    gen = torch.Generator().manual_seed(0)
    for trial in range(3):
        base = torch.randperm(N, generator=gen)[:9]
        extra_ex = int(torch.randperm(N, generator=gen)[0])
        base = base[base != extra_ex]
        with_x = torch.cat([base, torch.tensor([extra_ex])])
        a = processed_sum(eng, x[base], y[base], base, step=5)
        b = processed_sum(eng, x[with_x], y[with_x], with_x, step=5)
        worst = max(worst, float((a - b).norm()))
    assert worst <= bound + 1e-5
    assert worst > 0.3 * c  # the measurement sees the example


def test_p_avg_sensitivity_really_is_2c():
    """An added example that reverses its group's mean moves the clipped sum by 2C: bound C would be wrong."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    mse = lambda out, t: 0.5 * ((out.squeeze(-1) - t) ** 2).sum()  # grad = (w.x - y) x
    c = 0.5
    eng = DPEngine(model, "p-avg", n=N, batch_size=12.0, steps=2, noise_multiplier=Z, accountant="rdp",
                   config=AlgoConfig(clip=c, extra={"p": 3}), loss_fn=mse)
    x = torch.randn(N, 4)
    pred = (x @ model.weight.detach().T).squeeze(-1)
    y = pred - 2.0  # residual +2 for every example: large gradients, all clipped
    gid = eng.rows.assign(list(range(N)), eng.steps_taken)  # the groups of the next step
    i = 0
    j = next(k for k in range(1, N) if gid[k] == gid[i])  # an index that falls in i's group
    x[j], y[j] = x[i], pred[i] + 6.0  # same input, residual -6: group mean = -(gradient of i)
    a = processed_sum(eng, x[[i]], y[[i]], torch.tensor([i]))
    b = processed_sum(eng, x[[i, j]], y[[i, j]], torch.tensor([i, j]))
    assert float((a - b).norm()) == pytest.approx(2 * c, rel=1e-4)  # norms are upper bounds (1.5e-5 above)
    assert float((a - b).norm()) <= eng.pipeline.sensitivity + 1e-6


# ------------------------------------------------------------------ resume, micro-batching
RESUME_CASES = [("perturb", {}, 8.0), ("self-aug", {"K": 2}, 8.0), ("dpgd-momentum", {}, float(N)),
                ("inner-outer", {"K0": 2}, 8.0), ("p-avg", {"p": 2}, 8.0), ("batch-clip", {}, 8.0)]


@pytest.mark.parametrize("algo,extra,bs", RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_resume_is_exact(algo, extra, bs, tmp_path):
    x, y = data()
    pub = torch.randn(6, 1, D_IN, D_IN)
    if algo == "batch-clip":
        extra = {**extra, "public": pub}
    make = (lambda: bn_cnn()) if algo == "batch-clip" else (lambda: tiny_cnn())
    m1 = make()
    e1 = engine(m1, algo, batch_size=bs, extra=extra, steps=3)
    def batch(e):
        idx = e.sampler.sample()
        return idx[idx < N]  # the sampler draws from the accounting's N = 4 x the data

    for _ in range(3):
        idx = batch(e1)
        e1.step(x[idx], y[idx], idx)
    m2 = make()
    e2 = engine(m2, algo, batch_size=bs, extra=extra, steps=3)
    for _ in range(2):
        idx = batch(e2)
        e2.step(x[idx], y[idx], idx)
    torch.save({"model": m2.state_dict(), "engine": e2.state_dict()}, tmp_path / "ck.pt")
    ck = torch.load(tmp_path / "ck.pt", weights_only=False)
    m3 = make()
    m3.load_state_dict(ck["model"])
    e3 = engine(m3, algo, batch_size=bs, extra=extra, steps=3)
    e3.load_state_dict(ck["engine"])
    for _ in range(1):
        idx = batch(e3)
        e3.step(x[idx], y[idx], idx)
    assert torch.allclose(params_of(m1), params_of(m3), atol=1e-6)


@pytest.mark.parametrize("algo,extra", [("self-aug", {"K": 3}), ("p-avg", {"p": 2}), ("batch-clip", {})])
def test_micro_batching_does_not_change_the_rows(algo, extra):
    x, y = data()
    if algo == "batch-clip":
        extra = {**extra, "public": torch.randn(6, 1, D_IN, D_IN)}
    model = bn_cnn if algo == "batch-clip" else tiny_cnn
    idx = torch.arange(11)
    a = processed_sum(engine(model(), algo, extra=extra, max_physical_batch=64), x[idx], y[idx], idx)
    b = processed_sum(engine(model(), algo, extra=extra, max_physical_batch=4), x[idx], y[idx], idx)
    assert torch.allclose(a, b, atol=1e-5)


# ------------------------------------------------------------------ combinations and refusals
def test_sound_combinations_are_accounted_as_dicesgd():
    for name in ("dice-perturb", "dice-self-aug"):
        eng = engine(tiny_cnn(), name, dice_accounting="conservative", noise_seed=None)  # a seeded run is not certified
        assert eng.spec.kind == "dice" and eng.spec.certifiable
        assert eng.privacy(6).certified
    # an outer clip G_max: with perturbation ||g - clip(g + k zeta)|| <= G_max + C1, not G_max - C1
    spec = algorithms.get("dice-perturb").spec(AlgoConfig(clip=1.0, grad_bound=5.0), 0.1, 10.0, 8.0)
    assert spec.dice.g_prime == pytest.approx(6.0)
    spec = algorithms.get("dice-self-aug").spec(AlgoConfig(clip=1.0, grad_bound=5.0), 0.1, 10.0, 8.0)
    assert spec.dice.g_prime == pytest.approx(4.0)
    auto = compose("dice-auto", "perturb", register=False)
    assert not auto.certifiable  # inherits automatic DiceSGD's uncertified status


def test_dice_perturb_update_matches_independent_computation():
    """DiceSGD (Zhang et al. Alg. 2) on perturbed clipped rows; the feedback tracks the raw gradients."""
    x, y = data()
    m, ref = tiny_cnn(), tiny_cnn()
    k, lr, c1, c2 = 0.2, 0.1, 0.5, 0.05
    eng = engine(m, "dice-perturb", extra={"k": k}, clip=c1, lr=lr, cfg={"ef_clip": c2},
                 dice_accounting="conservative")
    d = eng.rows.layout.dim
    noise = NoiseReplica(0, d)
    e = torch.zeros(d)
    for step, idx in enumerate([torch.tensor([0, 4, 9]), torch.tensor([2, 3])]):
        zeta = keyed_normal(KEY0, PERTURB, step, idx.tolist(), d)
        g = [loop_grad(ref, x[i:i + 1], y[i]) for i in idx.tolist()]
        v = sum(clip(gi + k * zeta[j], c1) for j, gi in enumerate(g)) / 8 + clip(e, c2)
        e = e + sum(g) / 8 - v
        upd = noise(v, Z * c1 / 8)
        torch.nn.utils.vector_to_parameters(params_of(ref) - lr * upd, ref.parameters())
        eng.step(x[idx], y[idx], idx)
    assert torch.allclose(params_of(m), params_of(ref), atol=1e-5)
    assert torch.allclose(eng.pipeline.error_feedback.e, e, atol=1e-5)


@pytest.mark.parametrize("piece", ["p-avg", "inner-outer", "dpgd-momentum", "batch-clip"])
def test_unsound_combinations_are_refused(piece):
    with pytest.raises(ConfigError, match=f"refused: dice \\+ {piece}"):
        compose("dice", piece, register=False)
    with pytest.raises(ConfigError, match="complete algorithm"):
        compose("dpsgd", piece, register=False)


def test_composition_errors_are_explained():
    with pytest.raises(ConfigError, match="composable pieces are"):
        compose("dpsgd", "mixup", register=False)
    with pytest.raises(ConfigError, match="distinct"):
        compose("dpsgd", "perturb", "perturb", register=False)
    with pytest.raises(ConfigError, match="base must be one of"):
        compose("p-avg", "perturb", register=False)
    both = compose("dpsgd", "self-aug", "perturb", register=False)
    assert {s.key for s in both.schema} == {"k", "K", "pad", "flip"}


@pytest.mark.parametrize("algo,extra,match", [
    ("p-avg", {"p": 1}, "`AlgoConfig.extra\\['p'\\]` .* must be an integer >= 2"),
    ("self-aug", {"K": 0}, "`AlgoConfig.extra\\['K'\\]` .* must be an integer >= 1"),
    ("inner-outer", {"gamma0": 2.0}, "`AlgoConfig.extra\\['gamma0'\\]` .* must be a number in \\[0, 1\\]"),
    ("perturb", {"k": -1}, "`AlgoConfig.extra\\['k'\\]` .* must be a number > 0"),
    ("perturb", {"p": 4}, "does not take setting.*'p'.*its settings are: `AlgoConfig.extra\\['k'\\]`"),
    ("inner-outer", {"K0": 2, "k0": 3}, "given twice"),
])
def test_bad_settings_are_refused_naming_the_setting(algo, extra, match):
    with pytest.raises(ConfigError, match=match):
        engine(tiny_cnn(), algo, extra=extra)


def test_cli_spellings_and_integral_floats_are_accepted():
    eng = engine(tiny_cnn(), "inner-outer", extra={"k0": 2.0, "gamma0": 0.1, "gamma1": None})
    assert eng.rows.k0 == 2 and eng.pipeline.post.gamma1 == 0.9
    eng = engine(tiny_cnn(), "p-avg", extra={"p": 4.0})
    assert eng.rows.p == 4


# ------------------------------------------------------------------ models of the zoo, sampling noise
ZOO_CASES = [("resnet20-gn", "batch-clip"), ("resnet20-enhanced", "self-aug"), ("resnet20-enhanced", "p-avg"),
             ("resnet20-gn", "inner-outer"), ("gru", "inner-outer"), ("gru", "self-aug"), ("gru", "dice-perturb"),
             ("gru-norm", "perturb"), ("gru-norm", "dpgd-momentum"), ("resnet20-enhanced", "dice-self-aug")]


@pytest.mark.parametrize("model_name,algo", ZOO_CASES, ids=[f"{m}-{a}" for m, a in ZOO_CASES])
def test_methods_run_on_the_zoo_models(model_name, algo):
    """Every method on one of the normalisation-enhanced models or its plain counterpart."""
    from clipbias.models import build_model
    torch.manual_seed(0)
    n = 2
    x, y = torch.randn(n, 1, 8, 8), torch.randint(0, 3, (n,))
    model = build_model(model_name, (1, 8, 8), 3)
    extra = {"K": 2} if "aug" in algo else {}
    if algo == "batch-clip":
        model, extra = batchnorm_variant(model), {"public": torch.randn(4, 1, 8, 8), "p": 2}
    eng = DPEngine(model, algo, n=n, batch_size=float(n) if algo == "dpgd-momentum" else 1.0, steps=2,
                   noise_multiplier=Z, accountant="rdp", config=AlgoConfig(lr=0.1, clip=1.0, extra=extra),
                   dice_accounting="conservative")
    before = params_of(model).clone()
    eng.step(x, y, torch.arange(n))
    assert not torch.equal(before, params_of(model))
    if algo == "batch-clip":
        assert batchclip_predict(model, x, extra["public"], 2, draws=1).shape == (n,)


def test_sampling_noise_definition_and_probes():
    rows = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 3.0]])
    s = sampling_noise(rows, clip=2.5)
    mean = rows.mean(0)
    assert s["tau2"] == pytest.approx(float(((rows - mean) ** 2).sum(1).mean()))
    assert s["frac_clipped"] == pytest.approx(2 / 3)
    x, y = data()
    tau2 = {}
    for algo, extra in [("dpsgd", {}), ("p-avg", {"p": 4}), ("self-aug", {"K": 2}), ("inner-outer", {}),
                        ("perturb", {"k": 0.5})]:
        eng = engine(tiny_cnn(), algo, extra=extra)
        before = params_of(eng.model).clone()
        rows = clipped_quantity(eng, x, y)
        assert rows.shape[0] == (6 if algo == "p-avg" else N)
        assert torch.equal(before, params_of(eng.model))  # a probe changes nothing
        tau2[algo] = sampling_noise(rows)["tau2"]
    d = eng.rows.layout.dim
    assert tau2["p-avg"] < tau2["dpsgd"]  # averaging lowers the sampling noise of the clipped quantity
    assert tau2["perturb"] == pytest.approx(tau2["dpsgd"] + 0.25 * d, rel=0.15)  # + k^2 d: Chen's trade-off
    assert math.isfinite(tau2["self-aug"])


@pytest.mark.parametrize("algo,extra", [("dpsgd", {}), ("perturb", {"k": 0.3}), ("dice-perturb", {"k": 0.3})])
def test_resume_continues_the_secret_streams(algo, extra):
    """Default engines draw secret seeds, so a resumed engine has fresh ones; loading the checkpoint
    must replace them: the original and the resumed engine then make identical next steps."""
    x, y = data()
    kw = {"cfg": {"ef_clip": 0.05}, "dice_accounting": "conservative"} if algo.startswith("dice") else {}
    m1 = tiny_cnn()
    e1 = engine(m1, algo, extra=extra, noise_seed=None, **kw)
    idx = torch.tensor([0, 3, 5])
    e1.step(x[idx], y[idx], idx)
    state = {"model": {k: v.clone() for k, v in m1.state_dict().items()}, "engine": e1.state_dict()}
    m2 = tiny_cnn()
    m2.load_state_dict(state["model"])
    e2 = engine(m2, algo, extra=extra, noise_seed=None, **kw)
    e2.load_state_dict(state["engine"])
    nxt = e1.sampler.sample()
    assert torch.equal(nxt, e2.sampler.sample())
    e1.step(x[nxt % N], y[nxt % N], nxt)
    e2.step(x[nxt % N], y[nxt % N], nxt)
    assert torch.equal(params_of(m1), params_of(m2))


def test_failed_micro_batch_rewinds_the_perturbation_draws():
    """Without example indices Perturb draws one block per micro-batch call of the step; a NaN in a
    later micro-batch must leave the engine as before the step, so that the retried step makes
    exactly the update of an engine that never failed."""
    x, y = data()
    m, ref = tiny_cnn(), tiny_cnn()
    eng = engine(m, "perturb", extra={"k": 0.3}, max_physical_batch=2)
    clean = engine(ref, "perturb", extra={"k": 0.3}, max_physical_batch=2)
    w = params_of(m)
    xb = x[:4].clone()
    xb[3] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        eng.step(xb, y[:4])
    assert torch.equal(params_of(m), w) and eng.steps_taken == 0
    eng.step(x[:4], y[:4])
    clean.step(x[:4], y[:4])
    assert torch.equal(params_of(m), params_of(ref))


@pytest.mark.parametrize("algo,extra", [("p-avg", {}), ("self-aug", {"K": 2})])
def test_keyed_draws_come_from_the_secret_stream_and_resume(algo, extra):
    """Groupings and augmentations are keyed by example index: with a public key, removing one example
    (which shifts every later index) would change the others' rows predictably (docs/privacy.md).
    The key is the run's secret key: fresh from the OS CSPRNG by default, derived from the noise seed
    on request, and carried by the private checkpoint."""
    a = engine(tiny_cnn(), algo, extra=extra, noise_seed=None)
    b = engine(tiny_cnn(), algo, extra=extra, noise_seed=None)
    assert a.rows.key != b.rows.key
    assert engine(tiny_cnn(), algo, extra=extra, noise_seed=5).rows.key == SecretKey.from_seed(5)
    b.load_state_dict(a.state_dict())
    assert b.rows.key == a.rows.key == a.key == b.sampler.key
