"""The fast path's rules for the layers of fine-tuned models: grouped and depthwise convolutions,
Conv3d, padding modes, InstanceNorm, RMSNorm (torch's and Hugging Face's), PReLU, each against the
rows path, and a tiny Llama decoder end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError
from clipbias.grads.fast import BookKeeping, why_unsupported
from clipbias.grads.rows import FuncGradients, ParamSums
from clipbias.step import clip_scale
from tests.weights import at_weights
from tests.test_fastclip import _data, _run, branch, float64  # noqa: F401  (fixtures)

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402


class Grouped(nn.Module):
    """Depthwise (reflect padding), grouped with stride, a grouped Conv1d with ``padding="same"`` and
    circular padding, and a depthwise layer over one position: every grouped branch."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.dw = nn.Conv2d(4, 4, 3, groups=4, padding=1, padding_mode="reflect")
        self.g2 = nn.Conv2d(4, 6, 2, groups=2, stride=2, bias=False)
        self.c1d = nn.Conv1d(6, 6, 3, groups=3, padding="same", padding_mode="circular")
        self.one = nn.Conv2d(6, 6, 4, groups=6)                    # L = 1
        self.out = nn.Linear(96 + 6, 3)

    def forward(self, x):
        h = torch.tanh(self.g2(torch.tanh(self.dw(torch.tanh(self.c1(x))))))     # [b, 6, 4, 4]
        s = torch.tanh(self.c1d(h.flatten(2)))
        return self.out(torch.cat([s.flatten(1), self.one(h).flatten(1)], 1))


class Cube(nn.Module):
    """Conv3d formed (L^2 > o k) and ghost-eligible (L = 8, o k = 192), a grouped Conv3d with
    replicate padding, InstanceNorm3d."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(1, 4, 3, padding=1)
        self.c2 = nn.Conv3d(4, 6, 2, stride=2, bias=False)
        self.g = nn.Conv3d(6, 6, 2, groups=3, padding=1, padding_mode="replicate")
        self.n = nn.InstanceNorm3d(6, affine=True)
        self.out = nn.Linear(6 * 27, 3)

    def forward(self, x):
        h = torch.tanh(self.c2(torch.tanh(self.c1(x.reshape(-1, 1, 4, 4, 4)))))
        return self.out(self.n(self.g(h)).flatten(1))


class Norms(nn.Module):
    """InstanceNorm2d/1d, ``nn.RMSNorm`` over one and two trailing dimensions, Llama's RMSNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(1, 4, 3, stride=2)
        self.in2 = nn.InstanceNorm2d(4, affine=True)
        self.in1 = nn.InstanceNorm1d(4, affine=True)
        self.rms = nn.RMSNorm(4)
        self.rms2 = nn.RMSNorm([9, 4], eps=1e-3)
        self.hf = LlamaRMSNorm(4)
        self.out = nn.Linear(36, 3)

    def forward(self, x):
        h = torch.tanh(self.in2(self.c(x))).flatten(2)            # [b, 4, 9]
        h = torch.tanh(self.in1(h)).transpose(1, 2)                # [b, 9, 4]
        h = self.hf(torch.tanh(self.rms2(torch.tanh(self.rms(h)))))
        return self.out(h.flatten(1))


