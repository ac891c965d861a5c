"""The fast path's layer rules behind their declared protocol (``clipbias.grads.layers``): every built-in rule
implements ``LayerRule``; a rule registered from a new module (docs/architecture.md's recipe, "Adding a layer
rule": batch normalisation in evaluation mode) is picked up by the engine, and its norms and clipped sums are
per-example autograd's (``torch.func``); a layer type without a rule is refused, or falls back to the rows
path, exactly as before it was registered and after it is removed; a rule whose layer acts on each example
alone joins the structural proof (``grads.separable``), its class's methods snapshotted when it registers."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError, UnsupportedModelError
from clipbias.grads import separable
from clipbias.grads.fast import BookKeeping, why_unsupported
from clipbias.grads.layers import RULES, ChannelRule, LayerRule, register
from clipbias.registry import Registry
from clipbias.step import clip_scale
from tests.test_architecture import run_recipe

CLIP = 0.3


@pytest.fixture
def batch_norm_rule():
    """The recipe's rule, registered as a module of ``clipbias.grads.layers`` (its relative imports resolve
    there), and removed after."""
    run_recipe("Adding a layer rule", "clipbias.grads.layers")
    try:
        yield RULES["batch-norm-eval"]
    finally:
        del RULES["batch-norm-eval"]


def _batch_norm_model() -> nn.Module:
    """Conv, BatchNorm2d, Linear over positions, BatchNorm1d on a sequence and on features, in float64, its
    running statistics those of a few batches (the layers in evaluation mode: constants)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten(2), nn.BatchNorm1d(3),
                      nn.Flatten(), nn.Linear(3 * 36, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(16, 1, 8, 8, dtype=torch.float64) * 2 + 1)
        for bn in (m[1], m[4], m[7]):
            bn.weight.normal_()
            bn.bias.normal_()
    return m.eval()


def _data(b: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (b,), generator=g)


def _own_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[b, d]``: each example's gradient by ``torch.func`` (``vmap(grad)``), in ``named_parameters`` order."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(p, xi, yi):
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    rows = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([rows[k].reshape(len(y), -1) for k in params], 1)


