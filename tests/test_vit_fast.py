"""Hugging Face ViT fully fine-tuned on the fast path: the bare ``cls_token`` and ``position_embeddings`` of
``ViTEmbeddings`` (``clipbias.grads.layers.vit``) equal to per-example autograd and to the rows path (dropout
included), a private run, the float32 clip, and the refusals (interpolated position embeddings, a mask
token, a changed forward) with ``grad_path="auto"`` falling back to the rows path."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import ViTConfig, ViTForImageClassification  # noqa: E402
from transformers.models.vit import modeling_vit  # noqa: E402

from clipbias.config import AlgoConfig  # noqa: E402
from clipbias.engine import DPEngine, aggregate  # noqa: E402
from clipbias.errors import ConfigError, PathRefusal  # noqa: E402
from clipbias.grads.layers import vit as vit_rule  # noqa: E402
from clipbias.grads.fast import BookKeeping, _rules_of, why_unsupported  # noqa: E402
from clipbias.grads.rows import FuncGradients, ParamSums  # noqa: E402
from clipbias.step import clip_scale  # noqa: E402
from tests.weights import at_weights  # noqa: E402


def vit(drop: float = 0.0, seed: int = 0, mask_token: bool = False) -> nn.Module:
    """A tiny random ViT (image 16, patch 8: 5 positions, width 32); ``mask_token``: its embeddings built with
    one (as ``ViTForMaskedImageModeling``'s are)."""
    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=16, patch_size=8, num_channels=3, num_labels=3, hidden_dropout_prob=drop,
                    attention_probs_dropout_prob=drop, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64)
    m = ViTForImageClassification(cfg)
    if mask_token:
        emb = modeling_vit.ViTEmbeddings(cfg, use_mask_token=True)
        emb.load_state_dict(m.vit.embeddings.state_dict(), strict=False)
        m.vit.embeddings = emb
    with torch.no_grad():  # away from transformers' init (cls_token zeros, small position embeddings)
        m.vit.embeddings.cls_token.normal_()
        m.vit.embeddings.position_embeddings.normal_()
    return m


def classify(out, y):
    return nn.functional.cross_entropy(out.logits, y, reduction="none")


def images(b: int, seed: int = 2, dtype=torch.float64) -> dict:
    return {"pixel_values": torch.randn(b, 3, 16, 16, generator=torch.Generator().manual_seed(seed), dtype=dtype)}


