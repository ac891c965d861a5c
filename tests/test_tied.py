"""Tied weights on the fast path: an Embedding sharing its weight with a Linear head (GPT-2's wte and
lm_head), Hugging Face's Conv1D, and the tied pair's cross term under cancellation."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError
from clipbias.grads.fast import BookKeeping, _rules_of, why_unsupported
from clipbias.grads.rows import FuncGradients
from clipbias.step import clip_scale


class TiedLM(nn.Module):
    """Token and position embeddings, a Linear over the positions, LayerNorm, and a head whose weight
    is the token embedding's (with a bias of its own); padding id 0."""

    def __init__(self, vocab=13, width=6, context=5) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, width, padding_idx=0), nn.Embedding(context, width)
        self.mid, self.ln = nn.Linear(width, width), nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x) + self.pos(torch.arange(x.shape[1], device=x.device).unsqueeze(0))
        return self.head(self.ln(torch.tanh(self.mid(h))))


def lm_loss(logits, y):
    """Per-example summed token cross-entropy (ignore -100)."""
    return F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100, reduction="none").sum(1)


def _tokens(n=30, vocab=13, length=5):
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, vocab, (n, length + 1), generator=g)
    t[::4, 1:3] = t[::4, 0:1]  # repeated tokens within a sequence
    x, y = t[:, :-1], t[:, 1:].clone()
    y[::3, -2:] = -100
    return x, y


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(params=["formed", "ghost"])
def branch(request, monkeypatch):
    """The head's weight gradient formed per example, or its norm from the ghost norm."""
    import clipbias.grads.fast as fc
    if request.param == "ghost":
        monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    return request.param


def test_tied_embedding_and_head_norms_and_clipped_sum_equal_the_rows_path(float64, branch):
    """The per-example norm of the tied weight's summed gradient and the clipped sum, from the rules
    with the cross term, equal the rows path's (torch.func, the tied parameter once) to 1e-10."""
    torch.manual_seed(1)
    m = TiedLM()
    assert m.head.weight is m.emb.weight and why_unsupported(m) is None
    x, y = _tokens(8)
    rows, _ = FuncGradients(m, lm_loss)(x, y)
    want_norms = rows.norm(dim=1)
    C = float(want_norms.median())
    want = (rows * clip_scale(want_norms, C).unsqueeze(1)).sum(0)
    bk = BookKeeping(m, lm_loss)
    assert [(bk.layers[e], bk.layers[j]) for e, j in bk.ties] == [(m.emb, m.head)]
    proc, _, _, norms = bk(x, y, lambda n: clip_scale(n, C), False)
    torch.testing.assert_close(norms, want_norms, rtol=1e-10, atol=0)
    torch.testing.assert_close(proc, want, rtol=1e-10, atol=1e-13)
    # the cross term matters: without it the norms differ
    untied = sum(r.sq for r in _rules_of(bk.layers, *_acts_outs(bk, x, y)))
    assert not torch.allclose(untied.sqrt(), want_norms, rtol=1e-3)


def _acts_outs(bk, x, y):
    _, acts, grads = bk._backward(x, y)
    return acts, grads[:len(bk.layers)]


@pytest.mark.parametrize("algo,cfg", [("dpsgd", {}), ("dice", {"ef_clip": 0.01})])
def test_tied_model_fast_path_update_equals_the_rows_path(algo, cfg, float64, branch):
    """A few private steps (same noise key) on both paths give the same parameters."""
    x, y = _tokens()

    def run(path):
        torch.manual_seed(1)
        m = TiedLM()
        eng = DPEngine(m, algo, n=30, batch_size=8.0, steps=2, noise_multiplier=1.0, accountant="rdp",
                       loss_fn=lm_loss, grad_path=path, config=AlgoConfig(lr=0.5, clip=0.3, **cfg), noise_seed=3,
                       max_physical_batch=5)
        for _ in range(2):
            idx = eng.sampler.sample()
            eng.step(x[idx], y[idx], idx)
        return torch.cat([p.detach().flatten() for p in m.parameters()]), eng

    rows, e_rows = run("rows")
    fast, e_fast = run("fast")
    assert e_fast.fast is not None and e_rows.fast is None
    torch.testing.assert_close(fast, rows, rtol=1e-10, atol=1e-12)


