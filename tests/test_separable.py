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


@pytest.mark.parametrize("name,batch_size,fast_path", [
    ("mlp", 12.0, True), ("logreg", 12.0, True), ("scatter-linear", 12.0, True), ("mlp", 4000.0, True),
    ("cnn", 12.0, True), ("resnet20-gn", 12.0, True),
    # 1.2 x 400 rows of resnet20-gn's 0.27M parameters pass FORMED_BYTES: some convolutions would take
    # the ghost norm, which was slower than the rows path
    ("resnet20-gn", 400.0, False)])
def test_auto_takes_the_fast_path_for_models_proven_per_example(name, batch_size, fast_path):
    """On the CPU, ``auto`` takes the fast path for a model per-example by construction: always when it
    has no trainable convolution, else while a micro-batch's rows fit the fast path's budget of formed
    per-example gradients."""
    e = DPEngine(build_model(name, IMAGE, 10), "dpsgd", n=5000, batch_size=batch_size, steps=10,
                 noise_multiplier=1.0, grad_path="auto")
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
    frozen = nn.LayerNorm(4, elementwise_affine=False)  # no parameters: its inputs are recorded by watch all the same
    assert separable.why_not(nn.Sequential(nn.Linear(4, 4), frozen)) is None
    assert not separable.batched({frozen: [1]})


class _CopiedLogReg(nn.Module):
    """A user's class copied from clipbias's LogReg with its declaration, whose forward standardises
    the batch: the declaration of a class outside clipbias.models is not a review."""

    PER_EXAMPLE = True

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(36, 10)

    def forward(self, x):
        x = x.flatten(1)
        return self.fc(x - x.mean(0))


def _with_instance_function(kind):
    if kind == "features":  # ScatterLinear's helper, bypassing its GroupNorm
        m = build_model("scatter-linear", IMAGE, 10)
        m._features = lambda t: t - t.mean(0)
    elif kind == "conv_forward":  # Conv2d.forward calls self._conv_forward
        m = build_model("cnn", IMAGE, 10)
        conv, inner = m.features[0], m.features[0]._conv_forward
        conv._conv_forward = lambda inp, w, b: inner(inp - inp.mean(0), w, b)
    else:  # compile(): the instance's compiled call runs instead of its forward
        m = build_model("mlp", IMAGE, 10)
        m.net[2]._compiled_call_impl = lambda t: torch.tanh(t - t.mean(0))
    return m


@pytest.mark.parametrize("make,why", [
    (_CopiedLogReg, "not a module whose rows are known"),
    (lambda: _with_instance_function("features"), "has a _features of its own on the instance"),
    (lambda: _with_instance_function("conv_forward"), "has a _conv_forward of its own on the instance"),
    (lambda: _with_instance_function("compiled"), "has a _compiled_call_impl of its own on the instance"),
    (lambda: nn.Sequential(nn.SiLU(inplace=True), nn.Linear(6, 10)), "works in place"),
])
def test_instance_functions_copied_declarations_and_in_place_activations_void_the_proof(make, why):
    got = separable.why_not(make())
    assert got is not None and why in got


@pytest.mark.parametrize("owner,name,replacement", [
    ("mlp", "forward", lambda self, x: self.net(x - x.mean(0))),  # a reviewed class's forward
    (nn.Tanh, "__call__", lambda self, x: torch.tanh(x - x.mean(0))),  # a torch type's call, shadowing Module's
    (nn.Conv2d, "_conv_forward", lambda self, x, w, b: nn.functional.conv2d(x - x.mean(0), w, b)),
    (nn.functional, "linear", lambda x, w, b=None: torch.addmm(b, x - x.mean(0), w.t())),  # a torch function
    (torch.nn.modules.linear, "F", type("F", (), {"linear": staticmethod(lambda x, w, b=None: x - x.mean(0))})),
])
def test_a_method_or_torch_function_replaced_after_import_voids_the_proof(monkeypatch, owner, name, replacement):
    owner = type(build_model("mlp", IMAGE, 10)) if owner == "mlp" else owner
    m = build_model("mlp", IMAGE, 10)
    assert separable.why_not(m) is None
    monkeypatch.setattr(owner, name, replacement, raising=False)
    assert f"{owner.__name__.split('.')[-1]}.{name} was replaced" in separable.why_not(m)
    monkeypatch.undo()
    assert separable.why_not(m) is None


def test_a_frozen_convolution_fed_an_unbatched_looking_batch_voids_the_proof(monkeypatch):
    """A frozen Conv1d given ``[B, L]`` with B in-channels reads the batch as one example: every output
    row mixes every example. Its input is not among the trainable layers' (``acts``), so ``watch``
    records every Linear/Conv input; the probe then runs and refuses the step (a batch of one has one
    channel), before any change; a 3-D input keeps the proof."""
    calls = _probes(monkeypatch)
    conv = nn.Conv1d(6, 6, 3, padding=1).requires_grad_(False)
    m = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(5, 10))
    x, y = torch.randn(6, 5), torch.randint(0, 10, (6,))
    with separable.watch(m) as seen:
        m(x)
    assert seen[conv] == [2] and not separable.proven(m, seen) and separable.why_not(m) is None
    e = _engine(m)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ConfigError, match="computing per-example gradients failed"):
        e.step(x, y, torch.arange(6))
    assert calls and e.steps_taken == 0 and all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    m2 = nn.Sequential(nn.Conv1d(1, 6, 3, padding=1).requires_grad_(False), nn.Flatten(), nn.Linear(30, 10))
    with separable.watch(m2) as seen:
        m2(x.unsqueeze(1))
    assert separable.proven(m2, seen)