def labels(b: int) -> torch.Tensor:
    return torch.arange(b) % 3


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def own_gradients(model: nn.Module, x: dict, y: torch.Tensor) -> torch.Tensor:
    """``[b, d]``: each example's gradient by autograd, the example alone in the batch."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        classify(model(**{k: v[i:i + 1] for k, v in x.items()}), y[i:i + 1]).sum(), params)]) for i in range(len(y))])


def engine(model: nn.Module, path: str, n: int, **kw) -> DPEngine:
    return DPEngine(model, "dpsgd", n=n, batch_size=n, steps=2, noise_multiplier=0.5, noise_seed=3, loss_fn=classify,
                    grad_path=path, config=AlgoConfig(lr=1.0, clip=kw.pop("clip", 0.05)), **kw)


@pytest.mark.parametrize("frozen", [(), ("cls_token", "projection"), ("position_embeddings", "projection")])
def test_full_vit_norms_and_clipped_sum_equal_per_example_autograd(frozen):
    """Nothing frozen (float64, eval): the fast path's per-example norms and clipped sum equal per-example
    autograd's, example by example, to 1e-10; its reference sum the plain sum; cls_token and
    position_embeddings take the ViTEmbeddings rule. The same with one of them and the patch projection
    frozen (the graph at the dropout's input then has no edge for them)."""
    m = vit().double().eval()
    for name, p in m.named_parameters():
        if any(f in name for f in frozen):
            p.requires_grad_(False)
    assert why_unsupported(m) is None
    x, y = images(5), labels(5)
    want = own_gradients(m, x, y)
    C = float(want.norm(dim=1).median())
    bk = BookKeeping(m, classify)
    assert type(bk.layers[0]).__name__ == "ViTEmbeddings"
    proc, ref, _, norms = bk(x, y, lambda n: clip_scale(n, C), True)
    torch.testing.assert_close(norms, want.norm(dim=1), rtol=1e-10, atol=0)
    torch.testing.assert_close(proc, (want * clip_scale(want.norm(dim=1), C).unsqueeze(1)).sum(0), rtol=0, atol=1e-10)
    torch.testing.assert_close(ref, want.sum(0), rtol=0, atol=1e-10)
    if not frozen:
        names = [n for n, p in m.named_parameters()]
        assert names[:2] == ["vit.embeddings.cls_token", "vit.embeddings.position_embeddings"]
        d, P = 32, 5  # the class token's and the position embeddings' per-example gradients are not zero
        assert want[:, :d].norm(dim=1).min() > 1e-6 and want[:, d:d + P * d].norm(dim=1).min() > 1e-6


@pytest.mark.parametrize("drop", [0.0, 0.1])
def test_full_vit_fine_tuning_fast_path_equals_the_rows_path(drop):
    """Two float64 DP-SGD steps of full fine-tuning under one key, training mode, hidden and attention
    dropout 0.1 keyed per example (the same masks on both paths): the fast path's parameters equal the
    rows path's to 1e-10."""
    x, y = images(6), labels(6)
    before = flat(vit(drop).double())
    after = {}
    for path in ("rows", "fast"):
        m = vit(drop).double().train()
        e = engine(m, path, 6)
        assert (e.fast is not None) == (path == "fast")
        for _ in range(2):
            idx = e.sampler.sample()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # vmap's fallback for SDPA on the CPU
                e.step({k: v[idx] for k, v in x.items()}, y[idx], idx)
        after[path] = flat(m)
    assert (after["fast"] - before).norm() > 1e-2
    torch.testing.assert_close(after["fast"], after["rows"], rtol=0, atol=1e-10)


def test_two_point_combination_equals_the_rows_path():
    """DiSK's rows ``c g(far) + (1 - c) g(here)``: the rule's cross term gives the rows path's norms and sums."""
    m = vit().double().eval()
    far = [p.detach() + 0.05 * torch.randn_like(p) for p in m.parameters()]
    enter = at_weights(m, far)
    x, y = images(4), labels(4)
    scale = lambda n: clip_scale(n, 0.5)  # noqa: E731
    fast = BookKeeping(m, classify)(x, y, scale, False, at=(enter, 1.7))
    rows = ParamSums(FuncGradients(m, classify))(x, y, scale, False, at=(enter, 1.7))
    for got, want, what in zip(fast, rows, ("clipped sum", "reference sum", "losses", "norms")):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=what)


def test_private_fine_tuning_of_vit_on_the_fast_path():
    """float32, dropout 0.1, nothing frozen: four private steps with ``grad_path="fast"`` train the cls token
    and position embeddings too, the losses stay finite and epsilon is reported."""
    m = vit(0.1).train()
    x, y = images(16, dtype=torch.float32), labels(16)
    e = DPEngine(m, "dpsgd", n=16, batch_size=8.0, steps=4, noise_multiplier=1.0, delta=1e-4, loss_fn=classify,
                 grad_path="fast", config=AlgoConfig(lr=0.05, clip=1.0, optimizer="adam"), noise_seed=0)
    assert e.fast is not None
    cls = m.vit.embeddings.cls_token.detach().clone()
    pos = m.vit.embeddings.position_embeddings.detach().clone()
    for _ in range(4):
        idx = e.sampler.sample()
        losses = e.step({k: v[idx] for k, v in x.items()}, y[idx], idx)
        assert torch.isfinite(losses).all()
    report = e.privacy()
    assert e.steps_taken == 4 and 0 < report.epsilon < math.inf and e.grad_path_fallback is None
    emb = m.vit.embeddings
    assert not torch.equal(cls, emb.cls_token) and not torch.equal(pos, emb.position_embeddings)