class _Cancel(nn.Module):
    """One token through a tied Embedding and head: ``logits = W (W[t] + z)``, a loss linear in the
    logits with weights ``Y``: the embedding's gradient row is ``Y[t] W[t]``-like and the head's
    ``Y[:, t] (W[t] + z)``; ``z = -2 W[t] + delta`` makes their sum ``y delta`` while each is ``~ y W[t]``."""

    def __init__(self, vocab=5, width=4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        tok, z = x
        return self.head(self.emb(tok) + z)


@pytest.mark.parametrize("positions", [1, 2])
def test_a_cancelling_tied_example_cannot_beat_the_clip(positions, branch):
    """Red team (float32): one example whose two uses' gradients cancel to 1e-3 ... 0 of their size
    (``z = -2 W[t] + delta``), and with two positions also cancelling within the head (``h_0 = B r``,
    ``h_1 = -B r - 2 W[t] + delta``, B up to 1e4). Its norm bounds the true one (float64, from the same
    float32 values) wherever the head's rule does not form ``G_i`` (one position, ghost), so the clipped
    contribution is within C (1 + 1e-12); the released sum (float32, both uses added) is within
    C (1 + 1e-4) on every branch. (Where the head forms ``G_i`` in float32, the probe refuses some of
    these examples: their float32 gradient alone differs from the attributed one.)"""
    torch.manual_seed(0)
    m = _Cancel()
    bk = BookKeeping(m, lambda out, Y: (out * Y).sum((1, 2)))
    W = m.emb.weight.detach()
    C, worst, released, big, refused = 1e-3, 0.0, 0.0, 0.0, 0
    exact = positions == 1 or branch == "ghost"
    for delta in (1e-3, 1e-5, 1e-7, 0.0):
        for trial in range(5):
            t, y = trial, 10.0 ** (trial - 2)
            tok = torch.full((1, positions), t)
            r, d = torch.randn(4), delta * torch.randn(4)
            if positions == 1:
                z = (-2 * W[t] + d).reshape(1, 1, 4)
            else:
                B = 10.0 ** trial
                z = torch.stack([B * r - W[t], -B * r - 3 * W[t] + d]).unsqueeze(0)
            Y = torch.zeros(1, positions, 5)
            Y[0, :, t] = y
            try:
                proc, _, _, norms = bk(((tok, z),), Y, lambda n: clip_scale(n, C), False)
            except ConfigError:  # the probe: float32 rows of the crafted example differ from its attribution
                refused += 1
                continue
            h = (W[tok[0]] + z[0]).double()  # the head's input as the model computes it, [positions, 4]
            E = torch.zeros(5, 4, dtype=torch.float64)
            E[t] = (Y[0].double() @ W.double()).sum(0)
            G = Y[0].double().t() @ h
            true = float((E + G).norm())
            if exact:
                assert float(norms[0]) >= true * (1 - 1e-15)
                worst = max(worst, float(clip_scale(norms, C)[0]) * true / C)
            released = max(released, float(proc.double().norm()) / C)
            big = max(big, float(E.norm()) / max(true, 1e-300))
            assert proc.dtype == torch.float32
    assert worst <= 1 + 1e-12 and released <= 1 + 1e-4 and big > 1e3  # a real cancellation was reached
    assert refused <= 10  # most steps ran (a refusal stops the run: no release)


def test_shared_weights_the_fast_path_cannot_bound_are_refused():
    """Two Linears sharing their weight (no cross-term rule), an Embedding's weight shared with a
    Linear's bias-free head of another kind, and a module registered twice: refused with the reason."""
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    assert "tied weights" in why_unsupported(nn.Sequential(a, nn.Tanh(), b))
    lin = nn.Linear(4, 4)
    assert "several names" in why_unsupported(nn.Sequential(lin, nn.Tanh(), lin))
    e1, e2 = nn.Embedding(5, 4), nn.Embedding(5, 4)
    e2.weight = e1.weight
    m = nn.ModuleDict({"a": e1, "b": e2})
    assert "tied weights" in why_unsupported(m)
    with pytest.raises(ConfigError, match="tied weights"):
        DPEngine(nn.Sequential(a, nn.Tanh(), b), "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=1.0,
                 grad_path="fast")


def _gpt2(seed=0, dropout=0.0, attention="eager"):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=32, bos_token_id=100,
                                  eos_token_id=100, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation=attention)


