"""``sum_precision="float32"``: the fast path's ghost-layer clipped sums from per-example
float32 gradients, with the sensitivity ``C (1 + delta)`` their proven rounding allows (docs/privacy.md,
"Float32 clipped sums").

Every released quantity is measured in float64 from the float32 outputs. The bound each test asserts is the
proof's: example i's own piece has norm at most ``C (1 + delta)`` (``delta = last_sum_delta <= SUM32_DELTA``),
and a micro-batch of m examples with and without it differs by at most that plus the sums across the examples
(``precision.sum32_residual(m)`` of ``C (1 + delta)``: float32 within blocks of 8 pieces, float64 across them, one
rounding to float32; it covers the other layers' one rounding of their float64 sums too)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import clipbias.grads.fast as fc
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.errors import ConfigError
from clipbias.grads import precision
from clipbias.grads.fast import BookKeeping
from clipbias.grads.layers.linear import Matrix, float32_sum_route
from clipbias.grads.precision import SUM32_DELTA
from clipbias.step.clip import Clip

U = 2.0 ** -24


class _SumPositions(nn.Module):
    def forward(self, h):
        return h.sum(1)


def _bk(k: int = 64, o: int = 8) -> BookKeeping:
    """A BookKeeping whose first Linear runs over the positions (ghost norm with FORMED_BYTES < 0), then a
    one-position head (its float64 sums stay), on the float32 route."""
    m = nn.Sequential(nn.Linear(k, o), _SumPositions(), nn.Linear(o, 3))
    bk = BookKeeping(m)
    bk.sum_precision = "float32"
    return bk


def _tolerance(C: float, delta: float, m: int) -> float:
    """The proof's bound on how far one example moves a micro-batch's release of m examples (module docstring)."""
    return C * (1 + delta) * (1 + precision.sum32_residual(m))


def test_settings_and_their_refusal():
    assert precision.SUM_PRECISIONS == ("float64", "float32") and BookKeeping.sum_precision == "float64"
    with pytest.raises(ConfigError, match="sum_precision"):
        precision.check_sum_precision("bfloat16")
    assert precision.sum32_delta(precision.SUM32_RHO_MAX) <= SUM32_DELTA * (1 + 1e-12)
    # BERT-base's layers at 128 tokens are within the budget; GPT-2's at 512 tokens are not (float64 stays)
    assert precision.sum32_rho(128, 768, 768) < precision.SUM32_RHO_MAX < precision.sum32_rho(512, 768, 768)


def test_a_cancelling_example_contributes_at_most_C_1_plus_delta(monkeypatch):
    """The red team's positions alternating in sign with a small residual (the unbounded float32 ghost norm let
    one contribution reach 2.42 C): on the float32 route its released contribution, alone in its micro-batch,
    is within C (1 + delta)(1 + u), whatever the residual and magnitude."""
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    torch.manual_seed(0)
    bk, C = _bk(), 0.1
    clip = Clip(C)
    a, sign = torch.randn(64), torch.tensor([1.0, -1.0, 1.0, -1.0]).unsqueeze(1)
    worst = 0.0
    for scale in (1.0, 1e3, 1e8, 1e15):
        for residual in (1e-2, 1e-4, 1e-6, 0.0):
            for _ in range(4):
                x = (sign * a * scale + scale * residual * torch.randn(4, 64)).unsqueeze(0)
                proc = bk(x, torch.randint(0, 3, (1,)), clip.scale, False)[0]
                assert bk.last_sum_routes == {0: "float32"} and 0 < bk.last_sum_delta <= SUM32_DELTA
                got = float(proc.double().norm()) / (C * (1 + bk.last_sum_delta) * (1 + U))
                worst = max(worst, got)
    assert worst <= 1.0


@pytest.mark.parametrize("kind", ["cancelling", "huge", "tiny-and-huge"])
def test_neighbouring_batches_differ_by_at_most_the_inflated_sensitivity(monkeypatch, kind):
    """One example next to ordinary ones: enormous activations whose positions cancel exactly (it rounded the
    others' terms away in a float32 product over the whole batch: 8.15 C), enormous ones that do not cancel,
    and one with entries from 1e-30 to 1e30. The release with it and without it, in float64, differ by at most
    the proof's bound (``_tolerance``), at every magnitude."""
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    torch.manual_seed(1)
    bk, C = _bk(), 0.1
    clip = Clip(C)
    x, y = torch.randn(8, 2, 64), torch.randint(0, 3, (8,))
    without = bk(x, y, clip.scale, False)[0].double()
    d0 = bk.last_sum_delta
    for magnitude in (1e2, 1e6, 1e10, 1e15):  # (beyond ~1e17 the float32 Grams overflow: the step stops)
        a = magnitude * torch.randn(64)
        if kind == "cancelling":
            extra = torch.stack([a, -a])
        elif kind == "huge":
            extra = torch.stack([a, a + torch.randn(64)])
        else:  # a huge dynamic range inside one example
            extra = torch.stack([a, torch.full((64,), 1.0 / magnitude)]) * torch.sign(torch.randn(2, 64))
        proc = bk(torch.cat([x, extra.unsqueeze(0)]), torch.cat([y, torch.tensor([0])]), clip.scale, False)[0]
        assert bk.last_sum_routes == {0: "float32"} and bool(torch.isfinite(proc).all())
        moved = float((proc.double() - without).norm())
        assert moved <= _tolerance(C, max(d0, bk.last_sum_delta), 9), (kind, magnitude, moved / C)


def test_a_cancelling_example_does_not_round_the_others_away(monkeypatch):
    """The red team's 8.15 C attack: an example whose two positions cancel exactly (its first layer's gradient is
    exactly 0) but are huge, so that its clip factor leaves ``s_i U_i`` about 160 C there. In one float32 product
    over every (example, position) pair its terms round the other examples' partial sums at their own magnitude;
    on the float32 route its piece is formed alone (exactly 0), so the layer's release moves by no more than
    ``delta C`` plus the float32 sum across the examples."""
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    torch.manual_seed(9)
    bk, C = _bk(256, 64), 0.1
    clip = Clip(C)
    x, y = torch.randn(16, 2, 256), torch.randint(0, 3, (16,))
    without = bk(x, y, clip.scale, False)[0].double()[:64 * 256]  # the first Linear's weight
    worst = 0.0
    for magnitude in (1e3, 1e6, 1e9, 1e12):
        a = magnitude * torch.randn(256)
        proc = bk(torch.cat([x, torch.stack([a, -a]).unsqueeze(0)]), torch.cat([y, torch.tensor([0])]),
                  clip.scale, False)[0]
        assert bk.last_sum_routes == {0: "float32"}
        moved = float((proc.double()[:64 * 256] - without).norm())
        bound = C * bk.last_sum_delta + C * (1 + bk.last_sum_delta) * precision.sum32_residual(17)
        worst = max(worst, moved / bound)
    assert worst <= 1.0


def test_the_float32_route_equals_the_float64_route_within_its_delta(monkeypatch):
    """On ordinary data both routes release the same sum to within m delta C (each example's piece moves by at
    most delta C) plus the float32 sums' rounding; in fact to about 1e-6 C."""
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    torch.manual_seed(2)
    C = 0.5
    clip = Clip(C)
    x, y = torch.randn(16, 12, 64), torch.randint(0, 3, (16,))
    bk = _bk()
    f32 = bk(x, y, clip.scale, False)[0].double()
    delta = bk.last_sum_delta
    bk.sum_precision = "float64"
    f64 = bk(x, y, clip.scale, False)[0].double()
    assert bk.last_sum_routes == {} and bk.last_sum_delta == 0.0
    diff = float((f32 - f64).norm())
    assert diff <= 16 * C * delta + 2 * _tolerance(C, delta, 16) - 2 * C
    assert diff <= 1e-5 * C


def test_a_conv_ghost_layer_on_the_float32_route(monkeypatch):
    """A convolution on the ghost norm (16 output positions, L^2 <= o k) takes the route as a Linear does; its
    release is the float64 route's to within the proof's bound, and a batch of one is within C (1 + delta)."""
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(16, 32, 3), nn.Flatten(), nn.Linear(32 * 16, 3))
    bk, C = BookKeeping(model), 0.05
    clip = Clip(C)
    x, y = torch.randn(6, 16, 6, 6), torch.randint(0, 3, (6,))
    f64 = bk(x, y, clip.scale, False)[0].double()
    bk.sum_precision = "float32"
    f32 = bk(x, y, clip.scale, False)[0].double()
    assert bk.last_sum_routes == {0: "float32"}
    assert float((f32 - f64).norm()) <= 1e-5 * C
    one = bk(x[:1] * 1e10, y[:1], clip.scale, False)[0].double()
    assert float(one.norm()) <= C * (1 + bk.last_sum_delta) * (1 + U)


