"""Fetch and collate a function of the example alone (``clipbias.sampling.refetch``): a Dataset or collate
that draws by fetch order (its own seeded generator, a counter, torch's global generator, Hugging Face's MLM
collator with a seed) or whose rows depend on the batch (padding to the batch's longest for a model that
reads the padding, in-batch statistics) makes the run uncertified, with the caveat and a warning; a
deterministic one, right padding with an attention mask, and draws from ``clipbias.example_generator``
(keyed per example, in workers too) stay certified."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import clipbias
from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError
from clipbias.randomness.example import ExampleGenerator, fetching
from clipbias.randomness.key import Purpose, SecretKey
from clipbias.sampling.loader import PoissonLoader

N, D, K = 60, 5, 3


def data(n=N):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g)


class Pairs(Dataset):
    def __init__(self, n=N):
        self.x, self.y = data(n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class SeededNumpy(Pairs):
    """Augmentation from the dataset's own seeded numpy generator, by fetch order."""

    def __init__(self, n=N):
        super().__init__(n)
        self.rng = np.random.default_rng(42)

    def __getitem__(self, i):
        return self.x[i] + torch.from_numpy(self.rng.normal(size=D)).float(), self.y[i]


class Counter(Pairs):
    """A stateful counter in __getitem__."""

    def __init__(self, n=N):
        super().__init__(n)
        self.calls = 0

    def __getitem__(self, i):
        self.calls += 1
        return self.x[i] * (1 + self.calls % 3), self.y[i]


class TorchGlobal(Pairs):
    """Augmentation from torch's global generator (as torchvision's random transforms draw)."""

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(D), self.y[i]


class Keyed(Pairs):
    """Augmentation from clipbias.example_generator(): keyed per example and step."""

    def __getitem__(self, i):
        g = clipbias.example_generator()
        flip = g.bernoulli(0.5)
        return torch.where(flip, -self.x[i], self.x[i]) + 0.1 * g.randn(D), self.y[i]


def linear():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))


def engine(model=None, n=N, **kw):
    return DPEngine(model or linear(), "dpsgd", n=n, batch_size=12.0, epochs=1, noise_multiplier=1.0,
                    config=AlgoConfig(lr=0.5, clip=1.0), **kw)


def train(dataset, eng=None, **loader):
    """One epoch through the private loader; the engine and clipbias's warnings."""
    eng = eng or engine(n=len(dataset))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        eng.train_epoch(dataset, **loader)
    return eng, [str(w.message) for w in seen if "no longer certified" in str(w.message)]


def uncertified(eng, warned, words):
    report = eng.privacy()
    assert not report.certified and any(words in c for c in report.caveats), report.caveats
    assert len(warned) == 1 and words in warned[0]  # one warning, at the first occurrence


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_drawing_from_its_own_seeded_generator_is_uncertified(workers):
    eng, warned = train(SeededNumpy(), num_workers=workers)
    uncertified(eng, warned, "example_generator")
    assert eng.fetch_caveats == {"random": eng.steps_taken}


def test_a_counter_in_getitem_is_uncertified():
    eng, warned = train(Counter())
    uncertified(eng, warned, "collated alone twice came out different")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_drawing_from_torchs_global_generator_is_uncertified(workers):
    eng, warned = train(TorchGlobal(), num_workers=workers)
    uncertified(eng, warned, "torch's global generator")


@pytest.mark.parametrize("dataset", [Pairs, Keyed])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_deterministic_or_keyed_dataset_stays_certified(dataset, workers):
    eng, warned = train(dataset(), num_workers=workers)
    assert eng.privacy().certified and not warned and not getattr(eng, "fetch_caveats", None)


def test_keyed_draws_are_the_examples_own_in_workers_and_resumed():
    """example_generator's draws are a function of (key, step, example): workers and the main process train
    to the same weights bit for bit, and a dataset or batch with another example leaves example i's draws."""
    runs = []
    for workers in (0, 2):
        eng, _ = train(Keyed(), engine(noise_seed=5), num_workers=workers)
        runs.append(torch.cat([p.detach().flatten() for p in eng.model.parameters()]))
    assert torch.equal(*runs)
    small, big = PoissonLoader(engine(noise_seed=5), Keyed()), PoissonLoader(engine(n=N + 1, noise_seed=5), Keyed(N + 1))
    alone = small.fetch.fetched([7], 3)[0][0]
    assert torch.equal(small.fetch.fetched([2, 7, 9], 3)[0][1], alone)
    assert torch.equal(big.fetch.fetched([0, 7, N], 3)[0][1], alone)
    assert not torch.equal(small.fetch.fetched([7], 4)[0][0], alone)  # another step: fresh draws


def test_example_generator_in_a_collate_and_outside_a_fetch():
    """In a collate, example_generator(j) is the j-th item's (its draws the same in any batch); without a
    position there it is refused, and outside a private fetch it raises."""
    key = SecretKey.from_seed(3)

    def collate(items):
        return torch.stack([clipbias.example_generator(j).uniform(4) for j in range(len(items))])

    with fetching(key, 2, [5, 1, 8], collate=True):
        batch = collate([None] * 3)
        with pytest.raises(ConfigError, match="position"):
            clipbias.example_generator()
    with fetching(key, 2, [1], collate=True):
        assert torch.equal(collate([None])[0], batch[1])
    with pytest.raises(ConfigError, match="no private fetch"):
        clipbias.example_generator()


