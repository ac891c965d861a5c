"""The fast path (per-layer norms, book-keeping sums) against the rows path it replaces."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ClipbiasError, ConfigError, NonFiniteGradientError, PathRefusal


class Net(nn.Module):
    """Conv2d with stride/padding/dilation (ghost and direct norms), a bias-free conv, a Linear on a
    sequence ([b, L, k] input) and a plain Linear: every branch of the fast path."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, stride=2, padding=1)          # L = 16 positions, o k = 36: direct
        self.c2 = nn.Conv2d(4, 16, 2, dilation=2, bias=False)      # L = 4, o k = 256: ghost
        self.seq = nn.Linear(4, 5)                                  # L = 3, o k = 20: ghost
        self.out = nn.Linear(15, 3)                                 # L = 1

    def forward(self, x):
        h = torch.tanh(self.c2(torch.tanh(self.c1(x))))           # [b, 16, 2, 2]
        h = h.flatten(2)[:, :3, :]                                  # [b, 3, 4]: a sequence of 3
        return self.out(torch.tanh(self.seq(h)).flatten(1))


class Wide(nn.Module):
    """A conv whose per-example gradient is smaller than L^2: the direct branch."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(1, 2, 2)                                 # L = 49, o k = 8
        self.out = nn.Linear(2 * 49, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.c(x)).flatten(1))


class Normed(nn.Module):
    """GroupNorm after a conv and LayerNorm on a sequence: the affine rules."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(1, 4, 3, stride=2)
        self.gn = nn.GroupNorm(2, 4)
        self.ln = nn.LayerNorm(3)
        self.out = nn.Linear(36, 3)

    def forward(self, x):
        h = torch.tanh(self.gn(self.c(x)))                          # [b, 4, 3, 3]
        return self.out(self.ln(h.flatten(1, 2)).flatten(1))        # LayerNorm over [b, 12, 3]


class Tokens(nn.Module):
    """Token and position embeddings (repeated tokens, a padding index), Conv1d with the direct and
    the ghost branch, LayerNorm over a sequence: the sequence-model rules."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.pos = nn.Embedding(8, 4)
        self.c1 = nn.Conv1d(4, 5, 3, padding=1)                    # L = 8, o k = 60: direct
        self.c2 = nn.Conv1d(5, 6, 2, stride=2, bias=False)          # L = 4, o k = 60: ghost
        self.ln = nn.LayerNorm(6)
        self.out = nn.Linear(24, 3)

    def forward(self, x):
        idx = (x.flatten(1)[:, :8].abs() * 2).long().clamp(max=6)  # [b, 8]: repeats and zeros (padding)
        h = self.emb(idx) + self.pos(torch.arange(8, device=x.device).expand(len(x), 8))
        h = self.c2(torch.tanh(self.c1(h.transpose(1, 2))))          # [b, 6, 4]
        return self.out(self.ln(torch.tanh(h).transpose(1, 2)).flatten(1))


def _data(n=40):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 8, 8, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def _run(model_cls, algo, path, steps=3, loss_fn=None, **cfg):
    torch.manual_seed(1)
    m = model_cls()
    x, y = _data()
    eng = DPEngine(m, algo, n=40, batch_size=10.0, steps=steps, noise_multiplier=1.0 if algo in (
        "dpsgd", "dice", "normalized", "dice-auto") else None, accountant="rdp", grad_path=path,
        config=AlgoConfig(lr=0.2, clip=0.5, **cfg), noise_seed=3, max_physical_batch=7,
        **({"loss_fn": loss_fn} if loss_fn is not None else {}))
    for _ in range(steps):
        idx = eng.sampler.sample()
        eng.step(x[idx], y[idx], idx)
    return torch.cat([p.detach().flatten() for p in m.parameters()]), eng


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(params=["formed", "ghost", "mixed"])
def branch(request, monkeypatch):
    """Layers over several positions as the fast path treats them within its budget of formed rows
    (per-example gradients formed), past it (the ghost norm with its rounding bound, float64 sums),
    and both in one model: a 2000-byte budget puts Net's c2 (2048 bytes an example in float64) on
    the ghost norm and forms its later seq (160 bytes an example)."""
    import clipbias.grads.fast as fc
    if request.param != "formed":
        monkeypatch.setattr(fc, "FORMED_BYTES", -1 if request.param == "ghost" else 2000)
    return request.param


def test_the_formed_budget_sends_the_layers_past_it_to_the_ghost_norm(monkeypatch):
    """``ghost_plan``: in layer order, a layer whose formed rows would pass the budget takes the ghost
    norm and the budget stays for later layers; a layer with L^2 > o k is formed whatever its size
    (its ghost norm would cost more), and one-position layers form nothing."""
    import clipbias.grads.fast as fc
    big, small, long, one = nn.Linear(64, 64), nn.Linear(8, 8), nn.Linear(2, 2), nn.Linear(64, 64)
    acts = {big: torch.zeros(4, 8, 64), small: torch.zeros(4, 3, 8), long: torch.zeros(4, 9, 2),
            one: torch.zeros(4, 64)}
    outs = {big: torch.zeros(4, 8, 64), small: torch.zeros(4, 3, 8), long: torch.zeros(4, 9, 2),
            one: torch.zeros(4, 64)}
    layers = [long, big, small, one]  # formed bytes: long 64, big 65536, small 1024 (float32, b = 4)
    monkeypatch.setattr(fc, "FORMED_BYTES", 2000)
    assert fc.ghost_plan(layers, acts, outs) == {big}
    monkeypatch.setattr(fc, "FORMED_BYTES", 65536 + 64)
    assert fc.ghost_plan(layers, acts, outs) == {small}
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    assert fc.ghost_plan(layers, acts, [outs[m] for m in layers]) == {big, small}


@pytest.mark.parametrize("model_cls", [Net, Wide, Normed, Tokens])
@pytest.mark.parametrize("algo,cfg", [("dpsgd", {}), ("normalized", {}), ("dice", {"ef_clip": 0.01}),
                                      ("clip-sgd", {}), ("ef-sgd", {"ef_clip": 0.05})])
def test_fast_path_update_equals_the_rows_path(model_cls, algo, cfg, float64, branch):
    """In float64 the two paths agree to 1e-10 (float32 rounding alone reaches ~4e-5 after three
    non-private ef-sgd steps on the GroupNorm model, which is why the comparison is made here)."""
    rows, e_rows = _run(model_cls, algo, "rows", **cfg)
    fast, e_fast = _run(model_cls, algo, "fast", **cfg)
    assert e_fast.fast is not None and e_rows.fast is None and rows.dtype == torch.float64
    torch.testing.assert_close(fast, rows, rtol=1e-10, atol=1e-12)
    if e_rows.pipeline.error_feedback is not None:  # the hidden feedback buffer too
        torch.testing.assert_close(e_fast.pipeline.error_feedback.e, e_rows.pipeline.error_feedback.e,
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("algo", ["dpsgd", "dice"])
def test_fast_path_in_float32_is_within_1e5_after_one_step(algo, branch):
    rows, _ = _run(Net, algo, "rows", steps=1)
    fast, _ = _run(Net, algo, "fast", steps=1)
    torch.testing.assert_close(fast, rows, rtol=1e-4, atol=1e-4)  # float32, noise on its grid


def test_fast_path_refusals_and_auto_fallback():
    m = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Unflatten(1, (1, 8)), nn.ConvTranspose1d(1, 1, 3, padding=1),
                      nn.Flatten(), nn.Linear(8, 3))
    with pytest.raises(ConfigError, match="ConvTranspose1d.*no fast-path rule"):
        DPEngine(m, "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="fast")
    eng = DPEngine(m, "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="auto")
    assert eng.fast is None and "ConvTranspose1d" in eng.grad_path_note
    with pytest.raises(ConfigError, match="computes its own rows"):
        DPEngine(Wide(), "p-avg", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="fast")
    with pytest.raises(ConfigError, match="grad-bound"):
        DPEngine(Wide(), "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="fast",
                 config=AlgoConfig(grad_bound=5.0))
    with pytest.raises(ConfigError, match="rows, fast or auto"):
        DPEngine(Wide(), "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="ghost")


def test_fast_path_refuses_a_nan_gradient_before_any_change():
    torch.manual_seed(0)
    m = Wide()
    eng = DPEngine(m, "dice", n=40, batch_size=10, steps=2, noise_multiplier=1.0, grad_path="fast",
                   max_physical_batch=3)
    x, y = _data()
    before = [p.detach().clone() for p in m.parameters()]
    x[5, 0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"\[5\]"):
        eng.step(x[:8], y[:8], torch.arange(8))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())) and eng.steps_taken == 0


def test_out_of_memory_in_the_rows_path_says_what_to_do(monkeypatch):
    """A CPU allocation failure is not a shape error: the message names memory and the two fixes."""
    from clipbias.grads.rows import FuncGradients

    def fail(self, x, y, params=None):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
    monkeypatch.setattr(FuncGradients, "per_param", fail)  # both the rows and the per-parameter sums call it
    eng = DPEngine(Wide(), "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0)
    x, y = _data()
    with pytest.raises(ConfigError, match="out of memory.*`max_physical_batch`.*`grad_path='fast'`"):
        eng.step(x[:4], y[:4], torch.arange(4))


def test_fast_path_refuses_shared_weights_that_would_understate_the_norm():
    """A weight used twice has a per-example gradient equal to the sum of both uses: per-layer norms
    would understate it, and with it the sensitivity. Tied parameters are refused when the engine is
    built, a layer called twice at the first step, before any change."""
    lin = nn.Linear(8, 8)
    tied = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), lin, nn.Tanh(), lin, nn.Linear(8, 3))
    with pytest.raises(ConfigError, match="tied weights"):
        DPEngine(tied, "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="fast")

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mid, self.out = nn.Linear(64, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.out(self.mid(torch.tanh(self.mid(self.inp(x.flatten(1))))))

    m = Twice()
    eng = DPEngine(m, "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="fast")
    x, y = _data()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ConfigError, match="runs twice"):
        eng.step(x[:4], y[:4], torch.arange(4))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())) and eng.steps_taken == 0


def test_fast_path_refuses_a_parameter_used_outside_its_layer():
    """``F.linear(h, self.mid.weight)`` besides ``self.mid(...)``: the hooks see one use only. The
    per-step check (book-keeping sum == autograd's batch gradient) refuses it before any change."""
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mid, self.out = nn.Linear(64, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            h = torch.tanh(self.inp(x.flatten(1)))
            return self.out(self.mid(h) + nn.functional.linear(h, self.mid.weight))

    m = Reads()
    eng = DPEngine(m, "dice", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="fast")
    x, y = _data()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ConfigError, match="mid.weight. enters the forward pass 2 time"):
        eng.step(x[:4], y[:4], torch.arange(4))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())) and eng.steps_taken == 0


