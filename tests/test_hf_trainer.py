"""DPTrainer (clipbias.integrations.transformers): Hugging Face's Trainer on the engine's Poisson batches,
checked against the engine run by hand, the accountant, the model's own loss and a resumed run."""

from __future__ import annotations

import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          TrainingArguments)

from clipbias import algorithms, privacy  # noqa: E402
from clipbias.config import AlgoConfig  # noqa: E402
from clipbias.engine import DPEngine  # noqa: E402
from clipbias.errors import ConfigError  # noqa: E402
from clipbias.integrations.transformers import (DPArguments, DPTrainer, PerExampleIds, causal_lm_loss,  # noqa: E402
                                                sequence_classification_loss)
from clipbias.sampling.loader import PoissonLoader  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    """``n`` random token sequences of lengths 4..T (labels: a class, or the tokens for a causal LM)."""

    def __init__(self, n: int, T: int, causal: bool, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 100, (n, T), generator=g)
        self.lens = torch.randint(4, T + 1, (n,), generator=g) if causal else torch.full((n,), T)
        self.causal = causal

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        x = self.ids[i, :int(self.lens[i])]
        return {"input_ids": x, "labels": x.clone() if self.causal else (x[0] > 50).long()}


def collate(items: list) -> dict:
    """Right padding to the batch's longest (sound for these models: causal GPT-2, and BERT on sequences of
    one length), labels padded with -100."""
    T = max(len(it["input_ids"]) for it in items)
    pad = lambda t, v: torch.nn.functional.pad(t, (0, T - len(t)), value=v)  # noqa: E731
    out = {"input_ids": torch.stack([pad(it["input_ids"], 0) for it in items]),
           "attention_mask": torch.stack([pad(torch.ones_like(it["input_ids"]), 0) for it in items])}
    lab = [it["labels"] for it in items]
    out["labels"] = torch.stack([pad(t, -100) for t in lab]) if lab[0].dim() else torch.stack(lab)
    return out


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                     num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification._from_config(cfg, attn_implementation="eager")


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")


def targs(tmp_path, **kw) -> TrainingArguments:
    base = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=0.05, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant")
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def test_bert_trainer_takes_exactly_the_engines_steps(tmp_path):
    """Three steps of DPTrainer (B = 4 x 2 = 8, gradient accumulation in 2 chunks) leave BERT's weights where
    a DPEngine stepped by hand on the same key's Poisson batches leaves them; epsilon is the accountant's."""
    data, seed, z = Tokens(32, 8, causal=False), 7, 1.0
    model = bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    held_out = Tokens(16, 8, causal=False, seed=2)  # (evaluating on the training set is refused)
    trainer = DPTrainer(model=model, args=targs(tmp_path, max_steps=3), train_dataset=data, eval_dataset=held_out,
                        data_collator=PerExampleIds(collate), optimizers=(opt, None),
                        dp_args=DPArguments(noise_multiplier=z, max_grad_norm=1.0, grad_path="fast", noise_seed=seed))
    trainer.train()
    ref = bert()
    engine = DPEngine(ref, "dpsgd", n=32, batch_size=8, noise_multiplier=z, delta=1e-5, noise_seed=seed,
                      config=AlgoConfig(clip=1.0), loss_fn=sequence_classification_loss(2), grad_path="fast",
                      optimizer=torch.optim.SGD(ref.parameters(), lr=0.05), max_physical_batch=4)
    for x, y, idx in PoissonLoader(engine, data, collate_fn=PerExampleIds(collate), device="cpu").epoch(3):
        engine.step(x, y, idx)
    moved = 0.0
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), bert().parameters()):
        assert torch.allclose(p, q, atol=1e-6), name
        moved += float((p - p0).detach().norm() ** 2)
    assert moved > 0
    spec = algorithms.get("dpsgd").spec(AlgoConfig(clip=1.0), 8 / 32, z, 8.0)
    report = trainer.privacy_report()
    assert report.epsilon == pytest.approx(privacy.account(spec, 3, 1e-5, "pld").epsilon, rel=1e-9)
    assert report.certified is False and "seed" in " ".join(report.caveats)  # noise_seed: uncertified
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3 and logged[-1]["epsilon"] == pytest.approx(report.epsilon)
    assert math.isfinite(trainer.evaluate()["eval_loss"])