class Prelus(nn.Module):
    """PReLU with one weight per channel of a Conv2d's output and of a sequence ``[b, C, L]``, one per
    feature of a flat ``[b, F]``, and a single shared one."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(1, 4, 3, stride=2)
        self.p4 = nn.PReLU(4)
        self.seq = nn.PReLU(4, init=0.1)
        self.lin = nn.Linear(36, 5)
        self.p5 = nn.PReLU(5)
        self.p1 = nn.PReLU()
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = self.seq(self.p4(self.c(x)).flatten(2))                # [b, 4, 9]
        return self.out(self.p1(self.p5(self.lin(h.flatten(1)))))


def _perturbed(m: nn.Module) -> nn.Module:
    """Norm weights and biases away from their ones and zeros, so that their gradients are not special."""
    torch.manual_seed(2)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(("weight", "bias")) and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return m


@pytest.mark.parametrize("model_cls", [Grouped, Cube, Norms, Prelus])
def test_fast_norms_and_sums_equal_the_rows_path(model_cls, float64, branch):
    """Every example's norm, the clipped sum and the unclipped reference sum on the fast path equal
    the rows path's (per-example gradients by ``torch.func``) to 1e-10 in float64."""
    torch.manual_seed(1)
    m = _perturbed(model_cls())
    assert why_unsupported(m) is None
    x, y = _data(9)
    scale = lambda n: clip_scale(n, 0.5)  # noqa: E731
    fast = BookKeeping(m)(x, y, scale, True)
    rows = ParamSums(FuncGradients(m))(x, y, scale, True)
    for got, want, what in zip(fast, rows, ("clipped sum", "reference sum", "losses", "norms")):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=what)
    assert (rows[3] > 0.5).sum() >= 3  # the clip is active on several examples


@pytest.mark.parametrize("model_cls", [Grouped, Norms, Prelus])
def test_fast_path_update_equals_the_rows_path_in_the_engine(model_cls, float64):
    rows, _ = _run(model_cls, "dpsgd", "rows", steps=2)
    fast, e_fast = _run(model_cls, "dpsgd", "fast", steps=2)
    assert e_fast.fast is not None
    torch.testing.assert_close(fast, rows, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("model_cls", [Grouped, Cube, Norms, Prelus])
def test_the_probes_combined_attribution_is_the_weighted_sum_of_their_own(model_cls):
    torch.manual_seed(0)
    bk = BookKeeping(_perturbed(model_cls()))
    x, y = _data(6)
    _, rules, _ = bk._rules(x, y)
    idx, w = [5, 0, 3], [0.7, 1.9, 0.05]
    for r in rules:
        want = [sum(wk * t for wk, t in zip(w, col)) for col in zip(*[r.one(i) for i in idx])]
        for got, exp in zip(r.combo(idx, w), want):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer, shape", [
    (nn.Conv2d(4, 4, 3, groups=4, padding=1, padding_mode="reflect"), (3, 4, 6, 5)),          # depthwise
    (nn.Conv2d(6, 4, (2, 3), groups=2, stride=(1, 2), dilation=(2, 1), padding=1), (3, 6, 7, 8)),
    (nn.Conv1d(6, 9, 3, groups=3, padding="same", dilation=2, padding_mode="circular"), (4, 6, 11)),
    (nn.Conv2d(3, 5, 3, padding="same", padding_mode="replicate"), (2, 3, 6, 6)),
    (nn.Conv2d(2, 4, (2, 4), padding="same", dilation=(1, 3)), (3, 2, 5, 9)),                 # asymmetric zeros
    (nn.Conv1d(2, 3, 4, padding="valid", groups=1, stride=2), (3, 2, 9)),
    (nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(1, 1, 2)), (3, 2, 5, 6, 5)),
    (nn.Conv3d(4, 4, 2, groups=2, padding=1, padding_mode="circular"), (2, 4, 3, 4, 3)),
])
def test_every_conv_kernel_gives_the_per_example_weight_gradients(layer, shape):
    """Each kernel that takes the layer equals per-example gradients taken one example at a time in
    float64 (``dilated`` takes groups=1 only, and says so)."""
    from clipbias.grads.conv_rows import KERNELS
    layer = layer.double()
    a = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn_like(layer(a))
    want = torch.stack([torch.autograd.grad((layer(a[i:i + 1]) * g[i:i + 1]).sum(), layer.weight)[0].reshape(
        layer.out_channels, -1) for i in range(shape[0])])
    ran = []
    for name, kernel in KERNELS.items():
        if name == "dilated" and layer.groups > 1:
            with pytest.raises(RuntimeError, match="groups=1"):
                kernel(layer, a, g)
            continue
        got = kernel(layer, a, g)
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), name
        ran.append(name)
    assert len(ran) == (3 if layer.groups > 1 else 4)


