"""Mixed precision (``DPEngine(autocast=...)``): the forward and backward in bfloat16 / float16, every
norm, clip factor and sum across examples in float32 or float64 (docs/privacy.md, "Floating point in
the fast path")."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError
from clipbias.grads import precision
from clipbias.grads.fast import BookKeeping
from clipbias.grads.rows import FuncGradients
from clipbias.step import clip_scale

B, C = 256, 1.0


def _aligned(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """B examples whose clipped gradients nearly align: one input direction over 3 positions, scaled
    by 10-20 (the tanh saturates, so every example's hidden activations are the same signs), one target."""
    g = torch.Generator().manual_seed(seed)
    x0, y0 = torch.randn(3, 16, generator=g), torch.randn(3, 4, generator=g)
    return x0 * (10 + 10 * torch.rand(B, 1, 1, generator=g)), y0.expand(B, 3, 4).clone()


def _clipped_sum(path: str, autocast, x, y, keep, device: str = "cpu") -> torch.Tensor:
    """The clipped sum ``sum_i s_i g_i`` a step of ``dpsgd`` hands to its noise stage (float64 copy)."""
    torch.manual_seed(1)  # the same initial model in every call
    m = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).to(device)
    x, y = x.to(device), y.to(device)
    eng = DPEngine(m, "dpsgd", n=4 * B, batch_size=B, steps=1, noise_multiplier=1.0, accountant="rdp",
                   grad_path=path, autocast=autocast, loss_fn=lambda out, t: (out.float() * t).sum((1, 2)),
                   config=AlgoConfig(lr=0.1, clip=C), max_physical_batch=B, noise_seed=3)
    got, finish = [], eng.pipeline.finish
    eng.pipeline.finish = lambda p, r: (got.append(p.detach().clone()), finish(p, r))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # indices of our choosing: the run is reported uncertified
        eng.step(x[keep], y[keep], torch.nonzero(keep).flatten())
    assert got[0].dtype == torch.float32
    return got[0].double().cpu()


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device, dtype", [("cpu", torch.bfloat16), ("cpu", torch.float16),
                                           pytest.param("cuda", torch.float16, marks=_CUDA),
                                           pytest.param("cuda", torch.bfloat16, marks=_CUDA)])
@pytest.mark.parametrize("path", ["rows", "fast"])
def test_removing_one_aligned_example_moves_the_autocast_release_by_at_most_C(path, device, dtype):
    """The red team's attack on 16-bit sums: B = 256 nearly aligned clipped gradients, one removed. With
    the clipped sum rounded in bfloat16 (as under a caller's autocast) the release moved by 1.22 C; under
    ``autocast=torch.bfloat16`` the forward and backward run in bfloat16, the sums in float32 or float64,
    and the release moves by C up to float32 rounding, as in the float32 run. (float16, with its loss
    scale, and CUDA where there is one.)"""
    x, y = _aligned()
    everyone = torch.ones(B, dtype=torch.bool)
    for autocast in (None, dtype):
        full = _clipped_sum(path, autocast, x, y, everyone, device)
        assert float(full.norm()) > 0.99 * B * C  # nearly aligned: the sum is almost B C long
        for j in ((0, 255) if autocast else (0,)):
            keep = everyone.clone()
            keep[j] = False
            move = float((full - _clipped_sum(path, autocast, x, y, keep, device)).norm()) / C
            assert 1 - 1e-4 < move <= 1 + 1e-4, (autocast, j, move)


def test_the_same_clipped_rows_summed_in_bfloat16_move_the_sum_by_more_than_C():
    """The data above is an attack: its clipped rows (float32, from the rows path under bfloat16 autocast)
    summed in bfloat16, as a step inside the caller's autocast would, moved by more than 1.1 C."""
    x, y = _aligned()
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    fg = FuncGradients(m, lambda out, t: (out.float() * t).sum((1, 2)))
    with precision.mixed(precision.Mixed("cpu", torch.bfloat16)):
        rows, _ = fg(x, y)
    assert rows.dtype == torch.float32
    s = clip_scale(precision.row_norms(rows), C).float()
    worst = 0.0
    for j in range(0, B, 16):
        keep = torch.ones(B, dtype=torch.bool)
        keep[j] = False
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full, less = s @ rows, s[keep] @ rows[keep]
        worst = max(worst, float((full.double() - less.double()).norm()) / C)
    assert worst > 1.1


