"""The fast path's structural proof that a model's rows are per-example (``clipbias.grads.separable``):
what it accepts, everything that voids it, and that the per-step probe runs exactly where it fails."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import clipbias.grads.fast as fast
from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError
from clipbias.grads import separable
from clipbias.models import build_model

IMAGE = (1, 28, 28)


@pytest.mark.parametrize("name,shape", [("cnn", IMAGE), ("cnn-gn", IMAGE), ("cnn", (3, 32, 32)), ("logreg", IMAGE),
                                        ("mlp", IMAGE), ("scatter-linear", IMAGE), ("scatter-cnn", IMAGE),
                                        ("resnet20-gn", IMAGE)])
def test_the_feed_forward_models_are_per_example_by_construction(name, shape):
    assert separable.why_not(build_model(name, shape, 10)) is None


class _Mixer(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


def _cnn_subclass():
    cls = type(build_model("cnn", IMAGE, 10))

    class Centred(cls):  # inherits PER_EXAMPLE's class but not its declaration
        def forward(self, x):
            return super().forward(x - x.mean(0))
    return Centred(IMAGE, 10)


def _hooked(kind):
    m = build_model("cnn", IMAGE, 10)
    tanh = m.features[2]
    {"forward": lambda: tanh.register_forward_hook(lambda mod, i, o: o - o.mean(0)),
     "pre": lambda: tanh.register_forward_pre_hook(lambda mod, i: (i[0] - i[0].mean(0),)),
     "backward": lambda: tanh.register_full_backward_hook(lambda mod, gi, go: (gi[0].mean(0).expand_as(gi[0]),)),
     "instance": lambda: setattr(tanh, "forward", lambda x: torch.tanh(x - x.mean(0)))}[kind]()
    return m


@pytest.mark.parametrize("make,why", [
    (lambda: _hooked("forward"), "has a hook"),
    (lambda: _hooked("pre"), "has a hook"),
    (lambda: _hooked("backward"), "has a hook"),
    (lambda: _hooked("instance"), "forward of its own on the instance"),
    (_cnn_subclass, "not a module whose rows are known"),
    (lambda: nn.Sequential(nn.Flatten(0), nn.Linear(10 * 784, 10)), "flattens from dimension 0"),
    (lambda: nn.Sequential(nn.Flatten(), nn.BatchNorm1d(784), nn.Linear(784, 10)), "BatchNorm1d"),
    (lambda: nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(784, 10)), "Dropout"),
    (lambda: nn.Sequential(nn.Flatten(), _Mixer(), nn.Linear(784, 10)), "_Mixer"),
    (lambda: nn.Sequential(nn.Flatten(), nn.Softmax(0), nn.Linear(784, 10)), "Softmax"),
    (lambda: build_model("resnet20-enhanced", IMAGE, 10), "WSConv2d"),
])
def test_anything_that_could_mix_examples_voids_the_proof(make, why):
    got = separable.why_not(make())
    assert got is not None and why in got


def test_a_replaced_class_forward_or_a_global_hook_voids_the_proof(monkeypatch):
    m = build_model("cnn", IMAGE, 10)
    handle = nn.modules.module.register_module_forward_hook(lambda mod, i, o: o)
    try:
        assert "global module hook" in separable.why_not(m)
    finally:
        handle.remove()
    assert separable.why_not(m) is None
    monkeypatch.setattr(nn.Tanh, "forward", lambda self, x: torch.tanh(x - x.mean(0)))
    assert "Tanh.forward was replaced" in separable.why_not(m)


def test_an_unbatched_input_to_a_batched_layer_voids_the_proof():
    """A 3-D input to a Conv2d is one unbatched example whose channels are the rows: the convolution
    would mix them. Likewise a 1-D input to a Linear."""
    conv, lin = nn.Conv2d(3, 3, 3), nn.Linear(4, 2)
    assert separable.batched({conv: torch.zeros(5, 3, 8, 8), lin: torch.zeros(5, 4)})
    assert not separable.batched({conv: torch.zeros(3, 8, 8)})
    assert not separable.batched({lin: torch.zeros(4)})


def _engine(model, **kw):
    return DPEngine(model, "dpsgd", n=60, batch_size=12.0, steps=10, noise_multiplier=1.0,
                    config=AlgoConfig(lr=0.1, clip=1.0), grad_path="fast", **kw)


def _probes(monkeypatch) -> list:
    calls, check = [], fast.BookKeeping._check_examples

    def counted(self, *args):
        calls.append(1)
        return check(self, *args)
    monkeypatch.setattr(fast.BookKeeping, "_check_examples", counted)
    return calls


def test_the_probe_runs_exactly_where_the_structure_proves_nothing(monkeypatch):
    calls = _probes(monkeypatch)
    x, y = torch.randn(12, *IMAGE), torch.randint(0, 10, (12,))
    torch.manual_seed(0)
    e = _engine(build_model("cnn", IMAGE, 10))
    e.step(x, y, torch.arange(12))
    assert calls == [] and "by the model's structure" in e.grad_path_note
    e = _engine(build_model("cnn", IMAGE, 10), loss_fn=lambda out, t: nn.functional.cross_entropy(out, t, reduction="sum"))
    e.step(x, y, torch.arange(12))  # a loss returning the batch's total: evaluated one example at a time, not probed
    assert calls == []
    e = _engine(build_model("cnn", IMAGE, 10), loss_fn=lambda out, t: nn.functional.cross_entropy(out, t, reduction="none"))
    e.step(x, y, torch.arange(12))  # per-example losses of the user's: they may combine examples, probed
    assert calls == [1]
    assert "run-time checks" in _engine(nn.Sequential(nn.Flatten(), nn.Linear(784, 10), _Mixer())).grad_path_note


def test_a_mixing_hook_on_a_per_example_model_is_caught_by_the_probe(monkeypatch):
    """A forward hook on the cnn's tanh that subtracts the batch mean: the structure no longer proves
    anything, the probe runs, and the mixing is refused before any change."""
    calls = _probes(monkeypatch)
    torch.manual_seed(0)
    m = build_model("cnn", IMAGE, 10)
    m.features[2].register_forward_hook(lambda mod, i, o: o - o.mean(0))
    e = _engine(m)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ConfigError, match="lets examples see each other"):
        e.step(torch.randn(12, *IMAGE), torch.randint(0, 10, (12,)), torch.arange(12))
    assert calls and e.steps_taken == 0 and all(torch.equal(a, p) for a, p in zip(before, m.parameters()))


@pytest.mark.parametrize("name,fast_path", [("mlp", True), ("logreg", True), ("scatter-linear", True),
                                            ("cnn", False), ("resnet20-gn", False)])
def test_auto_takes_the_fast_path_for_dense_models_proven_per_example(name, fast_path):
    e = DPEngine(build_model(name, IMAGE, 10), "dpsgd", n=60, batch_size=12.0, steps=10, noise_multiplier=1.0,
                 grad_path="auto")
    assert (e.fast is not None) is fast_path


def test_the_gpt_is_per_example_by_construction_and_its_layer_norms_are_checked():
    from clipbias.models.gpt import GPT
    m = GPT(vocab=50, context=8, width=16, layers=1, heads=2)
    assert separable.why_not(m) is None
    ln = m.blocks[0].ln1
    assert separable.batched({ln: torch.zeros(3, 8, 16)})
    assert not separable.batched({ln: torch.zeros(16)})  # an input with no dimension besides the normalised one
    assert "max_norm" in separable.why_not(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0)))
    assert "scale_grad_by_freq" in separable.why_not(nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True)))
    assert "no trainable affine" in separable.why_not(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, elementwise_affine=False)))