class _Folded(nn.Module):
    """Tokens folded into the batch dimension: the Linear sees b * L rows (red-team case 1)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x):
        b = x.shape[0]
        return self.lin(x.reshape(b * 4, 5)).reshape(b, 4, 3).mean(1)


class _SeqFirst(nn.Module):
    """Batch not in dim 0 at the layer, with as many positions as examples (red-team case 2)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3, bias=False)

    def forward(self, x):
        return self.lin(x.transpose(0, 1)).mean(0)


class _Cancelling(nn.Module):
    """A weight also read outside its layer, with gradients that cancel over the batch (case 5)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(20, 3)

    def forward(self, x):
        x = x.reshape(len(x), -1)
        w = self.lin.weight
        return self.lin(x) + 10 * x[:, :1] * (w - w.detach()).sum() * torch.tensor([1.0, 0.0, 0.0])


@pytest.mark.parametrize("model,x,match", [
    (_Folded, torch.randn(4, 4, 5), "first dimension of 16"),
    (_SeqFirst, torch.randn(4, 4, 5) * 20, "lets examples see each other"),
    (_Cancelling, torch.cat([torch.ones(1, 20), -torch.ones(1, 20)]), "lin.weight. enters the forward pass 2"),
])
def test_red_team_cases_are_refused_before_any_change(model, x, match):
    """Found by a red-team session: per-layer norms that are not per-example norms (rows that are not
    examples, a sequence-first layout, an outside read whose batch sum cancels). The dimension check,
    the secret random-weighted sum check and the one-example attribution check refuse them."""
    torch.manual_seed(0)
    m = model()
    eng = DPEngine(m, "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="fast")
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ConfigError, match=match):
        eng.step(x, torch.randint(0, 3, (len(x),)), torch.arange(len(x)))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())) and eng.steps_taken == 0


def test_embedding_rule_counts_a_repeated_token_once_per_example():
    """Example i's embedding gradient row for a token it holds twice is the sum of both output
    gradients: its squared norm is ||g1 + g2||^2, not ||g1||^2 + ||g2||^2 (the sum would understate
    it when they align); the padding row gets none."""
    from clipbias.grads.layers.embedding import Embed
    m = nn.Embedding(5, 2, padding_idx=0)
    idx = torch.tensor([[3, 3, 1], [0, 2, 4]])
    g = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]], [[9.0, 9.0], [0.0, 1.0], [3.0, 0.0]]])
    r = Embed(m, idx, g)
    torch.testing.assert_close(r.sq, torch.tensor([4.0 + 4.0, 1.0 + 9.0], dtype=torch.float64), rtol=1e-4, atol=0)
    assert bool((r.sq >= torch.tensor([8.0, 10.0], dtype=torch.float64)).all())  # an upper bound
    (w,) = r.sums(torch.tensor([[1.0, 10.0]]))
    want = torch.zeros(5, 2)
    want[3], want[1], want[2], want[4] = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0]), \
        torch.tensor([0.0, 10.0]), torch.tensor([30.0, 0.0])
    torch.testing.assert_close(w.view(5, 2), want)


class _Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) + nn.functional.linear(x, self.weight)


@pytest.mark.parametrize("layer,why", [(nn.Embedding(5, 2, max_norm=1.0), "max_norm"),
                                       (_Doubled(2, 2), "overrides Linear.forward"),
                                       (torch.nn.utils.weight_norm(nn.Linear(2, 2)), "besides weight and bias"),
                                       (torch.nn.utils.parametrizations.orthogonal(nn.Linear(2, 2)), "no fast-path rule"),
                                       (nn.Embedding(5, 2, scale_grad_by_freq=True), "scale_grad_by_freq"),
                                       (nn.ConvTranspose2d(2, 2, 1), "no fast-path rule")])
def test_fast_path_names_layers_it_cannot_handle(layer, why):
    from clipbias.grads.fast import why_unsupported
    assert why in why_unsupported(nn.Sequential(layer))


def test_dropout_model_is_checked_alone_under_its_keyed_masks(monkeypatch):
    """Under dropout, in the engine's step, the probed example is run alone (a batch of one) under the
    keyed masks it draws in the batch, and its attribution equals that gradient: no counterfactual batch
    of copies (a whole second forward and backward). Where the two differ in float32 (here: forced), the
    float64 recheck of both decides: no false refusal. torch's generator is not drawn from. (The graph proof,
    which would skip the probe of the second step, is off: this tests the probe.)"""
    import clipbias.grads.fast as fc
    from clipbias.grads import proof
    monkeypatch.setattr(proof, "ENABLED", False)
    calls = []
    alone, copies, wide = fc.BookKeeping._alone, fc.BookKeeping._counterfactual, fc.BookKeeping._alone_in_float64
    monkeypatch.setattr(fc.BookKeeping, "_alone", lambda *a, **k: calls.append("alone") or alone(*a, **k))
    monkeypatch.setattr(fc.BookKeeping, "_counterfactual", lambda *a: calls.append("copies") or copies(*a))
    monkeypatch.setattr(fc.BookKeeping, "_alone_in_float64", lambda *a: calls.append("float64") or wide(*a))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Dropout(0.5), nn.Linear(32, 3))
    eng = DPEngine(m, "dpsgd", n=40, batch_size=10, steps=2, noise_multiplier=1.0, grad_path="fast")
    x, y = _data()
    torch.manual_seed(5)
    eng.step(x[:8], y[:8], torch.arange(8))
    after = torch.rand(1)
    torch.manual_seed(5)
    assert eng.steps_taken == 1 and calls == ["alone"] and torch.equal(after, torch.rand(1))
    monkeypatch.setattr(fc.BookKeeping, "_alone", lambda *a, **k: calls.append("alone") or (
        alone(*a, **k) if "call" in k else [2 * g for g in alone(*a, **k)]))  # float32 only: forced apart
    eng.step(x[8:16], y[8:16], torch.arange(8, 16))
    assert eng.steps_taken == 2 and calls == ["alone", "alone", "float64", "alone"]


class _RowsByBatch(nn.Module):
    """Red team: every row gets ``(-1)^b v`` (b the batch's size) or ``(r - (b - 1) / 2) v`` (r its position), one
    example's presence moving every other row. A batch of copies keeps b and the positions, so the
    counterfactual check let it through (7.7 C, certified); alone, the row differs."""

    def __init__(self, by: str) -> None:
        super().__init__()
        self.by, self.lin, self.drop = by, nn.Linear(64, 3), nn.Dropout(0.3)
        self.register_buffer("v", torch.tensor([5.0, 0.0, -5.0]))  # not a constant shift of the logits

    def forward(self, x):
        h = self.lin(self.drop(x.flatten(1)))
        b = h.shape[0]
        shift = (-1.0) ** b if self.by == "size" else (torch.arange(b, dtype=h.dtype) - (b - 1) / 2).unsqueeze(1)
        return h + shift * self.v


@pytest.mark.parametrize("by", ["size", "position"])
def test_dropout_rows_that_depend_on_the_batch_size_or_position_are_refused(by):
    torch.manual_seed(0)
    eng = DPEngine(_RowsByBatch(by), "dpsgd", n=40, batch_size=10, steps=2, noise_multiplier=1.0, grad_path="fast")
    x, y = _data()
    with pytest.raises(PathRefusal, match="run alone under its own dropout masks"):
        eng.step(x[:8], y[:8], torch.arange(8))
    assert eng.steps_taken == 0


def test_a_dropout_models_gradient_alone_is_its_row_in_the_batch():
    """What ``_alone`` relies on: an example's keyed dropout masks are the same in a batch of one as in
    its row of the batch, so its gradient alone equals its attributed row exactly (float64)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Dropout(0.5), nn.Linear(32, 3)).double()
    from clipbias.grads.fast import BookKeeping
    from clipbias.randomness import SecretKey, forward
    bk = BookKeeping(m)
    x, y = _data()
    x = x[:8].double()
    with forward.keyed(SecretKey.generate(), 3):
        with forward.examples(torch.arange(10, 18)):
            _, acts, grads = bk._backward(x, y[:8])
            rows = [bk._ordered([r.one(i) for r in bk._rules_at(acts, grads)]) for i in range(8)]
            for i in (0, 5):
                got = bk._alone(x, y[:8], i)
                assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(got, rows[i]))
            assert not all(torch.allclose(a, b) for a, b in zip(rows[0], rows[5]))