def test_sixteen_bit_activations_reach_the_rules_widened_and_the_sums_stay_float32():
    """Under ``autocast=torch.bfloat16`` the layers really run in bfloat16 (a hook on the activation sees
    bfloat16), and what the noise stage receives is float32 on both paths; float16 (with its loss
    scale) likewise."""
    torch.manual_seed(0)
    x, y = torch.randn(12, 5, 16), torch.randint(0, 3, (12,))

    def model():
        return nn.Sequential(nn.Linear(16, 8), nn.GELU(), nn.LayerNorm(8), nn.Flatten(), nn.Linear(40, 3))

    for path in ("rows", "fast"):
        for dtype in (torch.bfloat16, torch.float16):
            m = model()
            seen = []
            m[1].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
            eng = DPEngine(m, "dpsgd", n=48, batch_size=12, steps=2, noise_multiplier=1.0, accountant="rdp",
                           grad_path=path, autocast=dtype, config=AlgoConfig(lr=0.1, clip=1.0))
            sums, finish = [], eng.pipeline.finish
            eng.pipeline.finish = lambda p, r: (sums.append(p.dtype), finish(p, r))[1]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                losses = eng.step(x, y, torch.arange(12))
            # the step's forward in 16 bits (the fast path's probe, hooks present, reruns it in float64)
            assert seen[0] == dtype and set(seen[1:]) <= {torch.float64} and sums == [torch.float32], (path, seen)
            assert losses.dtype == torch.float32 and all(p.dtype == torch.float32 for p in m.parameters())
            assert not torch.is_autocast_enabled("cpu")


def test_a_loss_scale_keeps_float16_output_gradients_from_flushing_to_zero():
    """Output gradients of 2^-30 are below float16's smallest subnormal (2^-24): without a loss scale
    they flush to zero and the example's gradient vanishes (deterministically: no privacy cost, lost
    signal). ``loss_scale=2^16`` lifts them to 2^-14 in float16, and dividing by it after widening to
    float32 gives 2^-30 back exactly: the norms are the float32 run's. (On the fast path the vanished
    gradient fails the probe's float64 comparison, and the step is refused with the hint.)"""
    torch.manual_seed(0)
    m = nn.Linear(8, 4, bias=False)
    x, y = torch.randn(6, 8), torch.full((6, 4), 2.0 ** -30)

    def loss(out, t):
        return (out.float() * t).sum(1)

    want = x.norm(dim=1).double() * 2.0 ** -30 * 2  # ||x_i|| ||y_i||
    for scale, lost in ((1.0, True), (2.0 ** 16, False)):
        spec = precision.Mixed("cpu", torch.float16, scale)
        with precision.mixed(spec):
            rows, _ = FuncGradients(m, loss)(x, y)
            if lost:
                with pytest.raises(ConfigError, match="raise loss_scale"):
                    BookKeeping(m, loss)(x, y, lambda n: clip_scale(n, 1.0), False)
                assert float(precision.row_norms(rows).max()) < 1e-3 * float(want.min())
                continue
            _, _, _, fast = BookKeeping(m, loss)(x, y, lambda n: clip_scale(n, 1.0), False)
        for norms in (fast.double(), precision.row_norms(rows)):
            torch.testing.assert_close(norms, want, rtol=3e-3, atol=0)  # x rounded to float16 in the forward


class _Mixer(nn.Module):
    """Not a reviewed model class (the fast path probes it): with ``mix`` every example sees 1 % of the batch mean."""

    def __init__(self, mix: float) -> None:
        super().__init__()
        self.l1, self.l2, self.mix = nn.Linear(16, 8), nn.Linear(8, 3), mix

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        return self.l2(h + self.mix * h.mean(0, keepdim=True))