def test_input_rows_times_the_weight_is_the_convolution():
    """``input_rows`` (im2col, the ghost norm's and the one-position rule's input rows) times the
    flattened weight is the layer's output: Conv3d, and Conv2d with a non-zero padding mode."""
    from clipbias.grads.conv_rows import input_rows
    for layer, shape in [(nn.Conv3d(2, 3, (2, 3, 2), stride=(2, 1, 1), padding=(1, 1, 0), dilation=(1, 2, 1),
                                    bias=False), (3, 2, 6, 7, 5)),
                         (nn.Conv2d(3, 4, 3, padding=2, padding_mode="reflect", bias=False), (2, 3, 5, 6))]:
        layer = layer.double()
        a = torch.randn(*shape, dtype=torch.float64)
        out = layer(a)
        got = (input_rows(layer, a) @ layer.weight.reshape(layer.out_channels, -1).t()).transpose(1, 2)
        torch.testing.assert_close(got, out.flatten(2), rtol=1e-12, atol=1e-12)


def test_reviewed_rmsnorm_classes_are_checked_by_their_forward(monkeypatch):
    """A Hugging Face RMSNorm is taken only as a reviewed class with its reviewed forward: a forward
    replaced on the class (a hub kernel, an edit) or on the instance, and a subclass, are refused."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    assert why_unsupported(nn.Sequential(LlamaRMSNorm(4), Qwen2RMSNorm(4))) is None

    class Mine(LlamaRMSNorm):
        pass
    assert "no fast-path rule" in why_unsupported(nn.Sequential(Mine(4)))
    inst = LlamaRMSNorm(4)
    inst.forward = lambda h: inst.weight * h
    assert "not the reviewed RMSNorm forward" in why_unsupported(nn.Sequential(inst))

    def edited(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)  # OLMo's order: not reviewed
    monkeypatch.setattr(LlamaRMSNorm, "forward", edited)
    assert "not the reviewed RMSNorm forward" in why_unsupported(nn.Sequential(LlamaRMSNorm(4)))


def test_unbatched_conv_input_and_instance_norm_running_stats_are_refused(float64):
    """A Conv1d given ``[b, L]`` reads the batch as one example's channels; an InstanceNorm tracking
    running statistics updates them from the batch in training: both refused before any change. In
    evaluation the running statistics are constants, and the rule uses them."""
    class Unbatched(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.out = nn.Conv1d(4, 4, 1), nn.Linear(5, 3)

        def forward(self, x):
            return self.out(self.c(x))
    scale = lambda n: clip_scale(n, 1.0)  # noqa: E731
    m = Unbatched()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ConfigError, match="without a batch dimension"):
        BookKeeping(m)(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), scale, False)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))

    net = nn.Sequential(nn.Conv1d(2, 3, 3), nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
                        nn.Flatten(), nn.Linear(18, 3))
    x, y = torch.randn(5, 2, 8), torch.randint(0, 3, (5,))
    stats = net[1].running_mean.clone()
    with pytest.raises(ConfigError, match="'1' \\(InstanceNorm1d\\) has track_running_stats=True in training"):
        BookKeeping(net)(x, y, scale, False)
    assert torch.equal(net[1].running_mean, stats)
    net.eval()
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1), net[1].running_var.uniform_(0.5, 2)
    fast = BookKeeping(net)(x, y, scale, True)
    rows = ParamSums(FuncGradients(net))(x, y, scale, True)
    for got, want in zip(fast, rows):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_new_layers_in_a_sequential_are_per_example_by_construction(monkeypatch):
    """A depthwise-separable CNN with InstanceNorm and RMSNorm, and a Conv3d one, in ``nn.Sequential``:
    ``separable`` proves them per-example, so the step runs without the probe."""
    import clipbias.grads.fast as fc
    from clipbias.grads import separable
    sep = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True), nn.ReLU(),
                        nn.Conv2d(4, 4, 3, groups=4, padding=1, padding_mode="reflect"), nn.Conv2d(4, 6, 1),
                        nn.MaxPool2d(2), nn.Flatten(2), nn.RMSNorm(16), nn.Flatten(), nn.Linear(96, 3))
    cube = nn.Sequential(nn.Unflatten(1, (1, 4, 4, 4)), nn.Conv3d(1, 2, (1, 3, 3), padding=(0, 1, 1)),
                         nn.InstanceNorm3d(2, affine=True), nn.AvgPool3d((1, 2, 2)), nn.Flatten(), nn.Linear(32, 3))
    assert separable.why_not(sep) is None
    assert "Unflatten" in separable.why_not(cube)  # not whitelisted: the probe stays
    probes = []
    monkeypatch.setattr(fc.BookKeeping, "_check_examples", lambda self, *a: probes.append(1))
    x, y = _data(6)
    BookKeeping(cube)(x.flatten(1), y, lambda n: clip_scale(n, 1.0), False)
    assert probes == [1]
    cube[0] = nn.Identity()
    assert separable.why_not(cube) is None
    for m, inp in ((sep, x), (cube, x.reshape(6, 1, 4, 4, 4))):
        BookKeeping(m)(inp, y, lambda n: clip_scale(n, 1.0), False)
    assert probes == [1]  # no probe on the proven models
    # the batch dimension is part of the proof (watch records every such layer's inputs, frozen ones too)
    assert separable.batched({cube[1]: [5], cube[2]: [5], sep[7]: [3]})
    assert not separable.batched({cube[1]: [4]}) and not separable.batched({cube[2]: [4]})
    assert not separable.batched({sep[7]: [1]})


def test_prelus_in_a_sequential_are_per_example_by_construction(monkeypatch):
    """PReLU is an elementwise layer: in an ``nn.Sequential`` it is proven per-example, so the step runs
    without the probe, and its norms and clipped sum are the rows path's."""
    import clipbias.grads.fast as fc
    from clipbias.grads import separable
    torch.manual_seed(0)
    seq = _perturbed(nn.Sequential(nn.Conv2d(1, 3, 3), nn.PReLU(3), nn.Flatten(), nn.Linear(108, 4), nn.PReLU(),
                                   nn.Linear(4, 3))).double()  # float64 without set_default_dtype: it replaces torch.Storage
    assert separable.why_not(seq) is None
    probes = []
    monkeypatch.setattr(fc.BookKeeping, "_check_examples", lambda self, *a: probes.append(1))
    x, y = _data(6)
    fast = BookKeeping(seq)(x.double(), y, lambda n: clip_scale(n, 0.5), False)
    rows = ParamSums(FuncGradients(seq))(x.double(), y, lambda n: clip_scale(n, 0.5), False)
    assert probes == []
    for got, want in ((fast[0], rows[0]), (fast[3], rows[3])):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=16, use_cache=False, tie_word_embeddings=False)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float64)