@pytest.mark.parametrize("model_cls", [Net, Tokens])
@pytest.mark.parametrize("algo,cfg", [("dpsgd", {}), ("dice", {"ef_clip": 0.01}), ("normalized", {})])
def test_rows_summed_per_parameter_equal_the_pipeline_on_rows(model_cls, algo, cfg, float64):
    """``grads.ParamSums`` (the default rows path of norm-scaling algorithms) against the rows
    concatenated and run through the pipeline (taken when a gradient backend is given)."""
    from clipbias.grads.rows import FuncGradients, ParamSums
    sums, e_sums = _run(model_cls, algo, "rows", **cfg)
    torch.manual_seed(1)
    m = model_cls()
    x, y = _data()
    eng = DPEngine(m, algo, n=40, batch_size=10.0, steps=3, noise_multiplier=None if algo == "clip-sgd" else 1.0,
                   accountant="rdp", grads=FuncGradients(m), config=AlgoConfig(lr=0.2, clip=0.5, **cfg),
                   noise_seed=3, max_physical_batch=7)
    for _ in range(3):
        idx = eng.sampler.sample()
        eng.step(x[idx], y[idx], idx)
    assert isinstance(e_sums._aggregate, ParamSums) and eng._aggregate is None
    torch.testing.assert_close(sums, torch.cat([p.detach().flatten() for p in m.parameters()]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("algo,cfg", [("dpsgd", {}), ("dice", {"ef_clip": 0.01})])
def test_gpt_language_model_fast_path_equals_the_rows_path(algo, cfg, float64, branch):
    """The GPT-2-style LM (embeddings, fused q/k/v, causal attention, LayerNorm, an untied head) with
    the per-sequence token loss and padding: the fast path's update equals the rows path's."""
    from clipbias.models.gpt import GPT, lm_loss
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (30, 7), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[::3, -2:] = -100  # padded ends: no loss there

    def run(path):
        torch.manual_seed(1)
        m = GPT(vocab=11, context=6, width=8, layers=2, heads=2)
        eng = DPEngine(m, algo, n=30, batch_size=8.0, steps=2, noise_multiplier=1.0, accountant="rdp",
                       loss_fn=lm_loss, grad_path=path, config=AlgoConfig(lr=0.5, clip=0.1, **cfg), noise_seed=3)
        for _ in range(2):
            idx = eng.sampler.sample()
            eng.step(x[idx], y[idx], idx)
        return torch.cat([p.detach().flatten() for p in m.parameters()]), eng

    rows, e_rows = run("rows")
    fast, e_fast = run("fast")
    assert e_fast.fast is not None and e_rows.fast is None
    torch.testing.assert_close(fast, rows, rtol=1e-10, atol=1e-12)



class _Mixup(nn.Module):
    """Forward-only mixing (red-team finding 1): no gradient crosses examples, but every example's
    layer inputs hold another example's data, so removing one moves two clipped vectors."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(64, 3), nn.Dropout(dropout)

    def forward(self, x):
        x = x.flatten(1)
        return self.lin(self.drop(0.5 * x + 0.5 * x.flip(0)))


class _RunningMean(nn.Module):
    """A buffer updated from the batch (finding 3): a noiseless statistic of the private data."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 3)
        self.register_buffer("mu", torch.zeros(64))

    def forward(self, x):
        x = x.flatten(1)
        with torch.no_grad():
            self.mu.mul_(0.9).add_(0.1 * x.mean(0))
        return self.lin(x - self.mu)


def _patched_forward():
    m = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    m[1].forward = lambda x: nn.functional.linear(x, m[1].weight * 2, m[1].bias)
    return m


def _hooked():
    m = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    m[1].register_forward_hook(lambda mod, inp, out: out * 2)
    return m


def _inplace():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))