def test_example_generator_draws():
    """Uniform floats (exact in their dtype, below 1), integers, normals, bernoulli and permutations; every
    call a stream of its own read from its start (a draw of [L, k] is the first L rows of one of [L', k])."""
    g = ExampleGenerator(SecretKey.from_seed(1), Purpose.EXAMPLE_FETCH, 7, 11)
    u = g.uniform(20000, dtype=torch.float32)
    assert u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    z = g.randn(200, 100)
    assert z.shape == (200, 100) and abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02
    i = g.integers(3, 9, size=(1000,))
    assert i.dtype == torch.int64 and set(i.tolist()) == set(range(3, 9))
    b = g.bernoulli(torch.tensor([0.0, 1.0, 0.25]).expand(4000, 3))
    assert b.dtype == torch.bool and not b[:, 0].any() and b[:, 1].all() and abs(float(b[:, 2].float().mean()) - 0.25) < 0.03
    assert sorted(g.permutation(50).tolist()) == list(range(50))
    first = [ExampleGenerator(SecretKey.from_seed(1), Purpose.EXAMPLE_FETCH, 7, 11) for _ in range(2)]
    short, long = first[0].uniform(3, 4, dtype=torch.float64), first[1].uniform(9, 4, dtype=torch.float64)
    assert torch.equal(long[:3], short) and torch.equal(first[0].uniform(2), first[1].uniform(2))
    assert not torch.equal(g.uniform(2), first[0].uniform(2))


class Sequences(Dataset):
    """Names as sequences of lengths 2..8 (one feature per time step) and a class."""

    def __init__(self, n=N):
        g = torch.Generator().manual_seed(2)
        self.lens = torch.randint(2, 9, (n,), generator=g)
        self.x = torch.randn(n, 8, 1, generator=g)
        self.y = torch.randint(0, K, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i, :int(self.lens[i])], self.y[i]


def pad_to_longest(items):
    """Opacus's char-LSTM collate: pad each batch to its longest sequence."""
    seqs = nn.utils.rnn.pad_sequence([x for x, _ in items], batch_first=True)
    return seqs, torch.stack([y for _, y in items])


def pad_to_8(items):
    return torch.stack([nn.functional.pad(x, (0, 0, 0, 8 - len(x))) for x, _ in items]), torch.stack([y for _, y in items])