def _gpt2_batch(n=24, length=12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 101, (n, length), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, -3:] = 0  # right padding
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask}, labels


def test_gpt2_full_fine_tuning_on_the_fast_path_equals_the_rows_path(float64):
    """A random tiny GPT-2 (tied wte / lm_head, Conv1D layers, LayerNorm, padding), eager attention: every
    weight trained; the fast path's per-example norms equal the rows path's to 1e-10, and two private
    steps (same noise key) give the same parameters. Then under SDPA with dropout 0.1 (attention dropout
    included, keyed per example), the same on both paths."""
    from clipbias.data.text import sequence_loss
    m = _gpt2()
    assert m.lm_head.weight is m.transformer.wte.weight and why_unsupported(m) is None
    x, y = _gpt2_batch()
    sub = {k: v[:6] for k, v in x.items()}
    rows, _ = FuncGradients(m, sequence_loss)(sub, y[:6])
    C = float(rows.norm(dim=1).median())
    proc, _, _, norms = BookKeeping(m, sequence_loss)(sub, y[:6], lambda n: clip_scale(n, C), False)
    torch.testing.assert_close(norms, rows.norm(dim=1), rtol=1e-10, atol=0)
    torch.testing.assert_close(proc, (rows * clip_scale(rows.norm(dim=1), C).unsqueeze(1)).sum(0), rtol=1e-10,
                               atol=1e-13)
    start = torch.cat([p.detach().flatten() for p in _gpt2().parameters()])
    for kind in ({}, {"dropout": 0.1, "attention": "sdpa"}):
        out = {}
        for path in ("rows", "fast"):
            m = _gpt2(**kind).train()
            eng = DPEngine(m, "dpsgd", n=24, batch_size=8.0, steps=2, noise_multiplier=0.01, accountant="rdp",
                           loss_fn=sequence_loss, grad_path=path, config=AlgoConfig(lr=0.5, clip=0.3), noise_seed=3)
            assert (eng.fast is not None) == (path == "fast")
            for _ in range(2):
                idx = eng.sampler.sample()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # SDPA's mask code: the rows path one example at a time
                    eng.step({k: v[idx] for k, v in x.items()}, y[idx], idx)
            out[path] = torch.cat([p.detach().flatten() for p in m.parameters()])
        assert (out["rows"] - start).abs().max() > 1e-3
        torch.testing.assert_close(out["fast"], out["rows"], rtol=1e-10, atol=1e-12)


def test_gpt2_trains_privately_on_the_fast_path_with_dropout():
    """float32, dropout on (keyed per example, checked by the counterfactual probe), DiceSGD with a loss
    reading ``out.logits``: four private steps on the fast path lower the training loss."""
    from clipbias.data.text import sequence_loss
    m = _gpt2(dropout=0.1)
    x, y = _gpt2_batch(16)
    x["input_ids"][:, 1::2] = x["input_ids"][:, 0::2]  # learnable: every second token repeats the previous
    y = x["input_ids"].masked_fill(x["attention_mask"] == 0, -100)
    eng = DPEngine(m, "dice", n=16, batch_size=8.0, steps=4, noise_multiplier=0.3, accountant="rdp",
                   loss_fn=sequence_loss, grad_path="fast", config=AlgoConfig(lr=3e-3, clip=1.0, optimizer="adam"),
                   noise_seed=0)
    assert eng.fast is not None

    def loss():
        m.eval()
        with torch.no_grad():
            out = sequence_loss(m(**x), y).mean()
        m.train()
        return float(out)

    before = loss()
    for _ in range(4):
        idx = eng.sampler.sample()
        eng.step({k: v[idx] for k, v in x.items()}, y[idx], idx)
    assert eng.steps_taken == 4 and loss() < before