def test_normalisation_and_an_unknown_bound(monkeypatch):
    """A normalisation's factors (``s_i ||g_i|| < 1``, its bound) take the route, a batch of one within
    ``1 + delta``; a scale that is no stage's method (its bound unknown) keeps float64."""
    from clipbias.step.clip import Normalize, clip_scale
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    torch.manual_seed(10)
    bk, norm = _bk(), Normalize(0.01)
    x, y = torch.randn(1, 4, 64) * 1e6, torch.randint(0, 3, (1,))
    one = bk(x, y, norm.scale, False)[0].double()
    assert bk.last_sum_routes == {0: "float32"} and float(one.norm()) <= (1 + bk.last_sum_delta) * (1 + U)
    bk(x, y, lambda n: clip_scale(n, 0.1), False)
    assert bk.last_sum_routes == {0: "float64"} and bk.last_sum_delta == 0.0


def test_the_route_keeps_float64_where_the_proof_does_not_cover_a_layer():
    """Shapes with rho above the budget, a tied weight, a layer in float64 and a step without a known per-example
    bound keep the float64 sum; the route's choice never reads the values."""
    torch.manual_seed(4)
    lin = nn.Linear(128, 128)
    wide = Matrix(lin, torch.randn(2, 128, 128), torch.randn(2, 128, 128), True)  # L = 128, k = o = 128
    narrow = Matrix(lin, torch.randn(2, 16, 128), torch.randn(2, 16, 128), True)
    routes, delta = float32_sum_route([wide, narrow], 1.0)
    assert routes == {0: "float64", 1: "float32"} and wide.sum32 is None and narrow.sum32 is not None
    assert 0 < delta <= SUM32_DELTA
    assert float32_sum_route([narrow], None) == ({0: "float64"}, 0.0) and narrow.sum32 is None
    narrow.tied = True
    assert float32_sum_route([narrow], 1.0)[0] == {0: "float64"}
    narrow.tied = False
    wide64 = Matrix(lin, torch.randn(2, 16, 128).double(), torch.randn(2, 16, 128).double(), True)
    assert float32_sum_route([wide64], 1.0)[0] == {0: "float64"}


