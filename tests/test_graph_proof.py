"""The graph proof (``clipbias.grads.proof``): proven for per-example models (MLP, CNN with GroupNorm, tiny
Hugging Face BERT, GPT-2, ViT, Llama), refused for models that mix examples (BatchNorm in training, a batch
mean, attention over the batch, a counter that turns a batch mean on, a gradient hook, a numpy read, a
sequence-first layout); sound: the probe passes on every model proven, and catches every one refused that
mixes; the fast path skips its probe exactly on proven steps, with the same result."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from clipbias.errors import ConfigError, PathRefusal
from clipbias.grads import proof
from clipbias.grads.fast import BookKeeping

transformers = pytest.importorskip("transformers")
from test_hf_models import bert, classify, gpt2, lm, tokens, vit


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=16, attention_dropout=0.0)
    return LlamaForCausalLM(cfg)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        return self.fc2(h * torch.sigmoid(h).mean(-1, keepdim=True))  # a statistic of the example's own features


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.gn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Linear(8 * 4 * 4, 3)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.gn(self.conv(x))), 2)
        return self.fc(h.flatten(1))


class Centred(nn.Module):
    """``x - x.mean(0)``: every row holds the batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(x - x.mean(0))


class BatchAttention(nn.Module):
    """Attention over the batch dimension: each example attends to the others."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.fc = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        q = self.q(x).unsqueeze(0)  # [1, B, F]: the batch as the positions attended over
        return self.fc(F.scaled_dot_product_attention(q, q, q).squeeze(0))


class Counted(nn.Module):
    """Reads a global switch (a counter a model could keep): once it is on, it subtracts the batch mean."""

    calls = 0
    mixing = False

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        Counted.calls += 1
        h = self.fc1(x)
        if Counted.mixing:
            h = h - h.mean(0)
        return self.fc2(h)


class Hooked(nn.Module):
    """A gradient hook in the forward that centres the gradient over the batch (the backward is not recorded)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc1(x)
        if h.requires_grad:
            h.register_hook(lambda g: g - g.mean(0))
        return self.fc2(h)


class NumpyRead(nn.Module):
    """Reads the batch through numpy, outside torch's operators."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        m = torch.from_numpy(x.numpy().mean(0))
        return self.fc(x - m)


class SequenceFirst(nn.Module):
    """A layer given ``[T, B, F]`` with T = B: its rows are positions, not examples."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):  # x: [B, T, F]
        return self.fc(x.transpose(0, 1)).transpose(0, 1).sum(1)


def _xy(b: int = 4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 6, generator=g), torch.randint(0, 3, (b,), generator=g)


PROVEN = {
    "mlp": (MLP, lambda: _xy()[0]),
    "cnn-groupnorm": (CNN, lambda: torch.randn(4, 3, 8, 8)),
    "bert": (bert, lambda: tokens(4, 8, [8] * 4)),
    "gpt2": (gpt2, lambda: tokens(4, 8, [8] * 4)),
    "vit": (vit, lambda: torch.randn(4, 3, 16, 16)),
    "llama": (llama, lambda: tokens(4, 8, [8] * 4)),
}


@pytest.mark.parametrize("name", PROVEN)
def test_per_example_models_are_proven(name):
    make, data = PROVEN[name]
    assert proof.prove(make(), data()) is None


@pytest.mark.parametrize("make,x,why", [
    (lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)), _xy()[0], "in-place|alone"),
    (Centred, _xy()[0], "reduces over the batch dimension"),
    (BatchAttention, _xy()[0], "attention across the batch|pairing one example with another"),
    (Hooked, _xy()[0], "gradient hook"),
    (NumpyRead, _xy()[0], "outside torch's operators"),
    (SequenceFirst, torch.randn(4, 4, 6), "merges the batch dimension|holds the batch at dimension 1|alone runs other"),
])
def test_models_that_mix_examples_are_not_proven(make, x, why):
    got = proof.prove(make(), x)
    assert got is not None and re.search(why, got), got


def test_padding_keeps_the_probe_for_hugging_face_encoders():
    """With padding, transformers branches on a batch-wide ``all`` that was False (an example alone may take
    the other branch): not proven; without padding the branch is the same for each example alone."""
    assert re.search("depends on several examples|alone runs other", proof.prove(bert(), tokens(4, 8, [8, 5, 3, 8])))
    assert proof.prove(bert(), tokens(4, 8, [8, 8, 8, 8])) is None