def test_gpt2_causal_lm_calibrated_to_target_epsilon(tmp_path):
    """target_epsilon: the noise is the engine's calibration for the planned steps; the run is certified and
    ends at the target or just below; the per-example loss is the model's own token-averaged loss."""
    data, model = Tokens(24, 10, causal=True), gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = DPTrainer(model=model, args=targs(tmp_path, max_steps=3, per_device_train_batch_size=3),
                        train_dataset=data, data_collator=collate,
                        dp_args=DPArguments(target_epsilon=3.0, target_delta=1e-4, max_grad_norm=1.0, grad_path="rows"))
    out = trainer.train()
    independent = DPEngine(gpt2(), "dpsgd", n=24, batch_size=6, steps=3, epsilon=3.0, delta=1e-4,
                           config=AlgoConfig(clip=1.0), loss_fn=causal_lm_loss)
    report = trainer.privacy_report()
    assert trainer.dp_engine.noise_multiplier == independent.noise_multiplier
    assert report.epsilon == pytest.approx(independent.privacy(3).epsilon, rel=1e-9) and report.epsilon <= 3.0
    assert report.certified and out.global_step == 3 and math.isfinite(out.training_loss)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    batch = collate([data[i] for i in range(5)])
    labels = batch.pop("labels")
    model.eval()
    with torch.no_grad():
        per = causal_lm_loss(model(**batch), labels)
        for i in range(5):
            own = model(**{k: v[i:i + 1, :int(data.lens[i])] for k, v in batch.items()},
                        labels=labels[i:i + 1, :int(data.lens[i])]).loss
            assert per[i] == pytest.approx(float(own), rel=1e-5)


def test_lora_gpt2_trains_only_its_adapters(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(gpt2(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"],
                                                        fan_in_fan_out=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPTrainer(model=model, args=targs(tmp_path, max_steps=2), train_dataset=Tokens(24, 10, causal=True),
                        data_collator=collate, dp_args=DPArguments(noise_multiplier=1.0, grad_path="rows"))
    trainer.train()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert trainer.dp_engine.rows.layout.dim == sum(p.numel() for p in model.parameters() if p.requires_grad)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n not in trainable), n  # the base is bit-identical
    assert trainer.privacy_report().certified


def test_a_checkpoint_resumes_the_same_run(tmp_path):
    """A checkpoint holds the engine's private state; resuming from it continues the batches, the noise and
    the accounting exactly: the weights equal those of the uninterrupted run."""
    data = Tokens(24, 8, causal=True)
    dp = dict(noise_multiplier=1.0, grad_path="rows", noise_seed=3)

    def trainer(out, steps, **kw):
        model = gpt2()
        return DPTrainer(model=model, args=targs(tmp_path / out, max_steps=steps, **kw), train_dataset=data,
                         data_collator=collate, optimizers=(torch.optim.SGD(model.parameters(), lr=0.05), None),
                         dp_args=DPArguments(**dp))
    straight = trainer("a", 4)
    straight.train()
    first = trainer("b", 4, save_strategy="steps", save_steps=2)
    first.train()
    ckpt = tmp_path / "b" / "out" / "checkpoint-2"
    assert (ckpt / "dp_engine.pt").is_file()
    resumed = trainer("c", 4)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.dp_engine.steps_taken == 4 and resumed.state.global_step == 4
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert resumed.privacy_report().epsilon == pytest.approx(straight.privacy_report().epsilon)
    os.remove(ckpt / "dp_engine.pt")
    with pytest.raises(ConfigError, match="no private state"):
        trainer("d", 4).train(resume_from_checkpoint=str(ckpt))


@pytest.mark.parametrize("kw, dp, match", [
    (dict(bf16=True), {}, "16-bit sums"),
    (dict(fp16=True), {}, "16-bit sums"),
    (dict(train_sampling_strategy="group_by_length"), {}, "Poisson"),
    (dict(auto_find_batch_size=True), {}, "expected batch size"),
    ({}, dict(target_epsilon=3.0), "exactly one of"),
    ({}, dict(noise_multiplier=None), "exactly one of"),
    ({}, dict(algorithm="sgd"), "not private"),
])
def test_refusals_name_the_reason_and_change_nothing(tmp_path, kw, dp, match):
    model = gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=match):
        DPTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=Tokens(8, 6, causal=True),
                  data_collator=collate, dp_args=DPArguments(**{"noise_multiplier": 1.0, **dp}))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_refusals_of_batch_losses_and_streams(tmp_path):
    model, data = gpt2(), Tokens(8, 6, causal=True)
    with pytest.raises(ConfigError, match="per_example_loss"):
        DPTrainer(model=model, args=targs(tmp_path), train_dataset=data, data_collator=collate,
                  compute_loss_func=lambda out, labels, num_items_in_batch=None: out.loss,
                  dp_args=DPArguments(noise_multiplier=1.0))
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(data)
    stream = Stream()
    with pytest.raises(ConfigError, match="map-style"):
        DPTrainer(model=model, args=targs(tmp_path), train_dataset=stream, dp_args=DPArguments(noise_multiplier=1.0))
    with pytest.raises(ConfigError, match="dp_args"):
        DPTrainer(model=model, args=targs(tmp_path), train_dataset=data)
    with pytest.raises(ConfigError, match="per_example_loss"):
        DPTrainer(model=torch.nn.Linear(3, 2), args=targs(tmp_path), train_dataset=data, data_collator=collate,
                  dp_args=DPArguments(noise_multiplier=1.0)).train()


