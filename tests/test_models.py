"""Tests for clipbias.models: shapes, per-example-gradient (vmap) exactness, no BatchNorm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from clipbias.models import (MODEL_NAMES, ScatterFeatures, WSConv2d, build_model, num_params)

IMAGE = (1, 28, 28)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPBIAS_CACHE_DIR", str(tmp_path))


def make(name: str, shape=IMAGE, classes: int = 10, **kw) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, shape, classes, **kw)


def per_example_grads_vmap(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(p, xi, yi):
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def per_example_grads_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        rows.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_shape_and_no_batchnorm(name):
    model = make(name)
    x = torch.randn(4, *model.input_shape)
    assert model(x).shape == (4, 10)
    bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.modules.batchnorm._BatchNorm)
    assert not any(isinstance(m, bn) for m in model.modules())
    assert not any(isinstance(m, (nn.GRU, nn.LSTM, nn.RNN)) for m in model.modules())
    assert num_params(model) > 0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_vmap_per_example_grads_match_loop(name):
    model = make(name)
    torch.manual_seed(1)
    x = torch.randn(3, *model.input_shape)
    y = torch.tensor([0, 3, 7])
    got = per_example_grads_vmap(model, x, y)
    want = per_example_grads_loop(model, x, y)
    assert set(got) == set(want) == {k for k, _ in model.named_parameters()}
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1.3e-6, msg=f"{name}: {k}")
    # examples really are independent: the grads of different examples differ
    first = next(iter(want))
    assert not torch.allclose(want[first][0], want[first][1])


def test_cnn_param_count_matches_tramer_boneh():
    assert num_params(make("cnn")) == 26010


@pytest.mark.parametrize("name,shape", [("cnn", IMAGE), ("cnn-gn", IMAGE), ("cnn", (3, 32, 32))])
def test_cnn_is_channels_last_and_computes_what_nchw_computes(name, shape):
    """The max-pooling cnns store their convolution weights channels-last (``simple.channels_last``), so
    their activations are channels-last too (where torch's CPU max pooling runs vectorised),
    and they compute what the NCHW layout computes: outputs and per-example gradients equal in
    float64 up to rounding, and the gradients come back in the parameters' shapes."""
    model = make(name, shape).double()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)
    x = torch.randn(5, *shape, dtype=torch.float64)
    y = torch.tensor([0, 3, 7, 1, 9])
    assert convs[0](x).is_contiguous(memory_format=torch.channels_last)
    nchw = make(name, shape).double().to(memory_format=torch.contiguous_format)
    assert not [m for m in nchw.modules() if isinstance(m, nn.Conv2d)][-1].weight.is_contiguous(
        memory_format=torch.channels_last)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), nchw.parameters()))
    torch.testing.assert_close(model(x), nchw(x), rtol=1e-12, atol=1e-12)
    got, want = per_example_grads_vmap(model, x, y), per_example_grads_loop(nchw, x, y)
    for k, p in model.named_parameters():
        assert got[k].shape == (5, *p.shape)
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


def test_model_input_shapes_other_data():
    assert make("logreg", (30,), 2)(torch.randn(5, 30)).shape == (5, 2)
    assert make("mlp", (64,), 10, hidden=32)(torch.randn(5, 64)).shape == (5, 10)
    gru = make("gru", (64,), 10)  # flat digits read as 8 rows of 8
    assert (gru.steps, gru.features) == (8, 8) and gru(torch.randn(2, 64)).shape == (2, 10)
    assert make("resnet20-enhanced", (1, 8, 8), 10)(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    whole = make("gru-norm", per_gate=False)
    assert len(whole.ln_x) == 1 and whole(torch.randn(2, *IMAGE)).shape == (2, 10)
    with pytest.raises(ValueError, match="too small"):
        make("cnn", (1, 8, 8))
    with pytest.raises(ValueError, match="unknown model"):
        make("vgg")


def test_gru_reads_rows_and_accepts_sequence_view():
    model = make("gru-norm")
    x = torch.randn(2, *IMAGE)
    torch.testing.assert_close(model(x), model(x.view(-1, 28, 28)))
    assert (model.steps, model.features) == (28, 28)


def test_weight_standardisation():
    conv = WSConv2d(3, 8, 3, bias=False, fan_in_scale=False)
    with torch.no_grad():
        conv.weight.normal_(0.3, 2.0)
    w = conv.standardized_weight()
    torch.testing.assert_close(w.mean(dim=(1, 2, 3)), torch.zeros(8), atol=1e-5, rtol=0)
    torch.testing.assert_close(w.var(dim=(1, 2, 3), unbiased=False), torch.ones(8), atol=1e-3, rtol=0)
    # rescaling a filter does not change the output (the point of WS)
    x = torch.randn(2, 3, 6, 6)
    out = conv(x)
    with torch.no_grad():
        conv.weight.mul_(5.0)
    torch.testing.assert_close(conv(x), out, atol=1e-4, rtol=1e-4)
    enhanced, plain = make("resnet20-enhanced"), make("resnet20-gn")
    assert any(isinstance(m, WSConv2d) for m in enhanced.modules())
    assert not any(isinstance(m, WSConv2d) for m in plain.modules())


def test_scatter_features_shape_determinism_and_cache(tmp_path, capsys):
    torch.manual_seed(0)
    x = torch.rand(5, *IMAGE)
    sf = ScatterFeatures((28, 28))
    a, b = sf.compute(x), sf.compute(x)
    assert a.shape == (5, 81, 7, 7) and sf.output_shape() == (81, 7, 7)
    assert torch.equal(a, b) and torch.isfinite(a).all()
    torch.testing.assert_close(ScatterFeatures((28, 28), chunk_size=2).compute(x), a)
    capsys.readouterr()
    cached = sf.cached(x, "unit-test")
    path = sf.cache_path(x, "unit-test")
    assert torch.equal(cached, a) and path.is_file()
    # what is written, where, its size and how to clear it: said once, when written
    err = capsys.readouterr().err
    assert f"scattering features of 5 images (unit-test): cached in {path} (0 MB;" in err
    assert "`clipbias cache --clear` deletes it" in err
    sf.compute = None  # a second call must be served from disk
    assert torch.equal(sf.cached(x, "unit-test"), a) and capsys.readouterr().err == ""


def test_scatter_models_preprocess_then_head():
    model = make("scatter-cnn")
    assert model.input_shape == (81, 7, 7) and model.raw_input_shape == IMAGE
    feats = model.preprocess(torch.rand(3, *IMAGE), cache_key="t")
    assert feats.shape == (3, 81, 7, 7) and model(feats).shape == (3, 10)
    assert model.feature_transform(torch.zeros(1, *IMAGE)).shape == (1, 81, 7, 7)
    # the scattering transform is not part of the trainable model
    assert num_params(make("scatter-linear")) == 81 * 49 * 10 + 10
    assert not list(model.buffers())