def test_each_clipped_contribution_is_within_the_clip_in_float32():
    """float32: each example's clipped contribution (alone in the batch), measured in float64, is at most
    C: the rule's norms are upper bounds on what it sums. Images over magnitudes 1e-3 to 1e3, a clip far
    below the gradients."""
    m = vit().eval()
    bk, clip = BookKeeping(m, classify), 1e-3
    x, y = images(6, dtype=torch.float32)["pixel_values"], labels(6)
    x = x * torch.logspace(-3, 3, 6).view(-1, 1, 1, 1)
    worst = 0.0
    for i in range(6):
        got, _, _, norms = bk({"pixel_values": x[i:i + 1]}, y[i:i + 1], lambda n: clip_scale(n, clip), False)
        assert float(norms[0]) > 10 * clip
        worst = max(worst, float(got.double().norm()))
    assert clip * 0.99 < worst <= clip * (1 + 1e-6)  # the float32 sum's own rounding aside (docs/privacy.md)
    # the probe's float64 recheck (run on a float32 mismatch) recomputes the rule with widened parameters
    _, acts, grads = bk._backward({"pixel_values": x}, y)
    rules = _rules_of(bk.layers, acts, grads[:len(bk.layers)])
    fast = bk._ordered([r.combo([0, 3], [0.7, 1.3]) for r in rules])
    assert bk._agree_in_float64({"pixel_values": x}, y, [0, 3], [0.7, 1.3], fast)


class Interpolating(nn.Module):
    """A ViT called with ``interpolate_pos_encoding=True`` (or with ``bool_masked_pos``)."""

    def __init__(self, model: nn.Module, masked: bool = False) -> None:
        super().__init__()
        self.model, self.masked = model, masked

    def forward(self, pixel_values):
        if self.masked:
            mask = torch.zeros(pixel_values.shape[0], 4, dtype=torch.bool)
            return self.model(pixel_values=pixel_values, bool_masked_pos=mask)
        return self.model(pixel_values=pixel_values, interpolate_pos_encoding=True)


@pytest.mark.parametrize("masked", [False, True])
def test_interpolated_position_embeddings_and_masked_patches_are_refused(masked, monkeypatch):
    """``interpolate_pos_encoding=True`` (or ``bool_masked_pos``, with a frozen mask token): the fast path
    refuses the step before anything changes; ``grad_path="auto"``, which took the fast path, falls back to the
    rows path, which gives the rows path's parameters."""
    def model():
        inner = vit(mask_token=masked).double()
        if masked:
            inner.vit.embeddings.mask_token.requires_grad_(False)
        return Interpolating(inner, masked)
    x, y = images(4), labels(4)
    e = engine(model(), "fast", 4)
    before = flat(e.model)
    idx = e.sampler.sample()
    with pytest.raises(PathRefusal, match="`interpolate_pos_encoding=True` or `bool_masked_pos`"):
        e.step(x, y[idx], idx)
    assert torch.equal(flat(e.model), before) and e.steps_taken == 0
    got = {}
    for path in ("auto", "rows"):
        with monkeypatch.context() as mp:
            mp.setattr(aggregate, "AUTO_ROWS_BYTES", 0)  # auto takes the fast path wherever it applies
            e = engine(model(), path, 4)
        assert (e.fast is not None) == (path == "auto")
        idx = e.sampler.sample()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            e.step(x, y[idx], idx)
        assert (path == "auto") == any("fast path refused" in str(w.message) for w in seen)
        got[path] = (flat(e.model), e)
    assert got["auto"][1].fast is None and got["auto"][1].grad_path_fallback.startswith("fast -> rows")
    torch.testing.assert_close(got["auto"][0], got["rows"][0], rtol=0, atol=1e-12)