def test_torchs_own_wrappers_keep_the_proof(monkeypatch):
    """Importing torch._dynamo wraps torch.manual_seed (torch._disable_dynamo): the function it wraps
    runs unchanged. A torch.compile run wraps nn.Module.__init__ and __setstate__: they only build
    modules, whose instances are checked. The proof holds through both."""
    import torch._dynamo  # noqa: F401
    m = build_model("mlp", IMAGE, 10)
    assert separable.why_not(m) is None
    init = nn.Module.__init__
    monkeypatch.setattr(nn.Module, "__init__", lambda self, *a, **k: init(self, *a, **k))
    monkeypatch.setattr(nn.Tanh, "__init__", lambda self, *a, **k: init(self), raising=False)
    assert separable.why_not(m) is None


class _CentredTensor(torch.Tensor):
    """A batch whose ``__torch_function__`` centres every Linear's input on the batch mean."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is nn.functional.linear:
            x = args[0].as_subclass(torch.Tensor)
            args = (x - x.mean(0), *args[1:])
        return super().__torch_function__(func, types, args, kwargs or {})


class _CentreMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is nn.functional.linear:
            args = (args[0] - args[0].mean(0), *args[1:])
        return func(*args, **(kwargs or {}))


class _CentringLabels(torch.Tensor):
    """Labels whose ``__torch_function__`` takes the cross-entropy of logits centred on the batch mean."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is nn.functional.cross_entropy:
            out = args[0]
            return func(out - 2 * out.mean(0), args[1].as_subclass(torch.Tensor), **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs or {})


def _mean_on_unpack(t):  # the tanh output saved for the backward, with the batch mean added
    return t + t.mean(0) if t.shape == (12, 16) else t


@pytest.mark.parametrize("outside", ["subclass", "mode", "saved", "labels"])
def test_code_outside_the_modules_in_the_forward_voids_the_proof_and_the_probe_refuses_it(monkeypatch, outside):
    """A tensor subclass as the batch, or a torch function mode around the step, runs inside every
    layer (here: centring the Linear's input on the batch mean, which moved the clipped sum by 2.19 C
    with the probe skipped); saved-tensor hooks can rewrite what the backward reads (the batch mean
    added to a saved activation: 1.04 C): the proof does not hold, the probe runs and refuses the
    step. A ``with torch.device(...)`` context (a function mode that only places tensors) keeps the proof."""
    calls = _probes(monkeypatch)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 10))
    x, y = torch.randn(12, 12), torch.randint(0, 10, (12,))
    with separable.watch(m) as seen, torch.device("cpu"):
        m(x)
    assert separable.proven(m, seen)
    e = _engine(m)
    with pytest.raises(ConfigError, match="lets examples see each other"):
        if outside == "subclass":
            e.step(x.as_subclass(_CentredTensor), y, torch.arange(12))
        elif outside == "labels":  # never reach a module: checked apart (1.57 C with the probe skipped)
            e.step(x, y.as_subclass(_CentringLabels), torch.arange(12))
        elif outside == "mode":
            with _CentreMode():
                e.step(x, y, torch.arange(12))
        else:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, _mean_on_unpack):
                e.step(x, y, torch.arange(12))
    assert calls and e.steps_taken == 0


def test_a_method_added_to_a_torch_class_under_a_new_name_keeps_the_proof(monkeypatch):
    """transformers adds ``nn.Module.smart_apply`` when it loads a model: a new name, which no torch
    code calls, shadows nothing (a torch method shadowed on a subclass voids the proof: above)."""
    m = build_model("cnn", IMAGE, 10)
    monkeypatch.setattr(nn.Module, "smart_apply", lambda self, fn: None, raising=False)
    monkeypatch.setattr(nn.Tanh, "brand_new_helper", lambda self: None, raising=False)
    assert separable.why_not(m) is None


@pytest.mark.parametrize("module,name,replacement", [
    ("resnet", "_shortcut_a", lambda x, planes, stride: x - x.mean(0)),  # a helper a reviewed forward calls
    ("resnet", "F", type("F", (), {"relu": staticmethod(lambda x: torch.relu(x - x.mean(0)))})),
    ("gpt", "F", type("F", (), {"gelu": staticmethod(lambda x, approximate="none": x - x.mean(0))})),
])
def test_a_global_of_a_reviewed_model_module_replaced_after_import_voids_the_proof(monkeypatch, module, name,
                                                                                    replacement):
    """The reviewed forwards call their module's globals (resnet's ``_shortcut_a`` and ``F``, gpt's ``F``):
    one rebound after import (to centre the batch) moved the clipped sum by 2.37 / 3.15 / 1.15 C with
    the probe skipped (benchmarks/redteam/separable/rt_model_module_globals.py)."""
    import importlib
    from clipbias.models.gpt import GPT
    home = importlib.import_module(f"clipbias.models.{module}")
    m = build_model("resnet20-gn", (1, 8, 8), 10) if module == "resnet" else GPT(50, 8, 16, 1, 2)
    assert separable.why_not(m) is None
    monkeypatch.setattr(home, name, replacement)
    assert f"clipbias.models.{module}.{name} was replaced" in separable.why_not(m)
    monkeypatch.undo()
    assert separable.why_not(m) is None