def _token_loss(out, y):
    """Per-sequence next-token loss from the Hugging Face output's logits (-100: no loss)."""
    return F.cross_entropy(out.logits.transpose(1, 2), y, reduction="none", ignore_index=-100).sum(1)


def test_a_llama_decoder_runs_on_the_fast_path_equal_to_the_rows_path():
    """A tiny random Llama (RMSNorm, rotary attention, SwiGLU MLP, untied head) in float64: every
    trainable layer has a fast-path rule; its norms and sums equal the rows path's, and a few private
    steps give the rows path's update."""
    m = _llama()
    assert why_unsupported(m) is None and next(m.parameters()).dtype == torch.float64
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (12, 9), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[::3, -2:] = -100
    scale = lambda n: clip_scale(n, 0.5)  # noqa: E731
    fast = BookKeeping(m, _token_loss)(x[:5], y[:5], scale, True)
    rows = ParamSums(FuncGradients(m, _token_loss))(x[:5], y[:5], scale, True)
    for got, want in zip(fast, rows):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

    def train(path):
        model = _llama()
        eng = DPEngine(model, "dpsgd", n=12, batch_size=4.0, steps=3, noise_multiplier=0.5, accountant="rdp",
                       loss_fn=_token_loss, grad_path=path, config=AlgoConfig(lr=0.5, clip=0.5), noise_seed=3)
        for _ in range(3):
            idx = eng.sampler.sample()
            eng.step(x[idx], y[idx], idx)
        assert (eng.fast is not None) == (path == "fast") and eng.steps_taken == 3
        return torch.cat([p.detach().flatten() for p in model.parameters()])
    start = torch.cat([p.detach().flatten() for p in _llama().parameters()])
    fast_w, rows_w = train("fast"), train("rows")
    assert not torch.equal(fast_w, start)
    torch.testing.assert_close(fast_w, rows_w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("model_cls", [Grouped, Cube, Norms, Prelus])
def test_the_two_point_combination_equals_the_rows_path(model_cls, float64):
    """DiSK's rows ``c g(far) + (1 - c) g(here)`` (``at=``): the new rules' cross terms give the rows
    path's norms and clipped sum."""
    torch.manual_seed(1)
    m = _perturbed(model_cls())
    far = [p.detach() + 0.05 * torch.randn_like(p) for p in m.parameters()]
    enter = at_weights(m, far)
    x, y = _data(7)
    scale = lambda n: clip_scale(n, 0.5)  # noqa: E731
    fast = BookKeeping(m)(x, y, scale, False, at=(enter, 1.7))
    rows = ParamSums(FuncGradients(m))(x, y, scale, False, at=(enter, 1.7))
    for got, want, what in zip(fast, rows, ("clipped sum", "reference sum", "losses", "norms")):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=what)