class LastStep(nn.Module):
    """A running-sum sequence classifier reading the last time step, padding included."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(1, 6), nn.Linear(6, K)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)).cumsum(1)[:, -1])


def test_padding_to_the_batchs_longest_for_a_model_reading_the_last_step_is_uncertified():
    eng, warned = train(Sequences(), engine(LastStep(), grad_path="rows"), collate_fn=pad_to_longest)
    uncertified(eng, warned, "pads each batch to its longest example")
    eng, warned = train(Sequences(), engine(LastStep(), grad_path="rows"), collate_fn=pad_to_8)  # a fixed length
    assert eng.privacy().certified and not warned


def test_a_collate_with_in_batch_statistics_is_uncertified():
    def centred(items):
        x = torch.stack([x for x, _ in items])
        return x - x.mean(0), torch.stack([y for _, y in items])

    eng, warned = train(Pairs(), collate_fn=centred)
    uncertified(eng, warned, "depend on the other examples")


class Tokens(Sequences):
    def __getitem__(self, i):
        ids = (self.x[i, :int(self.lens[i]), 0].abs() * 10).long() + 1
        return {"input_ids": ids, "labels": ids.clone()}


def hf_collate(side="right", label_pad=-100):
    def collate(items):
        T = max(len(it["input_ids"]) for it in items)
        pad = (lambda t, v: nn.functional.pad(t, (0, T - len(t)), value=v)) if side == "right" else \
            (lambda t, v: nn.functional.pad(t, (T - len(t), 0), value=v))
        return {"input_ids": torch.stack([pad(it["input_ids"], 0) for it in items]),
                "attention_mask": torch.stack([pad(torch.ones_like(it["input_ids"]), 0) for it in items]),
                "labels": torch.stack([pad(it["labels"], label_pad) for it in items])}
    return collate


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(64, 4), nn.Linear(4, 64)

    def forward(self, input_ids, attention_mask):
        return self.out(self.emb(input_ids))


def token_loss(logits, labels):
    tok = nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return tok.sum(1) / (labels != -100).sum(1).clamp(min=1)


@pytest.mark.parametrize("side,label_pad,caveat", [("right", -100, None), ("left", -100, "pads on the left"),
                                                   ("right", 0, "pads labels")])
def test_hugging_face_padding(side, label_pad, caveat):
    """A dict with an attention_mask 0 on right padding and labels -100 there (the model ignores the padding)
    stays certified; left padding, or labels padded with a token, is reported."""
    eng = engine(TokenModel(), loss_fn=token_loss, grad_path="rows")
    eng, warned = train(Tokens(), eng, collate_fn=hf_collate(side, label_pad))
    if caveat is None:
        assert eng.privacy().certified and not warned
    else:
        uncertified(eng, warned, caveat)


def test_what_the_check_saw_survives_a_checkpoint():
    eng, _ = train(Counter())
    again = engine()
    again.load_state_dict(eng.state_dict())
    assert again.fetch_caveats == eng.fetch_caveats and not again.privacy().certified


# ------------------------------------------------------------------ Hugging Face's MLM collator
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    vocab = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(40)]))
    return transformers.BertTokenizer(str(vocab))


class Sentences(Dataset):
    def __init__(self, tokenizer, n=24):
        g = torch.Generator().manual_seed(4)
        lens = torch.randint(3, 12, (n,), generator=g)
        self.items = [dict(tokenizer(" ".join(f"w{int(w)}" for w in torch.randint(0, 40, (int(m),), generator=g))))
                      for m in lens]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def mlm_loss(out, labels):
    return token_loss(out.logits, labels)


def bert_mlm():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=45, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=20, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM._from_config(cfg, attn_implementation="eager")


def test_hugging_faces_mlm_collator_with_a_seed_is_uncertified_and_keyed_under_dptrainer(tokenizer, tmp_path):
    from clipbias.integrations.transformers import DPArguments, DPTrainer, keyed_collator
    data = Sentences(tokenizer)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, seed=42)
    eng = DPEngine(bert_mlm(), "dpsgd", n=len(data), batch_size=6, steps=3, noise_multiplier=1.0,
                   loss_fn=mlm_loss, config=AlgoConfig(lr=0.1, clip=1.0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for x, y, idx in PoissonLoader(eng, data, collate_fn=collator).epoch(3):
            eng.step(x, y, idx)
    # (the seeded collator's draws go by fetch order: the example alone twice differs, "random", or, where its two
    # draws alone happen to agree (a short sentence masked alike), its row in the batch differs, "batch")
    assert not eng.privacy().certified and {"random", "batch"} & set(eng.fetch_caveats), eng.fetch_caveats
    assert any("no longer certified" in str(w.message) for w in seen)

    keyed = keyed_collator(collator)  # the same rule, each example's masks from its own keyed stream
    key = SecretKey.from_seed(9)
    with fetching(key, 1, [3, 5, 8], collate=True):
        batch = keyed([data[3], data[5], data[8]])
    with fetching(key, 1, [5], collate=True):
        alone = keyed([data[5]])
    L = alone["input_ids"].shape[1]
    assert all(torch.equal(batch[k][1, :L], alone[k][0]) for k in ("input_ids", "labels"))
    assert (batch["labels"] != -100).any()

    args = transformers.TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=3,
                                          gradient_accumulation_steps=2, max_steps=3, learning_rate=0.05,
                                          save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = DPTrainer(model=bert_mlm(), args=args, train_dataset=data, data_collator=collator,
                        dp_args=DPArguments(noise_multiplier=1.0, max_grad_norm=1.0, per_example_loss=mlm_loss))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    report = trainer.privacy_report()
    assert report.certified, report.caveats
    assert not any("no longer certified" in str(w.message) for w in seen)


# ------------------------------------------------------------------ every door: one loader, one check
def test_the_opacus_interface_and_the_lightning_callback_go_through_the_check():
    """``PrivacyEngine``'s data loader and ``DPCallback``'s train loader are the private loader: a counter in
    ``__getitem__`` is reported by each (``DPTrainer``: the MLM test above)."""
    from torch.utils.data import DataLoader
    model = linear()
    pe = clipbias.PrivacyEngine()
    model, opt, loader = pe.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         data_loader=DataLoader(Counter(), batch_size=12), noise_multiplier=1.0,
                                         max_grad_norm=1.0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    assert "random" in pe.engine.fetch_caveats and not pe.privacy_report().certified

    L = pytest.importorskip("lightning")
    from clipbias.integrations.lightning import DPCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = linear()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[dp])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        trainer.fit(Module(), DataLoader(Counter(), batch_size=12))
    assert "random" in dp.engine.fetch_caveats and not dp.engine.privacy().certified


class LastTokenModel(TokenModel):
    """Pools the last position of every row, masked or not (XLNet's summary_type="last" under right padding)."""

    def forward(self, input_ids, attention_mask):
        return self.out(self.emb(input_ids))[:, -1:].expand(-1, input_ids.shape[1], -1)


def test_a_model_that_reads_the_masked_padding_is_held_to_it():
    """Right padding with an attention_mask is taken to be ignored by the model; the step holds the model to it
    (its outputs for the checked example alone and as its padded row): a model pooling the last position,
    masked or not, moved the other examples' clipped sum by 4.62 C through the padding (a stock XLNet,
    certified); it is now reported. The model that ignores the padding stays certified (above)."""
    eng = engine(LastTokenModel(), loss_fn=token_loss, grad_path="rows")
    eng, warned = train(Tokens(), eng, collate_fn=hf_collate())
    uncertified(eng, warned, "reads masked positions")