@pytest.mark.parametrize("make,match", [
    (_Mixup, "each run alone.*lets examples see each other"),
    (lambda: _Mixup(dropout=0.3), "run alone under its own dropout masks.*lets examples see each other"),
    (_RunningMean, r"updates buffer\(s\) \['mu'\]"),
    (lambda: nn.Sequential(nn.Flatten(), nn.BatchNorm1d(64, affine=False, track_running_stats=False).eval(),
                           nn.Linear(64, 3)), "mixes examples"),
    (_patched_forward, "overrides Linear.forward"),
    (_hooked, "forward hook"),
    (_inplace, "modified in place"),
])
def test_red_team_round_two_is_refused_before_any_change(make, match):
    """A second red-team session (forward-only mixing, with and without dropout; a running buffer;
    BatchNorm without running statistics in eval mode; an instance-level forward; a user forward
    hook; an in-place op on a layer output): refused with the reason, weights and buffers unchanged."""
    torch.manual_seed(0)
    m = make()
    x, y = _data()
    before = [t.detach().clone() for t in list(m.parameters()) + list(m.buffers())]
    with pytest.raises((ConfigError, ClipbiasError), match=match):
        eng = DPEngine(m, "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="fast")
        eng.step(x[:8], y[:8], torch.arange(8))
    assert all(torch.equal(a, b) for a, b in zip(before, list(m.parameters()) + list(m.buffers())))


class _SumPositions(nn.Module):
    def forward(self, h):
        return h.sum(1)


def _positions_model():
    """(model, its BookKeeping): the first Linear runs over the input's positions, then they are summed."""
    from clipbias.grads.fast import BookKeeping
    m = nn.Sequential(nn.Linear(64, 8), _SumPositions(), nn.Linear(8, 3))
    return m, BookKeeping(m)


def test_an_input_whose_positions_cancel_cannot_beat_the_clip(monkeypatch):
    """Red team: positions alternating in sign with a small residual make the float32 ghost norm far
    smaller than the true one (the unbounded ghost norm let a clipped contribution reach 2.42 C).
    With the rounding bound every contribution, measured in float64, stays within C."""
    import clipbias.grads.fast as fc
    from clipbias.step import clip_scale
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    torch.manual_seed(0)
    _, bk = _positions_model()
    C, a, sign = 0.1, torch.randn(64), torch.tensor([1.0, -1.0, 1.0, -1.0]).unsqueeze(1)
    worst = 0.0
    for residual in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 0.0):
        for _ in range(10):
            x = (sign * a * 1e3 + 1e3 * residual * torch.randn(4, 64)).unsqueeze(0)
            proc = bk(x, torch.randint(0, 3, (1,)), lambda n: clip_scale(n, C), False)[0]
            worst = max(worst, float(proc.double().norm()) / C)
    assert worst <= 1.0 + 1e-6


def test_a_large_cancelling_example_cannot_round_the_others_away(monkeypatch):
    """Red team: an example whose two positions cancel exactly (gradient 0 in the first layer) but
    are huge entered the batch's float32 sum and rounded the others' terms away (8.15 C at 1e8).
    Its norm bound now scales it down with its terms, and the sum is float64: adding it moves the
    released sum by at most C."""
    import clipbias.grads.fast as fc
    from clipbias.step import clip_scale
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    torch.manual_seed(0)
    _, bk = _positions_model()
    C, x, y = 0.1, torch.randn(8, 2, 64), torch.randint(0, 3, (8,))
    without = bk(x, y, lambda n: clip_scale(n, C), False)[0].double()
    for magnitude in (1e2, 1e4, 1e6, 1e8, 1e12):
        a = magnitude * torch.randn(64)
        proc = bk(torch.cat([x, torch.stack([a, -a]).unsqueeze(0)]), torch.cat([y, torch.tensor([0])]),
                  lambda n: clip_scale(n, C), False)[0].double()
        assert float((proc - without).norm()) <= C * (1 + 1e-4), magnitude


def test_the_ghost_norm_bound_holds_and_is_tight_on_ordinary_data():
    """``ghost_norm_bound`` is at least the float64 norm of the formed per-example gradient, and on
    random (non-cancelling) data within 1e-3 of it in float32 (the bound grows with (k + o) u L)."""
    from clipbias.grads.layers.linear import ghost_norm_bound
    torch.manual_seed(0)
    a, g = torch.randn(16, 12, 40), torch.randn(16, 12, 30)
    exact = torch.bmm(g.double().transpose(1, 2), a.double()).square().sum((1, 2))
    bound = ghost_norm_bound(a, g)
    assert bool((bound >= exact).all()) and float((bound / exact - 1).max()) < 1e-3  # (k + o) u L: 1.1e-4
    sign = torch.tensor([1.0, -1.0]).repeat(6).view(1, 12, 1)
    a = a[:1] * 0 + torch.randn(1, 1, 40) * sign + 1e-6 * torch.randn(1, 12, 40)  # cancelling positions
    g = torch.randn(1, 1, 30).expand(1, 12, 30).contiguous()
    exact = torch.bmm(g.double().transpose(1, 2), a.double()).square().sum((1, 2))
    assert float(ghost_norm_bound(a, g)[0]) >= float(exact[0])


def test_a_fast_path_run_is_certified_like_the_rows_path():
    """With the ghost norm bounded and its sums in float64 the fast path clips what it sums, as the
    rows path does: both certified, the same accounting."""
    from clipbias.config import AlgoConfig
    from clipbias.engine import DPEngine
    torch.manual_seed(0)
    reports = {}
    for path in ("fast", "rows"):
        model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
        engine = DPEngine(model, "dpsgd", n=64, batch_size=16, epochs=1, noise_multiplier=1.0, delta=1e-5,
                          config=AlgoConfig(lr=0.1, clip=1.0), grad_path=path)
        engine.train_epoch(torch.randn(64, 1, 8, 8), torch.randint(0, 3, (64,)))
        reports[path] = engine.privacy()
    assert reports["fast"].caveats == reports["rows"].caveats == () and reports["fast"].certified
    assert reports["fast"].epsilon == reports["rows"].epsilon


def test_the_ghost_sums_in_blocks_equal_one_float64_product(monkeypatch):
    """A ghost layer's float64 sums, a block of output rows at a time (WIDE_BLOCK_BYTES), equal the
    whole product ``sum_i s_i g_i^T a_i`` computed in float64 at once."""
    from clipbias.grads.layers import linear
    torch.manual_seed(0)
    a, g, s = torch.randn(5, 4, 7), torch.randn(5, 4, 300), torch.rand(5, dtype=torch.float64)
    rule = linear.Matrix(nn.Linear(7, 300), a, g, ghost=True)
    assert rule.ghost and rule.pe is None
    want = torch.einsum("blo,blk->ok", g.double() * s.view(-1, 1, 1), a.double()).reshape(-1)
    for block in (8 * 20, 8 * 20 * 7, 2**26):  # one output row, seven, all
        monkeypatch.setattr(linear, "WIDE_BLOCK_BYTES", block)
        torch.testing.assert_close(rule._wide_sum(s), want.float())  # float64, rounded once to float32