def test_bert_broadcast_position_ids_on_the_fast_path_equal_the_rows_path():
    """BERT builds its position_ids and token_type_ids as one [1, T] row for the whole batch; the fast path
    expands those Embedding outputs to the batch (each example's output gradient its own) instead of refusing
    ("a Embedding layer sees a first dimension of 1"). One float64 step under the same key: the same weights as
    the rows path, and the probe (a Hugging Face model is not proven per-example) accepts the attribution."""
    from transformers import BertConfig, BertForSequenceClassification
    from clipbias.config import AlgoConfig
    from clipbias.engine import DPEngine
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20,
                     max_position_embeddings=32, num_labels=2, attn_implementation="eager", hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    state = BertForSequenceClassification(cfg).double().state_dict()
    ids, y = torch.randint(0, 50, (12, 8)), torch.randint(0, 2, (12,))
    loss = (lambda out, t: torch.nn.functional.cross_entropy(out.logits, t, reduction="none"))
    after = {}
    for path in ("rows", "fast"):
        m = BertForSequenceClassification(cfg).double()
        m.load_state_dict(state)
        e = DPEngine(m, "dpsgd", n=12, batch_size=12, steps=1, noise_multiplier=1e-3, noise_seed=3, loss_fn=loss,
                     grad_path=path, config=AlgoConfig(lr=0.5, clip=0.05))
        idx = e.sampler.sample()
        e.step({"input_ids": ids[idx]}, y[idx], idx)
        after[path] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    before = torch.cat([state[n].reshape(-1) for n, _ in BertForSequenceClassification(cfg).named_parameters()])
    assert (after["fast"] - before).norm() > 1e-3
    torch.testing.assert_close(after["fast"], after["rows"], rtol=0, atol=1e-12)


def test_epsilon_is_on_the_progress_bar_and_in_its_log_lines(tmp_path, capfd):
    """Hugging Face's progress bar shows ``epsilon=`` (its postfix, updated at every training log, as
    Lightning's bar shows it) and the log lines it writes under the bar carry ``epsilon``."""
    trainer = DPTrainer(model=bert(), args=targs(tmp_path, max_steps=4, logging_steps=2, disable_tqdm=False),
                        train_dataset=Tokens(32, 8, causal=False), data_collator=PerExampleIds(collate),
                        dp_args=DPArguments(noise_multiplier=1.0, max_grad_norm=1.0))
    trainer.train()
    out, err = capfd.readouterr()
    logged = [h["epsilon"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and logged[-1] == pytest.approx(trainer.privacy_report().epsilon)
    for epsilon in logged:
        assert f"epsilon={epsilon:.4g}]" in err.replace("\r", "\n"), err[-2000:]
        assert f"'epsilon': '{epsilon:.4g}'" in out + err


@pytest.mark.parametrize("when", ["on_pre_optimizer_step", "on_step_end"])
def test_a_callback_writing_the_update_or_the_weights_is_refused(tmp_path, when):
    """The private update reaches optimizer.step() as the engine left it, and the parameters reach the next private
    step (or the end of training) as the optimizer left them: a callback that wrote a value of the batch into
    .grad before the optimizer's step (8,611 C, certified, before) or into the weights after it (86 C) is refused,
    and the report says why; an honest run is certified (red team round 19)."""
    from transformers import TrainerCallback

    class Write(TrainerCallback):
        def __init__(self):
            self.trainer = None

        def on_pre_optimizer_step(self, args, state, control, **kw):
            if when == "on_pre_optimizer_step":
                for p in self.trainer.model.parameters():
                    p.grad.add_(1.0)

        def on_step_end(self, args, state, control, **kw):
            if when == "on_step_end":
                with torch.no_grad():
                    next(self.trainer.model.parameters()).add_(0.1)
    cb = Write()
    tr = DPTrainer(model=bert(), args=targs(tmp_path, max_steps=2, gradient_accumulation_steps=1),
                   train_dataset=Tokens(32, 6, causal=False), data_collator=collate,
                   dp_args=DPArguments(noise_multiplier=1.0, max_grad_norm=1.0), callbacks=[cb])
    cb.trainer = tr
    with pytest.raises(ConfigError, match="changed between the private step and optimizer.step|changed after an "
                                          "optimizer step"):
        tr.train()
    if when == "on_step_end":
        assert not tr.privacy_report().certified