def test_model_state_writes_and_random_draws_are_not_proven():
    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            self.n += 1
            return self.fc(x)

    class Drops(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            return self.fc(F.dropout(x, 0.5, training=True))
    assert "in-place add_ on a parameter, buffer" in proof.prove(Counts(), _xy()[0])
    assert "random operation" in proof.prove(Drops(), _xy()[0])


# ------------------------------------------------------------------------------------ the fast path

def _scale(norms):
    return torch.clamp(0.5 / norms, max=1.0)


def _probes(bk: BookKeeping, monkeypatch) -> list:
    calls = []
    real = bk._check_examples
    monkeypatch.setattr(bk, "_check_examples", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


LABELS = {"mlp": 3, "cnn-groupnorm": 3, "bert": 2, "vit": 3}


@pytest.mark.parametrize("name", PROVEN)
def test_the_probe_passes_on_every_proven_model_and_is_skipped_with_the_same_result(name, monkeypatch):
    """Soundness on random batches: the probe, forced on, passes where the proof holds; with the proof the fast
    path skips it and releases the same clipped sum and norms."""
    make, data = PROVEN[name]
    lm_like = name in ("gpt2", "llama")
    loss = lm if lm_like else classify if name in ("bert", "vit") else None
    for seed in range(2):
        torch.manual_seed(seed)
        model, x = make(), data()
        y = x["input_ids"] if lm_like else torch.randint(0, LABELS[name], (4,))
        bk = BookKeeping(model, loss) if loss is not None else BookKeeping(model)
        calls = _probes(bk, monkeypatch)
        for _ in range(2):  # a loss_fn's first step learns that it returns per-example losses (probed), and a
            bk(x, y, _scale, False)  # program proven anew keeps the probe on its first step
        before = len(calls)
        proven = bk(x, y, _scale, False)  # a program proven before: the probe skipped
        assert bk._proofs.last is None and len(calls) == before
        monkeypatch.setattr(proof, "GIVE_UP", 0)  # no recording: the probe runs, and passes
        monkeypatch.setattr(proof, "RETRY", 10**9)
        probed = bk(x, y, _scale, False)
        assert len(calls) == before + 1
        torch.testing.assert_close(probed[0], proven[0], rtol=0, atol=0)
        torch.testing.assert_close(probed[3], proven[3], rtol=0, atol=0)
        monkeypatch.undo()


def test_a_counter_that_turns_mixing_on_is_caught_by_the_probe_when_the_program_changes():
    """Steps 1 and 2 run a per-example program (proven; its first step keeps the probe, and the first proof runs
    the model once more, for an example alone); step 3's program subtracts the batch mean: it is a different
    program, not proven, and the probe refuses it."""
    Counted.calls, Counted.mixing = 0, False
    x, y = _xy()
    bk = BookKeeping(Counted())
    for _ in range(2):
        bk(x, y, _scale, False)
        assert bk._proofs.last is None
    Counted.mixing = True
    with pytest.raises(PathRefusal, match="lets examples see each other"):
        bk(x, y, _scale, False)
    assert "reduces over the batch dimension" in bk._proofs.last


@pytest.mark.parametrize("make", [Centred, BatchAttention, Hooked, SequenceFirst])
def test_the_probe_catches_every_refused_model_that_mixes(make):
    x, y = _xy()
    if make is SequenceFirst:
        x = torch.randn(4, 4, 6)
    bk = BookKeeping(make())
    with pytest.raises((PathRefusal, ConfigError)):
        for _ in range(2):
            bk(x, y, _scale, False)
    assert bk._proofs.last is not None


def test_batchnorm_in_training_is_refused_before_any_step():
    with pytest.raises(Exception, match="BatchNorm"):
        BookKeeping(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))(*_xy(), _scale, False)


def test_the_proof_is_cached_per_program_and_redone_when_the_program_changes(monkeypatch):
    """The same program is looked up; another sequence length, dropout turned on (train) and off (eval) again,
    a module replaced: analysed again (or, with dropout drawing, probed)."""
    model = bert(drop=0.1)
    model.eval()
    bk = BookKeeping(model, classify)
    calls = _probes(bk, monkeypatch)
    y = torch.tensor([0, 1, 1, 0])
    for _ in range(3):
        bk(tokens(4, 8, [8] * 4), y, _scale, False)
    # (the loss's first step and the program's first proven step keep the probe; the third is looked up)
    assert (bk._proofs.analysed, bk._proofs.hits, len(calls)) == (1, 1, 2)
    bk(tokens(4, 6, [6] * 4), y, _scale, False)  # another sequence length: another program, probed once
    assert (bk._proofs.analysed, len(calls)) == (2, 3) and bk._proofs.last is None
    bk(tokens(4, 6, [6] * 4), y, _scale, False)
    assert len(calls) == 3
    model.train()  # dropout draws: the step keeps its probe
    bk(tokens(4, 8, [8] * 4), y, _scale, False)
    assert len(calls) == 4
    model.eval()
    bk(tokens(4, 8, [8] * 4), y, _scale, False)
    assert len(calls) == 4 and bk._proofs.last is None
    model.classifier = nn.Sequential(nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 2))  # a module replaced
    bk = BookKeeping(model, classify)
    for _ in range(2):
        bk(tokens(4, 8, [8] * 4), y, _scale, False)
    assert bk._proofs.last is None and bk._proofs.analysed == 1
    model.classifier[1] = Centred().fc.__class__(8, 8)  # the same program shape, other weights: still proven
    bk(tokens(4, 8, [8] * 4), y, _scale, False)
    assert bk._proofs.last is None


def test_recording_stops_after_steps_that_are_not_proven_and_retries():
    proofs = proof.Proofs()
    proofs.failures = proof.GIVE_UP
    seen = sum(proofs.recording() for _ in range(proof.RETRY * 2))
    assert seen == 2