def test_tiny_inputs_times_huge_output_gradients_cannot_hide_a_norm():
    """Red team: a plain Linear's norm ||a||^2 ||g||^2 in float32 underflowed to 0 for |a_j| <= 2^-75
    while g a^T (|g_j| ~ 1e18) did not: 2.98 C released at C = 0.01. In float64 it holds; float16
    activations, whose squares underflow in float16 below 2^-12, are widened to float32 first."""
    from clipbias.grads.fast import BookKeeping
    from clipbias.step import clip_scale
    m = nn.Linear(4096, 256, bias=False)
    bk = BookKeeping(m, lambda out, y: (out * y).sum(1))
    x, y, C = torch.full((1, 4096), 2.0 ** -75), torch.full((1, 256), 1.1e18), 0.01
    proc, _, _, norms = bk(x, y, lambda n: clip_scale(n, C), False)
    assert float(norms[0]) > 0.029 and float(proc.double().norm()) <= C * (1 + 1e-6)  # true norm 0.0298
    half = nn.Linear(8, 4, bias=False).half()
    x, y = torch.full((2, 8), 2.0 ** -14).half(), torch.full((2, 4), 2.0 ** -10).half()  # squares: 2^-28, 2^-20
    proc, _, _, norms = BookKeeping(half, lambda out, y: (out * y).sum(1))(x, y, lambda n: clip_scale(n, 1e-9), False)
    true = 2.0 ** -14 * 8 ** 0.5 * 2.0 ** -10 * 2  # ||x_i|| ||y_i||
    assert bool((norms.double() >= true * (1 - 1e-6)).all()) and float(norms.max()) < true * (1 + 1e-4)
    assert proc.dtype == torch.float32 and float(proc.double().norm()) <= 2e-9 * (1 + 1e-6)


def test_the_ghost_norm_bound_holds_under_reduced_matmul_precision():
    """With ``torch.set_float32_matmul_precision("medium")`` (bfloat16 passes) a Gram of 512 features
    would have no useful bound; the Grams run at float32's own precision inside and the setting is
    restored after. bfloat16 activations widen to float32 first."""
    from clipbias.grads.layers.linear import ghost_norm_bound
    torch.manual_seed(0)
    a, g = torch.randn(4, 6, 512), torch.randn(4, 6, 300)
    exact = torch.bmm(g.double().transpose(1, 2), a.double()).square().sum((1, 2))
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        bound = ghost_norm_bound(a, g)
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(old)
    assert bool((bound >= exact).all()) and float((bound / exact - 1).max()) < 1e-3
    ab, gb = a.bfloat16(), g.bfloat16()
    exact = torch.bmm(gb.double().transpose(1, 2), ab.double()).square().sum((1, 2))
    assert bool((ghost_norm_bound(ab, gb) >= exact).all())


def test_a_probe_whose_own_gradient_is_infinite_is_not_a_match():
    """A model that mixes examples (the batch mean added to a layer's input) scaled by b / (b - 1),
    infinite for the probe's batch of one: ``||got - want|| <= 1e-4 ||want||`` was inf <= inf, true,
    and the step was accepted. Non-finite comparisons are mismatches now: refused."""
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3, bias=False)

        def forward(self, x):
            b = x.shape[0]
            return self.lin(x + 2.0 * x.mean(0, keepdim=True)) * (torch.tensor(float(b)) / (b - 1.0))

    torch.manual_seed(0)
    eng = DPEngine(Mixer(), "dpsgd", n=40, batch_size=8.0, steps=1, noise_multiplier=1.0, accountant="rdp",
                   grad_path="fast", loss_fn=lambda out, y: (out ** 2).sum(1), config=AlgoConfig(lr=0.1, clip=0.5))
    with pytest.raises(ConfigError, match="differs from its own gradient"):
        eng.step(torch.rand(8, 6) + 0.5, torch.zeros(8, dtype=torch.long), torch.arange(8))


def test_row_norms_are_upper_bounds_on_long_rows():
    """torch's float32 vector_norm underestimates long rows on the CPU (-2.6e-5 relative at 10^6
    entries): ``row_norms`` never does, and is above by at most ~1.6e-5; a clipped contribution of
    the rows path is then at most C (it was 1.0000352 C for a Linear(256, 512) example)."""
    from clipbias.grads.precision import row_norms
    from clipbias.grads.rows import FuncGradients, ParamSums
    from clipbias.step import clip_rows, clip_scale
    g = torch.Generator().manual_seed(0)
    for d in (1, 255, 256, 257, 4097, 1_000_003):
        rows = torch.randn(3, d, generator=g).abs() * torch.rand(3, d, generator=g)
        true = torch.linalg.vector_norm(rows.double(), dim=1)
        got = row_norms(rows)
        assert bool((got >= true).all()) and float((got / true - 1).max()) < 1.6e-5, d
        assert float(torch.linalg.vector_norm(clip_rows(rows, 0.5).double(), dim=1).max()) <= 0.5
    assert float(row_norms(torch.zeros(2, 7)).max()) < 1e-18 and row_norms(torch.zeros(0, 5)).shape == (0,)
    torch.manual_seed(0)
    model = nn.Linear(256, 512)
    got, _, _, _ = ParamSums(FuncGradients(model))(torch.randn(1, 256), torch.tensor([3]),
                                                    lambda n: clip_scale(n, 0.5), False)
    assert float(got.double().norm()) <= 0.5


def _float32_settings() -> tuple:
    """What decides float32 products and convolutions: torch >= 2.9's per-backend settings and the
    legacy ones (None where torch refuses to read them)."""
    from clipbias.grads.precision import _legacy, _precision_leaves
    return tuple(x.fp32_precision for x in _precision_leaves()) + (_legacy(),)


def _full(settings: tuple) -> bool:
    """No reduced-precision setting left: per-backend leaves "ieee" or "none" (inherit, not reduced
    here), and the legacy ones, where readable, at "highest" / cuDNN TF32 off."""
    *leaves, legacy = settings
    return all(v in ("ieee", "none") for v in leaves) and legacy in (None, ("highest", False))


@pytest.fixture
def reduced_precision():
    """TF32 everywhere and bfloat16 passes on the CPU, as a user may set them; restored after."""
    old = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = True
    yield _float32_settings()
    torch.set_float32_matmul_precision(old[0])
    torch.backends.cudnn.allow_tf32 = old[1]


def test_full_float32_restores_the_settings_after_an_error_and_when_nested(reduced_precision):
    from clipbias.grads.precision import full_float32
    assert not _full(reduced_precision)
    with pytest.raises(ZeroDivisionError):
        with full_float32():
            with full_float32():
                assert _full(_float32_settings())
            assert _full(_float32_settings())
            1 / 0
    assert _float32_settings() == reduced_precision
    assert torch.get_float32_matmul_precision() == "medium"  # the legacy getter still answers