def _fast(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast path's (clipped sum, per-example norms) at clip ``CLIP``."""
    proc, _, _, norms = BookKeeping(model)(x, y, lambda n: clip_scale(n, CLIP), False)
    return proc, norms


def test_every_built_in_rule_implements_the_protocol_and_the_registry_is_one_registry():
    assert isinstance(RULES, Registry) and len(RULES) >= 8
    for rule in RULES.values():
        assert isinstance(rule, LayerRule), rule.name
    assert RULES.rule_for(nn.Linear(2, 2)) is RULES["linear"] and RULES.rule_for(nn.Conv2d(1, 1, 1)) is RULES["conv"]
    assert RULES.rule_for(nn.Tanh()) is None and RULES.separable_rule(nn.LayerNorm) is RULES["layer-norm"]
    with pytest.raises(ConfigError, match="needs a name not yet registered"):
        RULES.register(RULES["linear"])
    with pytest.raises(ConfigError, match="covers Linear already"):  # one rule per class

        class Other(ChannelRule):
            name, types = "other-linear", (nn.Linear,)
        register(Other())
    assert "other-linear" not in RULES


def test_a_registered_layer_rule_gives_per_example_autograds_norms(batch_norm_rule):
    """The recipe's BatchNorm rule: picked up by type (subclasses too), the model accepted, its norms and
    clipped sum per-example autograd's to 1e-10 in float64 (the probe checks the attribution as it runs:
    BatchNorm is not declared separable), and the engine takes the fast path."""
    model, (x, y) = _batch_norm_model(), _data()
    assert RULES.rule_for(model[1]) is batch_norm_rule and RULES.rule_for(model[4]) is batch_norm_rule
    assert why_unsupported(model) is None
    proc, norms = _fast(model, x, y)
    rows = _own_gradients(model, x, y)
    want = rows.norm(dim=1)
    torch.testing.assert_close(norms, want, rtol=1e-10, atol=0)
    torch.testing.assert_close(proc, (clip_scale(want, CLIP).view(-1, 1) * rows).sum(0), rtol=1e-10, atol=1e-12)
    eng = DPEngine(model, "dpsgd", n=48, batch_size=12, steps=1, noise_multiplier=1.0, grad_path="fast",
                   config=AlgoConfig(lr=0.1, clip=CLIP), noise_seed=0)
    assert eng.fast is not None
    xs, ys = _data(48)
    idx = eng.sampler.sample()
    eng.step(xs[idx], ys[idx], idx)


def test_a_batch_norm_on_the_batchs_statistics_is_refused_before_its_rule_runs(batch_norm_rule):
    """In training mode a BatchNorm normalises by the batch's statistics: ``check_model`` refuses the step
    before any rule runs, the recipe's rule registered or not."""
    model, (x, y) = _batch_norm_model(), _data()
    with pytest.raises(UnsupportedModelError, match=r"module '1' \(BatchNorm2d\) mixes examples"):
        _fast(model.train(), x, y)


def test_an_unregistered_layer_type_is_refused_and_falls_back_as_before():
    """Without the rule (before the recipe registers it and after it is removed: the lookup's cache is
    dropped), a BatchNorm with trainable parameters has no rule: the same refusal, ``grad_path='fast'``
    refused and ``'auto'`` on the rows path."""
    model = _batch_norm_model()
    before = why_unsupported(model)
    assert before == "module '1' (BatchNorm2d) has trainable parameters and no fast-path rule"
    assert RULES.rule_for(model[1]) is None
    run_recipe("Adding a layer rule", "clipbias.grads.layers")
    try:
        assert why_unsupported(model) is None and RULES.rule_for(model[1]) is RULES["batch-norm-eval"]
    finally:
        del RULES["batch-norm-eval"]
    assert RULES.rule_for(model[1]) is None and why_unsupported(model) == before
    with pytest.raises(ConfigError, match="no fast-path rule"):
        DPEngine(model, "dpsgd", n=48, batch_size=12, steps=1, noise_multiplier=1.0, grad_path="fast")
    eng = DPEngine(model, "dpsgd", n=48, batch_size=12, steps=1, noise_multiplier=1.0, grad_path="auto")
    assert eng.fast is None


class Scale(nn.Module):
    """A layer of the test's own: ``x * weight + bias`` per feature (the last dimension)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(n)), nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


class ScaleRule(ChannelRule):
    name = "test-scale"
    types = separable = (Scale,)  # acts on each example alone

    def normalised(self, m, a):
        return a, tuple(range(1, a.dim() - 1))  # the leading positions


@pytest.fixture
def scale_rule():
    rule = register(ScaleRule())
    try:
        yield rule
    finally:
        del RULES["test-scale"]


def _scale_model() -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Flatten(1, 2), nn.Linear(8, 4), Scale(4), nn.Tanh(), nn.Flatten(), nn.Linear(32, 3)).double()


def test_a_separable_rule_joins_the_structural_proof_and_its_class_is_snapshotted(scale_rule, monkeypatch):
    """A rule declaring its class ``separable``: a ``nn.Sequential`` of it is proven per-example (no probe), its
    norms are per-example autograd's; its class's ``forward`` replaced after registration voids the proof."""
    model, (x, y) = _scale_model(), _data()
    assert separable.why_not(model) is None
    probes = []
    monkeypatch.setattr(BookKeeping, "_check_examples", lambda self, *a: probes.append(1))
    proc, norms = _fast(model, x, y)
    assert probes == []  # proven: no probe
    rows = _own_gradients(model, x, y)
    torch.testing.assert_close(norms, rows.norm(dim=1), rtol=1e-10, atol=0)
    torch.testing.assert_close(proc, (clip_scale(rows.norm(dim=1), CLIP).view(-1, 1) * rows).sum(0),
                               rtol=1e-10, atol=1e-12)
    monkeypatch.setattr(Scale, "forward", lambda self, x: x * self.weight + self.bias)
    assert separable.why_not(model) == "Scale.forward was replaced after clipbias was imported"


def test_a_removed_rules_layer_is_refused_again():
    """A layer of the test's own: no rule (refused, not proven), a rule registered (accepted), removed
    (refused again, as before)."""
    model = _scale_model()
    before, proof = why_unsupported(model), separable.why_not(model)
    assert before == "module '2' (Scale) has trainable parameters and no fast-path rule"
    assert proof == "module '2' (Scale) is not a module whose rows are known to be per-example"
    register(ScaleRule())
    try:
        assert why_unsupported(model) is None and separable.why_not(model) is None
    finally:
        del RULES["test-scale"]
    assert why_unsupported(model) == before and separable.why_not(model) == proof
