"""Hugging Face models as they come (default SDPA attention, padding masks, attention dropout): the fast
path equal to the rows path where both run, each equal to an independent per-example computation where
only one does; grad_path="auto" falling back; attention dropout keyed per example."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          RobertaConfig, RobertaForSequenceClassification, ViTConfig, ViTForImageClassification)

from clipbias.config import AlgoConfig  # noqa: E402
from clipbias.engine import DPEngine  # noqa: E402
from clipbias.engine import aggregate  # noqa: E402
from clipbias.errors import PathRefusal  # noqa: E402
from clipbias.randomness import SecretKey, forward  # noqa: E402

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def bert(drop: float = 0.0, attn: str | None = None, attn_drop: float | None = None) -> nn.Module:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, max_position_embeddings=16, num_labels=2, hidden_dropout_prob=drop,
                     attention_probs_dropout_prob=drop if attn_drop is None else attn_drop, **TINY)
    return BertForSequenceClassification._from_config(cfg, **({"attn_implementation": attn} if attn else {}))


def roberta(drop: float = 0.0, attn: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    cfg = RobertaConfig(vocab_size=50, max_position_embeddings=20, num_labels=2, hidden_dropout_prob=drop,
                        attention_probs_dropout_prob=drop, pad_token_id=1, **TINY)
    return RobertaForSequenceClassification._from_config(cfg, **({"attn_implementation": attn} if attn else {}))


def vit() -> nn.Module:
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=16, patch_size=8, num_channels=3, num_labels=3, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, **TINY)
    return ViTForImageClassification(cfg)


def gpt2(drop: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_inner=64, vocab_size=50, n_positions=16, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=drop, embd_pdrop=drop, attn_pdrop=drop)
    return GPT2LMHeadModel(cfg)


def classify(out, y):
    return nn.functional.cross_entropy(out.logits, y, reduction="none")


def lm(out, y):
    """Next-token cross-entropy summed per sequence (labels -100 ignored)."""
    logits = out.logits[:, :-1]
    return nn.functional.cross_entropy(logits.transpose(1, 2), y[:, 1:], ignore_index=-100, reduction="none").sum(1)


def tokens(b: int, T: int, lens: list[int], pad: int = 0, seed: int = 1) -> dict:
    """Right-padded token ids (never the pad id) with their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 50, (b, T), generator=g)
    mask = (torch.arange(T) < torch.tensor(lens).unsqueeze(1)).long()
    return {"input_ids": ids.masked_fill(mask == 0, pad), "attention_mask": mask}