def test_full_float32_keeps_the_legacy_flags_readable_inside():
    """Code inside the fast path's step (a model using ``torch.backends.cudnn.flags``, which reads
    cuDNN's legacy allow_tf32; torch.compile's convolution lowering does too) must still run: on
    torch >= 2.9 per-backend "ieee" settings made that read raise. And with per-backend settings
    that make the legacy flags unreadable to begin with, the step neither reads them nor fails."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.out = nn.Conv2d(1, 2, 3), nn.Linear(2 * 36, 3)

        def forward(self, x):
            with torch.backends.cudnn.flags(enabled=True, deterministic=True):
                h = torch.tanh(self.c(x))
            return self.out(h.flatten(1))

    def step(model):
        torch.manual_seed(0)
        eng = DPEngine(model, "dpsgd", n=8, batch_size=4.0, steps=1, noise_multiplier=1.0, accountant="rdp",
                       config=AlgoConfig(lr=0.1, clip=1.0), grad_path="fast")
        before = _float32_settings()
        eng.step(torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,)), torch.arange(4))
        assert _float32_settings() == before

    step(M())
    from clipbias.grads.precision import _precision_leaves
    if not _precision_leaves():
        return  # torch < 2.9: no per-backend settings
    conv = torch.backends.cudnn.conv.fp32_precision
    try:  # conv and RNN set apart: the legacy cuDNN flag is unreadable (torch's choice)
        torch.backends.cudnn.conv.fp32_precision = "ieee" if torch.backends.cudnn.rnn.fp32_precision != "ieee" else "tf32"
        step(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 36, 3)))
    finally:
        torch.backends.cudnn.conv.fp32_precision = conv


def test_the_fast_path_runs_at_full_float32_and_restores_the_settings(reduced_precision):
    """TF32 (matmul precision "high", cuDNN's TF32 convolutions, on by default) or bfloat16 passes
    would round rows before the clip factors meet them and make the probe's two float32 gradients
    differ by ~1e-3 (a float64 recheck on every GPU step): inside the fast path's forward, backward,
    probes and sums all are at float32's own precision; the user's settings come back after the step."""
    seen = []

    class Spy(nn.Module):
        def forward(self, h):
            seen.append(_float32_settings())
            return torch.tanh(h)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), Spy(), nn.Linear(5, 3))
    eng = DPEngine(model, "dpsgd", n=40, batch_size=8.0, steps=2, noise_multiplier=1.0, accountant="rdp",
                   grad_path="fast", config=AlgoConfig(lr=0.1, clip=0.5))
    eng.step(torch.randn(8, 6), torch.randint(0, 3, (8,)), torch.arange(8))
    assert len(seen) >= 2 and all(_full(v) for v in seen)  # the batch and the probes
    assert _float32_settings() == reduced_precision


@pytest.mark.parametrize("layer, shape", [
    (nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)), (6, 3, 9, 8)),
    (nn.Conv2d(1, 16, 8, stride=2, padding=3), (4, 1, 28, 28)),   # the Tramer & Boneh cnn's first layer
    (nn.Conv1d(4, 6, 3, stride=3, padding=2, dilation=2), (5, 4, 17)),
])
def test_every_conv_kernel_gives_the_per_example_weight_gradients(layer, shape):
    """Each of the three kernels the fast path chooses between equals per-example gradients taken
    one example at a time in float64 (so the choice by speed cannot change what is clipped)."""
    from clipbias.grads.conv_rows import KERNELS
    layer = layer.double()
    a = torch.randn(*shape, dtype=torch.float64)
    out = layer(a)
    g = torch.randn_like(out)
    want = torch.stack([torch.autograd.grad((layer(a[i:i + 1]) * g[i:i + 1]).sum(), layer.weight)[0].reshape(
        layer.out_channels, -1) for i in range(shape[0])])
    for name, kernel in KERNELS.items():
        got = kernel(layer, a, g)
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), name


def test_a_conv_kernel_that_disagrees_is_never_chosen(monkeypatch):
    """The kernel is chosen by speed only among those that agree with im2col's result: a backend
    returning something else (here: a faster wrong one) is skipped."""
    from clipbias.grads import conv_rows
    wrong = lambda m, a, g: conv_rows._unfold(m, a, g) * 1.001  # noqa: E731
    monkeypatch.setattr(conv_rows, "KERNELS", {"unfold": conv_rows._unfold, "wrong": wrong})
    monkeypatch.setattr(conv_rows, "_CHOICE", {})
    monkeypatch.setattr(conv_rows, "_time", lambda f, m, a, g: 1.0 if f is conv_rows._unfold else 0.0)
    layer = nn.Conv2d(2, 3, 3)
    a = torch.randn(4, 2, 7, 7)
    assert conv_rows._choose(layer, a, torch.randn(4, 3, 5, 5)) == "unfold"
    right = lambda m, a, g: conv_rows._unfold(m, a, g).clone()  # noqa: E731
    monkeypatch.setattr(conv_rows, "KERNELS", {"unfold": conv_rows._unfold, "right": right})
    assert conv_rows._choose(layer, a, torch.randn(4, 3, 5, 5)) == "right"


def test_the_conv_kernel_is_timed_round_by_round_and_per_layout(monkeypatch):
    """Each candidate is timed ``CHOICE_ROUNDS`` times, one round of every kernel after another, and
    the fastest run counts: a kernel slowed in most rounds (a neighbour's load) but fast in one is
    still chosen over one that is steadily slower. The choice is kept per memory layout."""
    from clipbias.grads import conv_rows
    right = lambda m, a, g: conv_rows._unfold(m, a, g).clone()  # noqa: E731
    monkeypatch.setattr(conv_rows, "KERNELS", {"unfold": conv_rows._unfold, "right": right})
    monkeypatch.setattr(conv_rows, "_CHOICE", {})
    calls = []

    def fake_time(f, m, a, g):
        calls.append("unfold" if f is conv_rows._unfold else "right")
        rounds_of_right = calls.count("right")
        return 2.0 if f is conv_rows._unfold else (1.0 if rounds_of_right == conv_rows.CHOICE_ROUNDS else 5.0)
    monkeypatch.setattr(conv_rows, "_time", fake_time)
    layer = nn.Conv2d(2, 3, 3)
    a, g = torch.randn(4, 2, 7, 7), torch.randn(4, 3, 5, 5)
    assert conv_rows._choose(layer, a, g) == "right"
    assert calls == ["unfold", "right"] * conv_rows.CHOICE_ROUNDS  # interleaved
    cl = torch.channels_last
    assert conv_rows._key(layer, a, g) != conv_rows._key(layer, a.contiguous(memory_format=cl), g.contiguous(memory_format=cl))
    assert conv_rows._layout_of(g.contiguous(memory_format=cl), torch.randn(4, 3, 5, 5)).is_contiguous(memory_format=cl)


def test_a_float32_mismatch_without_mixing_is_decided_in_float64(monkeypatch):
    """Two float32 computations of one ill-conditioned example's gradient (in the batch, alone) can
    differ by 1e-3 (resnet20-gn on Fashion-MNIST: the probe refused honest runs). A float32 mismatch
    is decided in float64: here every float32 "alone" gradient is off by 1e-3 and the run goes on,
    its update unchanged."""
    import clipbias.grads.fast as fc
    from clipbias.grads import proof
    monkeypatch.setattr(proof, "ENABLED", False)  # Normed is proven per-example by its graph: the probe forced on
    want, _ = _run(Normed, "dpsgd", "fast", steps=2)
    own, rechecks = fc.BookKeeping._own, []

    def noisy(self, x, y, probes, params, w, call=None):
        got = own(self, x, y, probes, params, w, call)
        return got if params[0].dtype == torch.float64 else [g * (1 + 1e-3) for g in got]

    def counted(self, x, y, probes, w, attributed32):
        rechecks.append(probes)
        return agree(self, x, y, probes, w, attributed32)
    agree = fc.BookKeeping._agree_in_float64
    monkeypatch.setattr(fc.BookKeeping, "_own", noisy)
    monkeypatch.setattr(fc.BookKeeping, "_agree_in_float64", counted)
    got, _ = _run(Normed, "dpsgd", "fast", steps=2)
    assert len(rechecks) == 2 * 2 and all(1 <= len(p) <= fc.PROBES for p in rechecks)  # 2 steps x 2 micro-batches
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class _SlightMix(nn.Module):
    """Each example's output moved by 1e-3 of the batch mean: a mixing after the layer, invisible
    to the graph check, small enough to pass for rounding."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 3)

    def forward(self, x):
        h = self.lin(x.flatten(1))
        return h + 1e-3 * h.mean(0, keepdim=True)


def test_a_slight_mixing_is_refused_in_float64_too():
    torch.manual_seed(0)
    m = _SlightMix()
    eng = DPEngine(m, "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0, grad_path="fast")
    x, y = _data(10)
    with pytest.raises(ConfigError, match="lets examples see each other"):
        eng.step(x, y, torch.arange(10))
    assert eng.steps_taken == 0


def test_the_conv_kernel_is_chosen_without_the_private_batch(monkeypatch):
    """The choice (and with it the rounding of the result) is made on public stand-ins at the batch
    size rounded up to a power of two: the batch itself never reaches the timed kernels, and Poisson
    batches of 200-256 examples share one choice."""
    from clipbias.grads import conv_rows
    seen = []

    def spy(m, a, g):
        seen.append(a)
        return conv_rows._unfold(m, a, g)
    monkeypatch.setattr(conv_rows, "KERNELS", {"unfold": conv_rows._unfold, "spy": spy})
    monkeypatch.setattr(conv_rows, "_CHOICE", {})
    layer = nn.Conv2d(2, 3, 3)
    a, g = torch.full((200, 2, 7, 7), 3.0), torch.full((200, 3, 5, 5), -2.0)  # nothing like the stand-ins
    conv_rows._choose(layer, a, g)
    assert seen and all(t.shape[0] == 256 and not bool((t[:200] == a).any()) for t in seen)
    conv_rows.conv_weight_rows(layer, a, g)
    assert len(conv_rows._CHOICE) == 1
    conv_rows.conv_weight_rows(layer, a[:129], g[:129])
    assert len(conv_rows._CHOICE) == 1  # 129-256: one bucket


class _MixesInFloat32Only(nn.Module):
    """Mixes examples (batch standardisation after the layer) in float32 and not in float64: written
    to pass a float64 recheck."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 3)

    def forward(self, x):
        h = self.lin(x.flatten(1))
        return (h - h.mean(0, keepdim=True)) if h.dtype == torch.float32 else h


def test_a_model_that_mixes_in_float32_only_is_refused():
    torch.manual_seed(0)
    eng = DPEngine(_MixesInFloat32Only(), "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0,
                   grad_path="fast")
    x, y = _data(10)
    with pytest.raises(ConfigError, match="lets examples see each other"):
        eng.step(x, y, torch.arange(10))


class _TinyMix(nn.Module):
    """Every example sees the batch mean, at an output scale of 1e-9 (per-example gradients ~4e-9)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 3)

    def forward(self, x):
        h = 1e-9 * self.lin(x)
        return h + 3 * h.mean(0, keepdim=True)


def test_mixing_is_refused_however_small_the_gradients():
    """The probe's comparison is relative: an absolute slack of 1e-7 let this model through, and one
    example then moved the clipped sum by 1.40 C with the clip at the median norm (red team)."""
    from clipbias.grads.fast import BookKeeping
    from clipbias.step import clip_scale
    torch.manual_seed(0)
    x, y = torch.randn(16, 16), torch.randint(0, 3, (16,))
    with pytest.raises(ConfigError, match="lets examples see each other"):
        BookKeeping(_TinyMix())(x, y, lambda n: clip_scale(n, 1e-9), False)


def test_steps_in_16_bit_floats_are_refused_before_any_change():
    """Under autocast, or with bfloat16 parameters, the clipped sum rounds at 2^-8 and one example moved
    it by 1.2 C at B = 256 (red team): refused, on both paths, with what to do."""
    x, y = _data(10)
    for path in ("rows", "fast"):
        m = Wide()
        eng = DPEngine(m, "dpsgd", n=40, batch_size=10, steps=2, noise_multiplier=1.0, grad_path=path)
        before = [p.detach().clone() for p in m.parameters()]
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ConfigError, match="outside autocast"):
            eng.step(x, y, torch.arange(10))
        assert eng.steps_taken == 0 and all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
        m16 = Wide().bfloat16()
        eng = DPEngine(m16, "dpsgd", n=40, batch_size=10, steps=2, noise_multiplier=1.0, grad_path=path)
        with pytest.raises(ConfigError, match="model.float"):
            eng.step(x.bfloat16(), y, torch.arange(10))


def test_a_conv_with_mixed_input_and_gradient_dtypes_widens_both():
    """A float32 input with a bfloat16 output gradient: both exactly widened to float32, whatever
    kernel was chosen for float32 before (the grouped kernel raised on the mixed pair)."""
    from clipbias.grads import conv_rows
    layer = nn.Conv2d(3, 4, 3, padding=1)
    a, g = torch.randn(8, 3, 6, 6), torch.randn(8, 4, 6, 6).bfloat16()
    for name in conv_rows.KERNELS:
        conv_rows._CHOICE.clear()
        conv_rows._CHOICE[conv_rows._key(layer, a, g.float())] = name
        got = conv_rows.conv_weight_rows(layer, a, g)
        torch.testing.assert_close(got, conv_rows._unfold(layer, a, g.float()), rtol=1e-5, atol=1e-5)
    conv_rows._CHOICE.clear()


class _InnerAutocast(nn.Module):
    """Enters bfloat16 autocast inside its own forward: the caller's autocast check cannot see it."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(64, 16), nn.Linear(16, 3)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.l2(torch.tanh(self.l1(x.flatten(1)))).float()


def test_bfloat16_inside_the_model_is_widened_on_the_fast_path_and_exact_on_rows():
    """bfloat16 activations made the fast path's sums bfloat16 (1.27 C at B = 256, red team): they are
    widened to float32 before the rules, whose sums are then float32 (float64 for one-position layers).
    The rows path's per-example gradients come back in float32. Both run."""
    x, y = _data(10)
    for path in ("fast", "rows"):
        m = _InnerAutocast()
        eng = DPEngine(m, "dpsgd", n=40, batch_size=10, steps=2, noise_multiplier=1.0, grad_path=path)
        sums, finish = [], eng.pipeline.finish
        eng.pipeline.finish = lambda p, r: (sums.append(p.dtype), finish(p, r))[1]
        eng.step(x, y, torch.arange(10))
        assert eng.steps_taken == 1 and sums == [torch.float32] and all(torch.isfinite(p).all() for p in m.parameters())


@pytest.mark.parametrize("path", ["rows", "fast"])
def test_an_overflowing_feedback_buffer_cannot_make_the_release_nan(path):
    """Every example's gradient finite (norm 1.7e38) but their float32 sum infinite: the hidden buffer
    overflowed, clip(inf) was NaN and every later release NaN (whether the examples were sampled,
    released). The buffer restarts from zero; the release stays finite (red team)."""
    torch.manual_seed(0)
    m = nn.Linear(1, 1, bias=False)
    eng = DPEngine(m, "dice", n=8, batch_size=4.0, steps=3, noise_multiplier=1.0, grad_path=path,
                   loss_fn=lambda out, y: (out * y).sum(1), config=AlgoConfig(lr=0.1, clip=1.0, ef_clip=0.01),
                   max_physical_batch=8)
    x = y = torch.full((3, 1), 1.3e19)
    eng.step(x, y, torch.arange(3))
    before = m.weight.detach().clone()
    eng.step(x[:0], y[:0], torch.arange(0))
    assert torch.isfinite(m.weight).all() and float((m.weight.detach() - before).abs()) < 1.0


class _Canary(nn.Module):
    """Every row's input is shifted by 50 e_1 when the batch holds a canary (an input whose first
    feature exceeds 5): a statistic of one example, the same in any sub-batch that holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 3)

    def forward(self, x):
        shift = torch.zeros_like(x[0])
        shift[1] = 50.0
        return self.lin(x + (x[:, 0].max() > 5).to(x.dtype) * shift)


def _canary_batch(b):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(b, 16, generator=g), torch.randint(0, 3, (b,), generator=g)
    x[0, 0] = 10.0
    return x, y


@pytest.mark.parametrize("b", [2, 5, 8])
def test_a_mixing_driven_by_one_example_is_refused_whichever_examples_are_probed(b, monkeypatch):
    """Probes run as one batch of their own reproduce the shift whenever they hold the canary: such a
    probe accepted 1 step in 2 at b = 2 (one of the two probed), 4 in 5 at b = 5, 4 in 8 at b = 8 (400
    steps each), and removing the canary moved the clipped sum by 2.0, 4.0 and 7.6 C (C = 1). Each
    probe alone: refused every time."""
    from clipbias.grads import fast as fc
    from clipbias.step import clip_scale
    torch.manual_seed(0)
    m, (x, y) = _Canary(), _canary_batch(b)
    bk = fc.BookKeeping(m)
    for _ in range(30):
        with pytest.raises(ConfigError, match="each run alone.*lets examples see each other"):
            bk(x, y, lambda n: clip_scale(n, 1.0), False)
    eng = DPEngine(m, "dpsgd", n=40, batch_size=b, steps=1, noise_multiplier=1.0, grad_path="fast")
    with pytest.raises(ConfigError, match="lets examples see each other"):
        eng.step(x, y, torch.arange(b))
    assert eng.steps_taken == 0
    monkeypatch.setattr(fc.BookKeeping, "_check_examples", lambda *a, **k: None)
    moved = (bk(x, y, lambda n: clip_scale(n, 1.0), False)[0] - bk(x[1:], y[1:], lambda n: clip_scale(n, 1.0),
                                                                      False)[0]).norm()
    assert moved > 1.9  # what the unchecked fast path would release: the sensitivity is C = 1


class _Output(dict):
    """A dict subclass as the model's output (as Hugging Face's ``ModelOutput``): ``vmap`` cannot return it."""


class _DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 3)

    def forward(self, x):
        return _Output(logits=self.lin(x.flatten(1)))


def test_a_model_whose_output_vmap_cannot_return_is_probed_one_example_at_a_time():
    """The probe runs its examples alone in one ``vmap``ped forward; an output ``vmap`` refuses (a
    ValueError for a dict subclass) sends it to a loop of batches of one, with the same update."""
    def loss(out, t):
        return F.cross_entropy(out["logits"], t, reduction="none")
    fast, eng = _run(_DictOut, "dpsgd", "fast", steps=2, loss_fn=loss)
    rows, _ = _run(_DictOut, "dpsgd", "rows", steps=2, loss_fn=loss)
    assert eng.fast is not None and eng.steps_taken == 2
    torch.testing.assert_close(fast, rows, rtol=1e-4, atol=1e-4)  # float32, noise on its grid


@pytest.mark.parametrize("model_cls", [Net, Wide, Normed, Tokens])
def test_the_probes_combined_attribution_is_the_weighted_sum_of_their_own(model_cls, branch):
    """``combo`` (one product over the probes' positions) equals ``sum_k w_k one(i_k)`` for every rule."""
    from clipbias.grads.fast import BookKeeping
    torch.manual_seed(0)
    bk = BookKeeping(model_cls())
    x, y = _data(12)
    _, rules, _ = bk._rules(x, y)
    idx, w = [5, 0, 11], [0.7, 1.9, 0.05]
    for r in rules:
        want = [sum(wk * t for wk, t in zip(w, col)) for col in zip(*[r.one(i) for i in idx])]
        for got, exp in zip(r.combo(idx, w), want):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)