@pytest.mark.parametrize("model_cls", [Grouped, Cube, Norms, Prelus])
def test_each_clipped_contribution_is_within_the_clip_in_float32(model_cls):
    """In float32, each example's clipped contribution (the example alone in the batch), measured in
    float64, is at most C: the new rules' norms are upper bounds on what they sum. Inputs over
    magnitudes 1e-3 to 1e3 with a clip far below the gradients."""
    torch.manual_seed(3)
    m = _perturbed(model_cls()).float()
    bk, clip = BookKeeping(m), 1e-3
    x, y = _data(6)
    x = x * torch.logspace(-3, 3, 6).view(-1, 1, 1, 1)
    worst = 0.0
    for i in range(6):
        got, _, _, norms = bk(x[i:i + 1], y[i:i + 1], lambda n: clip_scale(n, clip), False)
        assert float(norms[0]) > 10 * clip
        worst = max(worst, float(got.double().norm()))
    assert clip * 0.99 < worst <= clip * (1 + 1e-6)  # the float32 sum's own rounding aside (docs/privacy.md)


@pytest.mark.parametrize("name", ["Qwen2", "Qwen3", "Mistral"])
def test_the_other_reviewed_decoders_run_on_the_fast_path_equal_to_the_rows_path(name, float64):
    """Qwen2 (biased q/k/v), Qwen3 (RMSNorm on every head's queries and keys: positions and heads
    summed) and Mistral, tiny and random, with grouped-query attention: norms and sums equal the rows
    path's."""
    config, model = getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(0)
    cfg = config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=16, use_cache=False, tie_word_embeddings=False,
                 **({"head_dim": 16} if name == "Qwen3" else {}))
    m = _perturbed(model._from_config(cfg, attn_implementation="eager", dtype=torch.float64))
    assert why_unsupported(m) is None
    tokens = torch.randint(0, 97, (5, 9), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    scale = lambda n: clip_scale(n, 0.5)  # noqa: E731
    fast = BookKeeping(m, _token_loss)(x, y, scale, True)
    rows = ParamSums(FuncGradients(m, _token_loss))(x, y, scale, True)
    for got, want in zip(fast, rows):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