def step(model: nn.Module, x, y, path: str, loss, algo: str = "dpsgd", clip: float = 0.05,
         seed: int = 3) -> torch.Tensor:
    """The model's parameters after one step on all n examples (q = 1) under a fixed key."""
    n = len(y)
    e = DPEngine(model, algo, n=n, batch_size=n, steps=1, noise_multiplier=None if algo == "clip-sgd" else 0.5,
                 noise_seed=seed, loss_fn=loss, grad_path=path, config=AlgoConfig(lr=1.0, clip=clip))
    idx = e.sampler.sample()
    assert len(idx) == n
    e.step(x, y[idx], idx)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def independent_clipped_sum(model: nn.Module, x: dict, y: torch.Tensor, loss, clip: float) -> torch.Tensor:
    """sum_i clip(grad of example i's loss), one torch.autograd.grad per example (its row of the batch run
    alone), in the model's float64."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for i in range(len(y)):
        out = model(**{k: v[i:i + 1] for k, v in x.items()})
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss(out, y[i:i + 1]).sum(), params)])
        total += g * min(1.0, clip / float(g.norm()))
    return total


@pytest.mark.parametrize("make,attn", [(bert, None), (bert, "eager"), (roberta, None)])
def test_padded_encoders_fast_path_equals_rows_path(make, attn):
    """BERT and RoBERTa as they come (SDPA by default; eager too), a padding attention_mask, hidden and
    attention dropout: one float64 DP-SGD step under one key on the fast path equals the rows path (which
    runs the examples one at a time: vmap cannot run transformers' mask code), masks and noise included."""
    x, y = tokens(5, 8, [8, 5, 3, 8, 6], pad=1 if make is roberta else 0), torch.tensor([0, 1, 1, 0, 1])
    assert make(attn=attn).config._attn_implementation == (attn or "sdpa")
    before = flat(make(0.1, attn).double())
    after = {}
    for path in ("rows", "fast"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            after[path] = step(make(0.1, attn).double().train(), x, y, path, classify)
        assert (path == "rows") == any("one example at a time" in str(w.message) for w in seen)
    assert (after["fast"] - before).norm() > 1e-2
    torch.testing.assert_close(after["fast"], after["rows"], rtol=0, atol=1e-10)


def test_vit_fast_path_equals_rows_path_and_rows_equal_independent_gradients():
    """ViT (SDPA, image 16, patch 8): the rows path's clipped sum equals per-example autograd in a loop; the
    fast path (its cls token and position embeddings by the ViTEmbeddings rule, grads.layers.vit) equals the rows
    path, fully fine-tuned and with them frozen (tests/test_vit_fast.py: dropout, refusals)."""
    x = {"pixel_values": torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)}
    y = torch.tensor([0, 2, 1, 2])
    model = vit().double()
    assert model.config._attn_implementation == "sdpa"
    want = independent_clipped_sum(vit().double(), x, y, classify, 0.5)
    before = flat(model)
    got = (before - step(model, x, y, "rows", classify, algo="clip-sgd", clip=0.5)) * 4
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for frozen in (False, True):
        after = {}
        for path in ("rows", "fast"):
            m = vit().double()
            m.vit.embeddings.cls_token.requires_grad_(not frozen)
            m.vit.embeddings.position_embeddings.requires_grad_(not frozen)
            after[path] = step(m, x, y, path, classify)
        torch.testing.assert_close(after["fast"], after["rows"], rtol=0, atol=1e-10)


def test_gpt2_sdpa_with_padding_rows_equal_independent_gradients():
    """GPT-2 as it comes (SDPA, lm_head tied to wte) on a right-padded batch with
    its attention mask: the rows path's clipped sum equals per-example autograd in a loop. With its Conv1D
    layers and the tied embedding frozen (position embeddings and LayerNorms trained) and dropout 0.1, attention
    dropout included, the fast path's clipped sum equals the rows path's, and the masks were drawn."""
    x = tokens(4, 9, [9, 4, 6, 2])
    y = x["input_ids"].masked_fill(x["attention_mask"] == 0, -100)
    model = gpt2().double()
    assert model.config._attn_implementation == "sdpa"
    want = independent_clipped_sum(gpt2().double(), x, y, lm, 1.0)
    before = flat(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the examples one at a time (vmap cannot run the mask code)
        got = (before - step(model, x, y, "rows", lm, algo="clip-sgd", clip=1.0)) * 4
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert want.norm() > 0.5

    def partly(drop: float) -> nn.Module:
        m = gpt2(drop).double().train()
        for name, p in m.named_parameters():
            p.requires_grad_("wpe" in name or ".ln_" in name or "ln_f" in name)
        return m

    after = {}
    for path, drop in (("rows", 0.1), ("fast", 0.1), ("fast", 0.0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            after[path, drop] = step(partly(drop), x, y, path, lm, algo="clip-sgd", clip=1.0)
    torch.testing.assert_close(after["fast", 0.1], after["rows", 0.1], rtol=0, atol=1e-12)
    assert (after["fast", 0.1] - after["fast", 0.0]).norm() > 1e-2


def test_auto_falls_back_once_and_releases_once():
    """BERT with a padding mask under grad_path="auto": auto picks the rows path, vmap refuses the mask code at
    the first step, and the step runs on the fast path: the weights, the next batch and epsilon are those of
    grad_path="fast" under the same key (one noise draw, one batch, one accounted step), with a warning and
    the switch recorded; later steps stay on the fast path. Explicit grad_path="fast" still refuses what it
    refuses."""
    x, y = tokens(8, 8, [8, 5, 3, 8, 6, 7, 2, 8]), torch.arange(8) % 2
    runs = {}
    for path, bands in (("auto", 1), ("fast", 1), ("auto", 2), ("fast", 2)):  # bands: a refused step gives back
        m = bert(0.1).train()                                                 # its batch; a fall-back keeps it
        e = DPEngine(m, "dpsgd", n=8, batch_size=4 / bands, steps=3, noise_multiplier=1.0, noise_seed=5,
                     loss_fn=classify, grad_path=path, bands=bands, config=AlgoConfig(lr=0.5, clip=1.0))
        assert (e.fast is None) == (path == "auto")
        idx = e.sampler.sample()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            e.step({k: v[idx] for k, v in x.items()}, y[idx], idx)
        fell = [str(w.message) for w in seen if "grad_path='auto'" in str(w.message)]
        runs[path, bands] = (flat(m), e.sampler.sample(), e.privacy().epsilon, e.steps_taken, fell, e)
    for bands in (1, 2):
        auto, fast = runs["auto", bands], runs["fast", bands]
        torch.testing.assert_close(auto[0], fast[0], rtol=0, atol=1e-6)
        assert torch.equal(auto[1], fast[1]) and auto[2] == fast[2] and auto[3] == fast[3] == 1
        assert len(auto[4]) == 1 and "rows path refused" in auto[4][0] and not fast[4]
    e = runs["auto", 1][5]
    assert e.fast is not None and e.grad_path_fallback.startswith("rows -> fast: torch.func.vmap")
    assert "took it at the first step" in e.grad_path_note

    class Twice(nn.Module):  # one Linear used twice: the fast path's per-layer norm would understate it
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.head = nn.Linear(6, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))

    xs, ys = torch.randn(10, 6, generator=torch.Generator().manual_seed(0)), torch.arange(10) % 2
    with pytest.raises(PathRefusal, match="runs twice"):
        torch.manual_seed(0)
        step(Twice(), xs, ys, "fast", nn.functional.cross_entropy)
    got = {}
    for path in ("auto", "rows"):
        torch.manual_seed(0)
        mp = pytest.MonkeyPatch()
        mp.setattr(aggregate, "AUTO_ROWS_BYTES", 0)  # auto takes the fast path wherever it applies
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                got[path] = step(Twice(), xs, ys, path, lambda o, t: nn.functional.cross_entropy(o, t, reduction="sum"))
        finally:
            mp.undo()
        assert (path == "auto") == any("fast path refused" in str(w.message) for w in seen)
    torch.testing.assert_close(got["auto"], got["rows"], rtol=0, atol=1e-6)

    class Branches(Twice):  # and a branch on tensor values, which vmap cannot run: refused by both paths' first try
        def forward(self, x):
            return super().forward(x if bool(x.sum() > -1e9) else -x)

    for path in ("auto", "rows"):
        torch.manual_seed(0)
        m = Branches()
        e = DPEngine(m, "dpsgd", n=10, batch_size=10, steps=2, noise_multiplier=0.5, noise_seed=3, grad_path=path,
                     config=AlgoConfig(lr=1.0, clip=0.05),
                     loss_fn=lambda o, t: nn.functional.cross_entropy(o, t, reduction="sum"))
        idx = e.sampler.sample()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            e.step(xs[idx], ys[idx], idx)
        got[path] = (flat(m), e)
    torch.testing.assert_close(got["auto"][0], got["rows"][0], rtol=0, atol=1e-6)
    e = got["auto"][1]
    assert e.fast is None and e.steps_taken == 1 and got["rows"][1].grad_path_fallback is None
    assert e.grad_path_fallback.startswith("rows -> fast: torch.func.vmap")
    assert "; then fast -> rows: `grad_path='fast'`: a Linear layer runs twice" in e.grad_path_fallback
    assert e.rows.grads.unvectorizable == "loop" and not e.rows.grads.vectorized  # outside a step: one at a time


def test_sdpa_attention_dropout_is_keyed_per_example_in_bert():
    """BERT (SDPA) with attention dropout only, in the engine's batched forward: example 7's logits are the
    same beside examples 3 and 9, alone, or in another order (its masks are its own), and differ under
    another step (the masks are drawn)."""
    model = bert(attn_drop=0.5).double().train()
    x = tokens(10, 8, [8, 5, 3, 8, 6, 7, 2, 8, 4, 8])
    key = SecretKey.from_seed(4)

    def logits(ids, step=0):
        with torch.no_grad(), forward.keyed(key, step), forward.examples(ids), forward.one_pass() as seen:
            out = model(**{k: v[ids] for k, v in x.items()}).logits
        assert seen.calls >= 2  # an attention dropout call per layer
        return out

    mine = logits([3, 7, 9])[1]
    for ids, row in (([7], 0), ([9, 2, 7], 2)):
        torch.testing.assert_close(logits(ids)[row], mine, rtol=0, atol=1e-12)
    assert (logits([7], step=1)[0] - mine).abs().max() > 1e-6
    model.eval()
    with torch.no_grad():
        plain = model(**{k: v[[7]] for k, v in x.items()}).logits[0]
    assert (plain - mine).abs().max() > 1e-6 and math.isfinite(float(mine.sum()))


class Sentences(torch.utils.data.Dataset):
    """``n`` token sequences of lengths 3..8 labelled by their first token."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids, self.lens = torch.randint(2, 50, (n, 8), generator=g), torch.randint(3, 9, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        x = self.ids[i, :int(self.lens[i])]
        return {"input_ids": x, "labels": (x[0] > 25).long()}


def pad_collate(items: list) -> dict:
    """Right padding to the batch's longest (BERT reads position 0 under its padding mask: it ignores padding)."""
    T = max(len(it["input_ids"]) for it in items)
    out = tokens(len(items), T, [len(it["input_ids"]) for it in items])
    for r, it in enumerate(items):
        out["input_ids"][r, :len(it["input_ids"])] = it["input_ids"]
    out["labels"] = torch.stack([it["labels"] for it in items])
    return out


def test_private_fine_tuning_of_bert_as_it_comes(tmp_path):
    """BERT as it comes (SDPA, dropout 0.1, padding masks) fine-tuned privately: three DPEngine steps with a
    loss reading out.logits, and two DPTrainer steps (grad_path="auto": rows refused by vmap, the fast path
    takes the run); both move the weights, report epsilon and record the path."""
    from transformers import TrainingArguments
    from clipbias.integrations.transformers import DPArguments, DPTrainer
    data = Sentences(24)
    model = bert(0.1).train()
    before = flat(model)
    e = DPEngine(model, "dpsgd", n=24, batch_size=6, steps=3, noise_multiplier=1.0, delta=1e-4, loss_fn=classify,
                 config=AlgoConfig(lr=0.1, clip=1.0))
    for _ in range(3):
        idx = e.sampler.sample()
        b = pad_collate([data[int(i)] for i in idx])
        y = b.pop("labels")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses = e.step(b, y, idx)
        assert torch.isfinite(losses).all()
    report = e.privacy()
    assert (flat(model) - before).norm() > 1e-3 and 0 < report.epsilon < 100 and report.certified
    assert e.steps_taken == 3 and e.grad_path_fallback.startswith("rows -> fast")

    model = bert(0.1)
    before = flat(model)
    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, learning_rate=0.05,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = DPTrainer(model=model, args=args, train_dataset=data, data_collator=pad_collate,
                        dp_args=DPArguments(noise_multiplier=1.0, max_grad_norm=1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.dp_engine.steps_taken == 2 and trainer.dp_engine.fast is not None
    assert (flat(model) - before).norm() > 1e-4
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and logged[-1]["epsilon"] == pytest.approx(trainer.privacy_report().epsilon)