def test_a_class_posing_as_a_reviewed_model_is_not_reviewed():
    """A copy of a reviewed class (same module name, qualified names and methods' metadata) is not the
    class its module defined: not reviewed."""
    from clipbias.models import simple
    Copy = type("MLP", (nn.Module,), {k: v for k, v in vars(simple.MLP).items() if k not in ("__dict__", "__weakref__")})
    m = build_model("mlp", IMAGE, 10)
    assert separable.why_not(m) is None
    m.__class__ = Copy
    assert "not a class its reviewed module defines" in separable.why_not(m)


def _sum(e, x, y):
    return e.fast(x, y, e.pipeline.per_sample[0].scale, reference=False)[0]


def test_a_summed_loss_never_sees_a_batch_whole(monkeypatch):
    """A loss returning the batch's total runs one example at a time; the first step's call that learns
    so runs on zeros. On the step's output, a hook the loss registered there (normalising the logits'
    gradient by the batch's norm) ran in the first step's backward (1.27 C), and a temperature it set
    from the first batch it saw entered every later step (0.65 C from an example of another step):
    benchmarks/redteam/separable/rt_loss_hooks.py, rt_loss_first_call.py."""
    calls = _probes(monkeypatch)
    x, y = torch.randn(12, 12), torch.randint(0, 10, (12,))
    x[0] *= 50

    def hooked(out, t):
        if out.requires_grad:
            out.register_hook(lambda g: g / g.norm())
        return nn.functional.cross_entropy(out, t, reduction="sum")
    torch.manual_seed(0)
    e = _engine(nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 10)), loss_fn=hooked)
    assert torch.allclose(_sum(e, x, y), _sum(e, x, y), rtol=1e-5, atol=1e-7) and calls == []

    class LazyTemperature:
        scale = None

        def __call__(self, out, t):
            if self.scale is None:
                self.scale = out.detach().std().clamp_min(1e-3)
            return nn.functional.cross_entropy(out / self.scale, t, reduction="sum")
    later = []
    for first in (x, x[1:]):  # one example more or less in the first step
        torch.manual_seed(0)
        e = _engine(nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 10)), loss_fn=LazyTemperature())
        _sum(e, first, y[:len(first)])
        later.append(_sum(e, x[1:], y[1:]))
    assert torch.equal(later[0], later[1])


def test_saved_tensor_hooks_inside_a_summed_loss_void_the_proof(monkeypatch):
    """Their unpack runs in the backward, outside vmap, on the whole batch's tensors (the batch mean
    added to a saved tensor moved the clipped sum by 5.41 C with the probe skipped): the loss is
    evaluated with them, the probe runs and refuses the step."""
    calls = _probes(monkeypatch)

    def loss(out, t):
        with torch.autograd.graph.saved_tensors_hooks(lambda s: s, lambda s: s + 10 * s.mean(0) if
                                                      s.is_floating_point() and s.dim() and len(s) == 12 else s):
            return (3 * out.tanh()).pow(2).sum() + nn.functional.cross_entropy(out, t, reduction="sum")
    torch.manual_seed(0)
    e = _engine(nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 10)), loss_fn=loss)
    x = torch.randn(12, 12)
    x[0] *= 50
    with pytest.raises(ConfigError, match="lets examples see each other"):
        e.step(x, torch.randint(0, 10, (12,)), torch.arange(12))
    assert calls and e.steps_taken == 0


class _CentringWeight(nn.Parameter):
    """A weight whose ``__torch_function__`` centres ``F.linear``'s input over the batch."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            args = (args[0] - 3 * args[0].mean(0), args[1].as_subclass(torch.Tensor), *args[2:])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def test_a_parameter_that_is_a_tensor_subclass_voids_the_proof_and_the_probe_refuses_it(monkeypatch):
    """Its ``__torch_function__`` runs inside the layer, where no module input shows it: with the probe
    skipped it moved the clipped sum by 1.25 C (benchmarks/redteam/separable/rt_param_subclass.py)."""
    calls = _probes(monkeypatch)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Flatten(), nn.Linear(16, 10))
    m[1].weight = _CentringWeight(m[1].weight.detach().clone())
    assert "its weight is a tensor subclass" in separable.why_not(m)
    e = _engine(m)
    with pytest.raises(ConfigError, match="lets examples see each other"):
        e.step(torch.randn(12, 4, 4) * 3, torch.randint(0, 10, (12,)), torch.arange(12))
    assert calls and e.steps_taken == 0