def test_the_probe_decides_in_float64_under_autocast():
    """A bfloat16 batch and an example run alone round apart by ~2^-8, so under autocast the probe
    compares the rules' attribution with each example's own gradient in float64 at once: a per-example
    model passes, a model that lets every example see 1 % of the batch mean is refused."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 16), torch.randint(0, 3, (16,))
    for mix, ok in ((0.0, True), (0.01, False)):
        eng = DPEngine(_Mixer(mix), "dpsgd", n=64, batch_size=16, steps=2, noise_multiplier=1.0, accountant="rdp",
                       grad_path="fast", autocast=torch.bfloat16, config=AlgoConfig(lr=0.1, clip=1.0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if ok:
                eng.step(x, y, torch.arange(16))
            else:
                with pytest.raises(ConfigError, match="lets examples see each other"):
                    eng.step(x, y, torch.arange(16))
        assert eng.steps_taken == int(ok)


def test_autocast_settings_are_checked_and_a_callers_autocast_is_pointed_to_them():
    m = nn.Linear(4, 2)
    kw = dict(n=8, batch_size=2, steps=1, noise_multiplier=1.0, accountant="rdp")
    for bad in (torch.float32, "int8"):
        with pytest.raises(ConfigError, match="autocast must be torch.bfloat16 or torch.float16"):
            DPEngine(m, "dpsgd", autocast=bad, **kw)
    for scale in (3.0, 0.0, float("inf"), True):
        with pytest.raises(ConfigError, match="loss_scale must be a power of two"):
            DPEngine(m, "dpsgd", autocast=torch.float16, loss_scale=scale, **kw)
    with pytest.raises(ConfigError, match="loss_scale=.* applies to an autocast step"):
        DPEngine(m, "dpsgd", loss_scale=256.0, **kw)
    with pytest.raises(ConfigError, match="drop autocast= or grads="):
        DPEngine(m, "dpsgd", autocast=torch.bfloat16, grads=FuncGradients(m), **kw)
    assert DPEngine(m, "dpsgd", autocast="bf16", **kw).autocast == (torch.bfloat16, 1.0)
    assert DPEngine(m, "dpsgd", autocast=torch.float16, **kw).autocast == (torch.float16, 256.0)
    eng = DPEngine(m, "dpsgd", **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ConfigError, match=r"autocast=torch.bfloat16"):
        eng.step(torch.randn(2, 4), torch.tensor([0, 1]), torch.arange(2))


def test_a_reviewed_model_stays_proven_per_example_under_autocast(monkeypatch):
    """autocast adds no torch function mode to the fast path's forward: the cnn of ``clipbias.models`` is
    still proven per-example by its structure (``grads.separable``), and no probe runs."""
    from clipbias.models import build_model
    torch.manual_seed(0)
    monkeypatch.setattr(BookKeeping, "_check_examples", lambda *a, **k: pytest.fail("probed"))
    eng = DPEngine(build_model("cnn", (1, 28, 28), 10), "dpsgd", n=32, batch_size=8, steps=2, noise_multiplier=1.0,
                   accountant="rdp", grad_path="fast", autocast=torch.bfloat16, config=AlgoConfig(lr=0.1, clip=1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng.step(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)), torch.arange(8))
    assert eng.steps_taken == 1


def test_the_opacus_interface_and_dp_options_take_autocast():
    """``make_private(..., autocast=torch.bfloat16)``: the user's loop is unchanged (no torch.autocast, no
    GradScaler of theirs); the engine's step runs its forward in bfloat16. ``DPOptions`` checks the setting."""
    from torch.utils.data import DataLoader, TensorDataset
    from clipbias.integrations.opacus import PrivacyEngine
    from clipbias.integrations.options import DPOptions
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    seen = []
    model[1].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pe = PrivacyEngine()
    model, opt, loader = pe.make_private(module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y),
                                         batch_size=16), noise_multiplier=1.0, max_grad_norm=0.5,
                                         autocast=torch.bfloat16, grad_path="rows")
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        break
    assert pe.steps == 1 and pe.engine.autocast == (torch.bfloat16, 1.0) and torch.bfloat16 in seen
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    DPOptions(noise_multiplier=1.0, autocast="bfloat16").check()
    with pytest.raises(ConfigError, match="autocast must be"):
        DPOptions(noise_multiplier=1.0, autocast="float32").check()