def test_probe_weights_stay_finite_for_vanishing_gradients():
    """A confidently classified example's gradient can underflow towards 0 (cross-entropy's p - y ~ e^-margin):
    its weight ``u / ||g||`` is capped (``MIN_PROBE_NORM``) so that the weighted loss stays finite in
    float32, and the scale is ``sum_k w_k ||g_k||``."""
    from clipbias.grads.fast import MIN_PROBE_NORM, BookKeeping
    bk = BookKeeping(Net())
    w, scale = bk._probe_weights(torch.tensor([4.0, 0.0, 1e-80, 1e-20], dtype=torch.float64), [0, 1, 2, 3])
    assert 1 / 2 <= w[0] <= 1 and all(1 <= wk * MIN_PROBE_NORM <= 2 for wk in w[1:3])
    assert 1e10 <= w[3] <= 2e10 and torch.isfinite(torch.tensor(w, dtype=torch.float32)).all()
    assert scale == pytest.approx(2 * w[0] + w[2] * 1e-40 + w[3] * 1e-10)


def test_input_rows_are_the_unfolded_input_bit_for_bit():
    """``input_rows`` (one copy of a strided view: the ghost norm's input rows) holds exactly what
    ``F.unfold`` gives, transposed: Conv1d and Conv2d, padding, stride, dilation, rectangular kernels,
    channels-last inputs, a view with a storage offset, float64."""
    from clipbias.grads.conv_rows import input_rows, unfold_input
    gen = torch.Generator().manual_seed(0)
    cases = [(nn.Conv2d(1, 4, 8, stride=2, padding=3), (5, 1, 28, 28)),
             (nn.Conv2d(3, 2, (3, 5), stride=(2, 1), padding=(1, 2), dilation=(2, 1)), (4, 3, 11, 9)),
             (nn.Conv2d(16, 8, 4, stride=2), (3, 16, 13, 13)),
             (nn.Conv1d(3, 5, 4, stride=3, padding=2, dilation=2), (6, 3, 20))]
    for layer, shape in cases:
        a = torch.randn(shape, generator=gen)
        inputs = [a, a.double(), torch.randn((shape[0] + 2, *shape[1:]), generator=gen)[2:]]
        if a.dim() == 4:
            inputs.append(a.contiguous(memory_format=torch.channels_last))
        for x in inputs:
            got, want = input_rows(layer, x), unfold_input(layer, x).transpose(1, 2)
            assert got.is_contiguous() and got.dtype == x.dtype and torch.equal(got, want), (layer, x.shape)