def test_an_example_that_could_overflow_contributes_nothing_to_the_layer():
    """``U_i >= 2^100``: its float32 gradient could overflow; it adds nothing to the layer's sum (a decision on
    its own values), and the release stays finite and equal to the others' sum."""
    torch.manual_seed(5)
    lin = nn.Linear(32, 16)
    a, g = torch.randn(4, 6, 32), torch.randn(4, 6, 16)
    a[3] *= 1e25
    g[3] *= 1e25
    r = Matrix(lin, a, g, True)
    float32_sum_route([r], 1.0)
    S = torch.tensor([[0.5, 0.25, 1.0, 1e-30]], dtype=torch.float64)
    got = r.sums(S)[0]
    assert bool(torch.isfinite(got).all())
    keep = Matrix(lin, a[:3], g[:3], True)
    float32_sum_route([keep], 1.0)
    assert torch.equal(got[:, :16 * 32], keep.sums(S[:, :3])[0][:, :16 * 32])


def test_each_examples_float32_piece_is_its_own():
    """What the proof rests on, as every path's per-example arithmetic: a batched product computes example j's
    float32 gradient from example j alone, bit for bit the same with or without another example in the batch."""
    torch.manual_seed(6)
    for b, L, k, o in ((9, 12, 64, 48), (9, 128, 96, 160)):
        a, g = torch.randn(b, L, k), torch.randn(b, L, o)
        a[4] *= 1e20
        with precision.full_float32():
            full = torch.bmm(g.transpose(1, 2).contiguous(), a)
            keep = [j for j in range(b) if j != 4]
            part = torch.bmm(g[keep].transpose(1, 2).contiguous(), a[keep])
        assert torch.equal(full[keep], part)