def test_a_changed_forward_a_subclass_and_a_trainable_mask_token_are_refused(monkeypatch):
    """The rule takes transformers' ViTEmbeddings with its reviewed forward only: a forward edited on the
    class (another transformers version), one set on the instance, a subclass and a trainable mask token
    are refused when the engine is built (``grad_path="auto"`` keeps the rows path, and says why)."""
    assert vit_rule.why_not(vit().vit.embeddings) is None
    inst = vit()
    inst.vit.embeddings.forward = lambda pixel_values, **kw: modeling_vit.ViTEmbeddings.forward(
        inst.vit.embeddings, pixel_values, **kw)
    assert "not the reviewed ViTEmbeddings forward" in why_unsupported(inst)

    class Mine(modeling_vit.ViTEmbeddings):
        pass
    sub = vit()
    sub.vit.embeddings.__class__ = Mine
    assert "(Mine) has trainable parameters and no fast-path rule" in why_unsupported(sub)
    masked = vit(mask_token=True)
    assert "trainable parameters ['mask_token']" in why_unsupported(masked)
    masked.vit.embeddings.mask_token.requires_grad_(False)
    assert why_unsupported(masked) is None

    original = modeling_vit.ViTEmbeddings.forward

    def edited(self, pixel_values, bool_masked_pos=None, interpolate_pos_encoding=False):
        return original(self, pixel_values, bool_masked_pos, interpolate_pos_encoding) * 2.0
    monkeypatch.setattr(modeling_vit.ViTEmbeddings, "forward", edited)
    assert "not the reviewed ViTEmbeddings forward" in why_unsupported(vit())
    with pytest.raises(ConfigError, match="`grad_path='fast'` is not available: .*not the reviewed ViTEmbeddings"):
        engine(vit(), "fast", 4)
    monkeypatch.setattr(aggregate, "AUTO_ROWS_BYTES", 0)
    e = engine(vit(), "auto", 4)
    assert e.fast is None and "not the reviewed ViTEmbeddings forward" in e.grad_path_note


def test_a_dropout_pre_hook_and_a_foreign_graph_are_refused():
    """A forward pre-hook on the embeddings' dropout could change the embeddings after the position add:
    refused at the step. ``check_graph`` accepts the reviewed forward's graph only."""
    m = vit().double()
    x, y = images(3), labels(3)
    h = m.vit.embeddings.dropout.register_forward_pre_hook(lambda mod, inp: (inp[0] * 2,))
    with pytest.raises(PathRefusal, match="forward pre-hook is registered on a ViTEmbeddings layer's dropout"):
        BookKeeping(m, classify)(x, y, lambda n: clip_scale(n, 1.0), False)
    h.remove()
    assert BookKeeping(m, classify)(x, y, lambda n: clip_scale(n, 1.0), False)[0].numel() > 0
    emb = m.vit.embeddings
    t = torch.randn(3, 5, 32, dtype=torch.float64, requires_grad=True)
    assert "not the sum" in vit_rule.check_graph(emb, t * 1)
    assert "position embeddings do not enter" in vit_rule.check_graph(emb, t + emb.position_embeddings.detach())
    patches = torch.randn(3, 4, 32, dtype=torch.float64)
    swapped = torch.cat((patches, emb.cls_token.expand(3, -1, -1)), 1) + emb.position_embeddings
    assert "class token does not enter" in vit_rule.check_graph(emb, swapped)
    twice = torch.cat((emb.cls_token.expand(3, 2, -1), patches[:, 1:]), 1) + emb.position_embeddings
    assert "class token does not enter" in vit_rule.check_graph(emb, twice)  # its gradient would be G_i[0] + G_i[1]
    right = torch.cat((emb.cls_token.expand(3, -1, -1), patches), 1) + emb.position_embeddings
    assert vit_rule.check_graph(emb, right) is None