def test_the_dropout_probe_does_not_refuse_an_honest_model_whose_examples_are_fit_to_a_tiny_gradient(monkeypatch):
    """An honest dropout model whose softmax is saturated (example gradients down to ~1e-14) was refused as mixing
    (a red team's run at lr = 1: step 140-349): float32 is far off float64 at that size, relative to the example's
    own gradient. The float32-vs-float64 comparison is now relative to at least ``FLOOR`` C as well; the bound C is
    read off the step's scaling (``RuntimeChecks.bound``)."""
    import torch.nn.functional as F
    from clipbias.grads import fast_checks, proof
    monkeypatch.setattr(proof, "ENABLED", False)  # every step probed

    class Saturated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.drop = nn.Linear(6, 16), nn.Linear(16, 3), nn.Dropout(0.1)

        def forward(self, x):
            return self.fc2(self.drop(F.gelu(self.fc1(x))))
    torch.manual_seed(0)
    m = Saturated()
    with torch.no_grad():
        m.fc1.weight.mul_(4)
        m.fc2.weight.mul_(20)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = m.fc2(F.gelu(m.fc1(x))).argmax(1)
    eng = DPEngine(m, "dpsgd", n=64, batch_size=8, steps=10, noise_multiplier=1.0,
                   config=AlgoConfig(lr=1e-12, clip=0.7), grad_path="fast")
    for s in range(8):
        idx = torch.arange(s * 8, s * 8 + 8)
        eng.step(x[idx], y[idx], idx)
    assert eng.steps_taken == 8
    assert eng.fast.checks.bound(torch.device("cpu")) == pytest.approx(0.7)
    eng.fast.checks.scale = lambda n: torch.ones_like(n)  # no clipping: no bound, relative comparisons only
    assert eng.fast.checks.bound(torch.device("cpu")) == 0.0
    assert fast_checks.FLOOR == 2.0 ** -20