@pytest.mark.slow  # transformers' import and the Trainer's setup
def test_the_hugging_face_trainer_takes_autocast_through_dp_arguments(tmp_path):
    """``DPArguments(autocast="bfloat16")`` with ``bf16=False``: GPT-2 trains, its layers in bfloat16 in the
    engine's step, its weights float32 and finite."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments
    from clipbias.integrations.transformers import DPArguments, DPTrainer
    from test_hf_trainer import Tokens, collate, gpt2
    model = gpt2()
    seen = []
    model.transformer.h[0].mlp.act.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, learning_rate=0.05,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = DPTrainer(model=model, args=args, train_dataset=Tokens(24, 8, causal=True), data_collator=collate,
                        optimizers=(torch.optim.SGD(model.parameters(), lr=0.05), None),
                        dp_args=DPArguments(noise_multiplier=1.0, grad_path="rows", autocast="bfloat16"))
    trainer.train()
    assert trainer.dp_engine.steps_taken == 2 and torch.bfloat16 in seen
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


def test_the_newer_fast_path_layers_run_under_autocast_on_both_paths():
    """Grouped and depthwise convolutions, InstanceNorm and RMSNorm under ``autocast=torch.bfloat16``: the
    fast path's rules get them widened, the rows path's ``vmap`` computes instance norm in float32 (its
    bfloat16 backward fails there); the sums are float32 on both paths."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4, 10, 10), torch.randint(0, 3, (8,))
    for path in ("fast", "rows"):
        m = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.InstanceNorm2d(8, affine=True), nn.GELU(),
                          nn.Conv2d(8, 8, 3, groups=8, padding="same"), nn.Flatten(), nn.Linear(8 * 64, 16),
                          nn.RMSNorm(16), nn.Linear(16, 3))
        eng = DPEngine(m, "dpsgd", n=80, batch_size=8, steps=2, noise_multiplier=1.0, accountant="rdp",
                       grad_path=path, autocast=torch.bfloat16, config=AlgoConfig(lr=0.1, clip=1.0))
        sums, finish = [], eng.pipeline.finish
        eng.pipeline.finish = lambda p, r: (sums.append(p.dtype), finish(p, r))[1]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng.step(x, y, torch.arange(8))
        assert sums == [torch.float32] and all(torch.isfinite(p).all() for p in m.parameters()), path


def test_removing_an_example_leaves_every_other_examples_16_bit_gradient_bit_identical():
    """What the argument rests on, as in float32: example i's 16-bit values depend on example i alone. A
    batched kernel could still round them by the batch's shape (its blocking), which removing an example
    changes, at 2^-8 of the values in bfloat16 (2^-24 in float32); measured here: on this CPU no other
    example's gradient (rows path) or attribution (fast path) changes by a single bit."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Flatten(), nn.Linear(5 * 64, 10))
    x, y = torch.randn(48, 5, 32), torch.randint(0, 10, (48,))
    keep = torch.ones(48, dtype=torch.bool)
    keep[20] = False
    with precision.mixed(precision.Mixed("cpu", torch.bfloat16)):
        fg, bk = FuncGradients(m), BookKeeping(m)  # cross-entropy; a Sequential is proven per-example: no probe
        assert torch.equal(fg(x, y)[0][keep], fg(x[keep], y[keep])[0])
        full, less = bk._rules(x, y)[1], bk._rules(x[keep], y[keep])[1]
    for j, i in list(enumerate(torch.nonzero(keep).flatten().tolist()))[::3]:
        assert all(torch.equal(a, b) for r, s in zip(full, less) for a, b in zip(r.one(i), s.one(j))), i


@pytest.mark.slow  # lightning's import and the Trainer's setup
def test_the_lightning_callback_takes_autocast():
    """``DPCallback(autocast="bfloat16")`` with ``precision="32-true"``: the engine's step runs the module's
    layers in bfloat16, its weights stay float32 and finite."""
    pytest.importorskip("lightning")
    from clipbias.integrations.lightning import DPCallback
    from test_lightning_dp import MLP, fit
    module = MLP()
    seen = []
    module.net[1].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, autocast="bfloat16")
    fit(dp, module, max_epochs=1)
    assert dp.engine.steps_taken == 4 and dp.engine.autocast == (torch.bfloat16, 1.0) and torch.bfloat16 in seen
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in module.parameters())