class BySize(nn.Module):
    """Rows that depend on the batch's size or an example's position (no mixing of data)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc, self.how = nn.Linear(6, 3), how

    def forward(self, x):
        h, b = self.fc(x), x.shape[0]
        if self.how == "size":
            return h / float(b)
        if self.how == "position":
            return h * (1 + torch.arange(b)[:, None])  # (a shift alone would cancel in the softmax)
        return h * (-1) ** b


@pytest.mark.parametrize("how", ["size", "position", "parity"])
def test_rows_that_depend_on_the_batch_size_or_position_are_not_proven_and_the_probe_catches_them(how):
    """What the probe catches by running an example alone (its size 1, its position 0), the proof sees by
    comparing the batch's program with the example's alone."""
    got = proof.prove(BySize(how), _xy()[0])
    assert got is not None and "depends on the batch's size" in got, got
    with pytest.raises(PathRefusal):
        BookKeeping(BySize(how))(*_xy(), _scale, False)


# ------------------------------------------------------------------------------------ keyed dropout

class Dropped(nn.Module):
    """An MLP with dropout in training (keyed per example in the engine's step); ``mix``: a batch mean before it;
    ``seq_first``: dropout on ``[T, B, F]`` with T = B (its mask rows are positions, not examples)."""

    def __init__(self, mix: bool = False, seq_first: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(6, 16), nn.Linear(16, 3), nn.Dropout(0.3)
        self.mix, self.seq_first = mix, seq_first

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if self.mix:
            h = h - h.mean(0)
        if self.seq_first:  # x: [B, T, F] with T = B
            return self.fc2(self.drop(h.transpose(0, 1)).transpose(0, 1)).sum(1)
        return self.fc2(self.drop(h))


def _keyed_steps(model: nn.Module, x, y, loss=None, steps: int = 4, b: int = 6):
    """``steps`` fast-path steps of ``DPEngine`` under a fixed key (dropout keyed per example), each on the next
    ``b`` examples; the weights after, the probes run and the engine's proofs."""
    from clipbias.config import AlgoConfig
    from clipbias.engine import DPEngine
    n = len(y)
    kw = {} if loss is None else {"loss_fn": loss}
    e = DPEngine(model, "dpsgd", n=n, batch_size=float(b), steps=100, noise_multiplier=1.0,
                 config=AlgoConfig(lr=0.1, clip=1.0), noise_seed=0, grad_path="fast", **kw)
    calls = []
    real = e.fast._check_examples
    e.fast._check_examples = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (indices of the test's choosing: uncertified, as the test knows)
        for s in range(steps):
            idx = torch.arange(s * b, s * b + b) % n
            e.step(batch_rows(x, idx), y[idx], idx)
    return [p.detach().clone() for p in model.parameters()], len(calls), e.fast._proofs


def batch_rows(x, idx):
    return {k: v[idx] for k, v in x.items()} if isinstance(x, dict) else x[idx]


KEYED = {
    "mlp": (lambda: Dropped(), lambda n: torch.randn(n, 6), lambda x, n: torch.randint(0, 3, (n,)), None),
    "bert": (lambda: bert(0.1), lambda n: tokens(n, 8, [8] * n), lambda x, n: torch.randint(0, 2, (n,)), classify),
    "gpt2": (lambda: gpt2(0.1), lambda n: tokens(n, 8, [8] * n), lambda x, n: x["input_ids"], lm),
}


@pytest.mark.parametrize("name", KEYED)
def test_keyed_dropout_is_proven_and_the_probe_skipped_with_the_same_result(name, monkeypatch):
    """Dropout in training, keyed per example (the engine's step): the graph proof holds (each mask's rows are
    each example's own), so steps after the first (or, with a ``loss_fn``, the first two) skip the probe; with the proof off every step is probed,
    and the weights are the same bit for bit."""
    make, data, labels, loss = KEYED[name]
    torch.manual_seed(0)
    x = data(24)
    y = labels(x, 24)
    torch.manual_seed(1)
    proven, probes, proofs = _keyed_steps(make(), x, y, loss)
    assert proofs.last is None and probes <= 2 and proofs.hits == 4 - probes  # (first steps: probed)
    monkeypatch.setattr(proof, "ENABLED", False)
    torch.manual_seed(1)
    probed, every, _ = _keyed_steps(make(), x, y, loss)
    assert every == 4
    for a, b in zip(proven, probed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["mix", "seq_first"])
def test_keyed_dropout_on_rows_that_mix_examples_is_not_proven_and_the_probe_refuses_it(how):
    """A batch mean before the dropout, or dropout on a sequence-first ``[T, B, F]`` (T = B: its mask's rows are
    positions, each example's mask spread over the others): not proven, and the probe refuses the step."""
    torch.manual_seed(0)
    x = torch.randn(24, 6, 6) if how == "seq_first" else torch.randn(24, 6)
    y = torch.randint(0, 3, (24,))
    with pytest.raises(PathRefusal):  # (sequence-first: alone, its dropout input is not batch-first)
        _keyed_steps(Dropped(**{how: True}), x, y)