def test_the_engine_scales_its_noise_to_the_inflated_sensitivity():
    """``DPEngine(sum_precision="float32")``: the noise std is ``z C (1 + SUM32_DELTA)`` (the noise multiplier
    the accountant reads stays std / sensitivity, so the reported epsilon holds at C (1 + delta)), the fast
    path's sums take the route, and a moving bound's std per bound is scaled too; float64 changes nothing."""
    def engine(sp: str, algo: str = "dpsgd"):
        torch.manual_seed(7)
        model = nn.Sequential(nn.Linear(64, 8), _SumPositions(), nn.Linear(8, 3))
        return DPEngine(model, algo, n=64, batch_size=16, steps=4, noise_multiplier=1.3,
                        config=AlgoConfig(lr=0.1, clip=0.7), grad_path="fast", sum_precision=sp)
    e64, e32 = engine("float64"), engine("float32")
    assert e64.sum_delta == 0.0 and e32.sum_delta == SUM32_DELTA
    assert e64.fast.sum_precision == "float64" and e32.fast.sum_precision == "float32"
    assert "float32" in e32.grad_path_note and "float32" not in e64.grad_path_note
    assert math.isclose(e64.pipeline.noise.std, 1.3 * 0.7 / 16, rel_tol=1e-12)
    assert math.isclose(e32.pipeline.noise.std, e64.pipeline.noise.std * (1 + SUM32_DELTA), rel_tol=1e-15)
    assert e32.privacy().epsilon == e64.privacy().epsilon  # z relative to C (1 + delta)
    a64, a32 = engine("float64", "adaptive"), engine("float32", "adaptive")
    assert a64.pipeline.noise.per_bound is not None
    assert math.isclose(a32.pipeline.noise.per_bound, a64.pipeline.noise.per_bound * (1 + SUM32_DELTA), rel_tol=1e-15)
    with pytest.raises(ConfigError, match="sum_precision"):
        engine("float16")


def test_an_engine_step_on_the_float32_route(monkeypatch):
    """A step through the engine sums its ghost layer in float32 and records it."""
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(64, 8), _SumPositions(), nn.Linear(8, 3))
    e = DPEngine(model, "dpsgd", n=64, batch_size=16, steps=2, noise_multiplier=1.0,
                 config=AlgoConfig(lr=0.1, clip=1.0), grad_path="fast", sum_precision="float32")
    idx = e.sampler.sample()
    x, y = torch.randn(64, 4, 64), torch.randint(0, 3, (64,))
    before = [p.detach().clone() for p in model.parameters()]
    e.step(x[idx], y[idx], idx)
    assert e.fast.last_sum_routes == {0: "float32"} and 0 < e.fast.last_sum_delta <= SUM32_DELTA
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