def test_disk_with_a_tied_weight_keeps_the_rows_path(monkeypatch):
    """DiSK combines each example's gradients at two points; the tied uses' cross terms between the
    points are not bounded: grad_path="fast" is refused when the engine is built, "auto" keeps the rows."""
    import clipbias.engine.aggregate as agg
    with pytest.raises(ConfigError, match="DiSK's two points with tied weights"):
        DPEngine(TiedLM(), "disk", n=30, batch_size=8, steps=2, noise_multiplier=1.0, loss_fn=lm_loss,
                 grad_path="fast")
    monkeypatch.setattr(agg, "AUTO_ROWS_BYTES", 0)  # auto would take the fast path
    eng = DPEngine(TiedLM(), "disk", n=30, batch_size=8, steps=2, noise_multiplier=1.0, loss_fn=lm_loss)
    assert eng.fast is None and "DiSK's two points with tied weights" in eng.grad_path_note
    eng = DPEngine(TiedLM(), "dpsgd", n=30, batch_size=8, steps=2, noise_multiplier=1.0, loss_fn=lm_loss)
    assert eng.fast is not None


class _Conv1Ds(nn.Module):
    """transformers' Conv1D over a sequence and on one position (a Linear with its weight transposed)."""

    def __init__(self, dropout=0.0) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D
        self.seq, self.out, self.drop = Conv1D(5, 4), Conv1D(3, 15), nn.Dropout(dropout)
        nn.init.normal_(self.seq.bias)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.seq(x))).flatten(1))


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_conv1d_rule_equals_the_rows_path(float64, branch, dropout):
    """Conv1D's norms and clipped sums equal the rows path's, formed or on the ghost norm, with the
    probe (deterministic forward) and the counterfactual recomputation (dropout); a Conv1D subclass
    or an instance forward is refused."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    m = _Conv1Ds(dropout)
    assert why_unsupported(m) is None
    x, y = torch.randn(6, 3, 4), torch.randint(0, 3, (6,))
    bk = BookKeeping(m)
    proc, _, _, norms = bk(x, y, lambda n: clip_scale(n, 0.5), False)  # dropout: checked among copies of one example
    if dropout:  # torch's masks differ between the two paths: compare with dropout off
        m.eval()
        proc, _, _, norms = bk(x, y, lambda n: clip_scale(n, 0.5), False)
    rows, _ = FuncGradients(m)(x, y)
    torch.testing.assert_close(norms, rows.norm(dim=1), rtol=1e-10, atol=0)
    torch.testing.assert_close(proc, (rows * clip_scale(rows.norm(dim=1), 0.5).unsqueeze(1)).sum(0), rtol=1e-10,
                               atol=1e-13)

    class Sub(Conv1D):
        pass
    assert "(Sub) has trainable parameters and no fast-path rule" in why_unsupported(nn.Sequential(Sub(3, 4)))
    c = Conv1D(3, 4)
    c.forward = lambda x: x @ c.weight
    assert "reviewed" in why_unsupported(nn.Sequential(c))


def test_a_llama_with_tied_word_embeddings_equals_the_rows_path():
    """A tiny random Llama with ``tie_word_embeddings=True`` (embed_tokens is lm_head's weight) in float64:
    the clipped sum, the reference sum, the losses and the norms equal the rows path's."""
    transformers = pytest.importorskip("transformers")
    from clipbias.grads.rows import ParamSums
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                   use_cache=False, tie_word_embeddings=True)
    m = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float64)
    assert m.lm_head.weight is m.model.embed_tokens.weight and why_unsupported(m) is None
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (5, 9), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[::3, -2:] = -100

    def loss(out, y):
        return F.cross_entropy(out.logits.transpose(1, 2), y, reduction="none", ignore_index=-100).sum(1)

    scale = lambda n: clip_scale(n, 0.5)  # noqa: E731
    fast = BookKeeping(m, loss)(x, y, scale, True)
    rows = ParamSums(FuncGradients(m, loss))(x, y, scale, True)
    for got, want in zip(fast, rows):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
