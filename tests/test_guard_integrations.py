"""Checks every integration makes (issue 54, items 2 and 6): a step on a batch other than the one the private
loader drew is counted by the engine (``clipbias.engine.drawn``) and reported uncertified in every
integration; a pass past the planned steps, a second ``DPTrainer.train()`` with nothing left to do, and
evaluation on the training data are refused with the reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clipbias import PrivacyEngine
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine, drawn
from clipbias.errors import ConfigError

CAVEAT = "called the model on inputs other than the batch the data loader drew"

g = torch.Generator().manual_seed(0)
X = torch.randn(64, 5, generator=g)
Y = (X[:, 0] > 0).long()
DATA = TensorDataset(X, Y)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


# ---------------------------------------------------------------- the engine's count
def test_the_engine_counts_a_changed_batch_reports_it_and_keeps_the_count_across_a_resume():
    """The engine compares a step's batch with the copy its loader kept as it yielded the batch
    (``sampler.fetched``): a moved or cast batch is the drawn one; an edited one is counted; the engine's own
    report carries the caveat, and its state carries the count."""
    from clipbias.sampling import PoissonLoader

    model = _net()
    engine = DPEngine(model, "dpsgd", n=64, batch_size=16, steps=4, epsilon=3.0, config=AlgoConfig(clip=1.0))
    batches = PoissonLoader(engine, DATA).epoch(2)
    x, y, idx = next(batches)
    engine.step(x.double().float(), y, idx)
    assert engine.transformed_steps == 0 and engine.privacy().certified
    x, y, idx = next(batches)
    x.add_(0.01 * torch.randn_like(x))  # an in-place edit of the yielded tensor: the loader's copy is not
    engine.step(x, y, idx)
    report = engine.privacy()
    assert not report.certified and engine.transformed_steps == 1
    assert any(c.startswith(f"1 of the 2 steps {CAVEAT}") for c in report.caveats)
    state = engine.state_dict()
    assert state["transformed_steps"] == 1
    resumed = DPEngine(_net(), "dpsgd", n=64, batch_size=16, steps=4, epsilon=3.0, config=AlgoConfig(clip=1.0))
    resumed.load_state_dict(state)
    assert resumed.transformed_steps == 1 and not resumed.privacy().certified


def test_a_row_by_row_reshape_is_the_batch_drawn_and_a_rearrangement_is_not():
    """``model(x.view(len(x), -1))`` (the MNIST-MLP loop) keeps each row's elements in order: the batch drawn. A
    reversal of each row's elements is not (a rearrangement could depend on the other rows)."""
    from clipbias.engine.drawn import same_inputs
    x = torch.randn(6, 2, 3)
    assert same_inputs(x.view(6, -1), x) and same_inputs(x.flatten(1).double(), x)
    assert not same_inputs(x.view(6, -1).flip(1), x) and not same_inputs(x.view(3, -1), x)
    assert not same_inputs(x.view(6, -1) / 255, x)
    empty = torch.zeros(0, 2, 3)  # an empty Poisson batch (a noise-only step)
    assert same_inputs(empty.view(0, 6), empty) and same_inputs(empty, empty)


# ---------------------------------------------------------------- the Opacus interface, through the engine
def _opacus(epochs: int | None = None):
    m = _net()
    pe = PrivacyEngine()
    loader = DataLoader(DATA, batch_size=16)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if epochs is None:
        out = pe.make_private(module=m, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    else:
        out = pe.make_private_with_epsilon(module=m, optimizer=opt, data_loader=loader, target_epsilon=3.0,
                                           target_delta=1e-5, epochs=epochs, max_grad_norm=1.0)
    return (pe, *out)


def test_opacus_transformed_steps_are_the_engines_count_once_in_the_report_and_resumed():
    pe, model, opt, loader = _opacus()
    for i, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        xb = xb if i != 1 else xb + 0.1 * torch.randn_like(xb)
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    assert opt.transformed_steps == pe.engine.transformed_steps == 1
    for report in (pe.privacy_report(), pe.privacy_report(1e-6), pe.engine.privacy()):
        assert not report.certified
        assert [c for c in report.caveats if CAVEAT in c] == [drawn.TRANSFORMED_CAVEAT.format(1, 4)]
    state = pe.state_dict()
    again, *_ = _opacus()
    again.load_state_dict(state)
    assert again.engine.transformed_steps == 1 and not again.privacy_report().certified
    old = {"engine": {k: v for k, v in state["engine"].items() if k != "transformed_steps"}, "transformed_steps": 1}
    old["engine"]["format"] = 8  # a state saved before the engine counted them: the Opacus count is kept
    third, *_ = _opacus()
    third.load_state_dict(old)
    assert third.engine.transformed_steps == 1


def test_opacus_a_pass_after_the_plan_is_spent_is_refused_with_how_to_train_longer():
    pe, model, opt, loader = _opacus(epochs=1)
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    assert pe.steps == pe.engine.total_steps
    with pytest.raises(ConfigError, match=r"planned .* are all taken.*epochs=more.*make_private\(noise_multiplier"):
        next(iter(loader))
    assert pe.steps == pe.engine.total_steps and pe.privacy_report().certified


# ---------------------------------------------------------------- Lightning
L = pytest.importorskip("lightning")
from clipbias.integrations.lightning import DPCallback  # noqa: E402


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class AugmentAfterTransfer(Module):
    """Lightning's documented place for GPU augmentation, one draw per row from torch's generator."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return x + 0.1 * torch.randn(x.shape[0], 1) * torch.ones_like(x), y


class EditInTrainingStep(Module):
    def training_step(self, batch, batch_idx):
        x, y = batch
        x.mul_(1.0 + 0.1 * torch.rand(x.shape[0], 1))  # in place: the tensor the step is then given
        return nn.functional.cross_entropy(self(x), y)


def _fit(module: L.LightningModule, val=None, **kw) -> DPCallback:
    dp = DPCallback(target_epsilon=3.0, target_delta=1e-3, max_grad_norm=1.0)
    trainer = L.Trainer(**{**dict(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False, callbacks=[dp]), **kw})
    trainer.fit(module, DataLoader(DATA, batch_size=16) if val != "train" else TRAIN_LOADER,
                val_dataloaders=TRAIN_LOADER if val == "train" else val)
    return dp


TRAIN_LOADER = DataLoader(DATA, batch_size=16)


@pytest.mark.parametrize("cls", [AugmentAfterTransfer, EditInTrainingStep], ids=["after-transfer", "in-place"])
def test_lightning_a_batch_changed_after_the_draw_is_uncertified(cls):
    dp = _fit(cls())
    report = dp.privacy_report()
    assert not report.certified and any(CAVEAT in c for c in report.caveats)
    assert dp.engine.steps_taken == 4 and dp.engine.transformed_steps > 0


def test_lightning_a_plain_module_stays_certified():
    dp = _fit(Module())
    assert dp.engine.steps_taken == 4 and dp.engine.transformed_steps == 0 and dp.privacy_report().certified


class ValOnTrainingSet(Module):
    def val_dataloader(self):
        return DataLoader(DATA, batch_size=32)  # another DataLoader, the training dataset


@pytest.mark.parametrize("case", ["same-loader", "same-dataset", "same-dataset-no-sanity"])
def test_lightning_validation_on_the_training_data_is_refused(case):
    with pytest.raises(ConfigError, match=r"validation dataloader is the train DataLoader.*held-out"):
        if case == "same-loader":
            _fit(Module(), val="train")
        else:
            _fit(ValOnTrainingSet(), num_sanity_val_steps=2 if case == "same-dataset" else 0)


def test_lightning_validation_on_a_held_out_split_is_certified():
    held_out = TensorDataset(torch.randn(16, 5, generator=g), torch.randint(0, 2, (16,), generator=g))
    dp = _fit(Module(), val=DataLoader(held_out, batch_size=16))
    assert dp.engine.steps_taken == 4 and dp.privacy_report().certified


class _Logged(Module):
    """Logs its training loss, as most LightningModules do (a release outside the guarantee, like any log)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


class PlateauOnTrainLoss(_Logged):
    """``ReduceLROnPlateau`` stepping on the loss logged from the private training batches."""

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss", "interval": "step"}}


def test_lightning_a_schedule_or_callback_watching_a_training_metric_is_refused():
    """A canary moved the learning rate (0.5 -> 0.05 at step 3) through ``ReduceLROnPlateau(monitor="train_loss")``,
    certified; ``EarlyStopping`` on it would choose the stopping step. Both watch a statistic of the private
    batches and are refused."""
    with pytest.raises(ConfigError, match=r"ReduceLROnPlateau.*'train_loss'"):
        _fit(PlateauOnTrainLoss())
    with pytest.raises(ConfigError, match=r"EarlyStopping.*'train_loss'"):
        from lightning.pytorch.callbacks import EarlyStopping
        dp = DPCallback(target_epsilon=3.0, target_delta=1e-3, max_grad_norm=1.0)
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[dp, EarlyStopping(monitor="train_loss", check_on_train_epoch_end=True)])
        trainer.fit(_Logged(), DataLoader(DATA, batch_size=16))


# ---------------------------------------------------------------- Hugging Face
transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments  # noqa: E402

from clipbias.integrations.transformers import DPArguments, DPTrainer, PerExampleIds  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 1) -> None:
        self.ids = torch.randint(1, 100, (n, 6), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(6, dtype=torch.long),
                "labels": (self.ids[i, 0] > 50).long()}


def _trainer(tmp_path, train, eval_dataset=None, **kw) -> DPTrainer:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                     num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification._from_config(cfg, attn_implementation="eager")
    args = TrainingArguments(str(tmp_path / "out"), **{**dict(
        per_device_train_batch_size=4, max_steps=2, learning_rate=0.05, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True), **kw})
    return DPTrainer(model=model, args=args, train_dataset=train, eval_dataset=eval_dataset,
                     data_collator=PerExampleIds(torch.utils.data.default_collate),
                     dp_args=DPArguments(target_epsilon=8.0, max_grad_norm=1.0, grad_path="rows"))


def test_hf_a_second_train_after_the_plan_is_spent_is_refused(tmp_path):
    trainer = _trainer(tmp_path, Tokens(16))
    trainer.train()
    assert trainer.dp_engine.steps_taken == 2 and trainer.privacy_report().certified
    with pytest.raises(ConfigError, match=r"2 steps this run planned .* are all taken.*0 steps.*max_steps"):
        trainer.train()
    assert trainer.dp_engine.steps_taken == 2


def test_hf_evaluation_on_the_training_set_is_refused(tmp_path):
    train, valid = Tokens(16), Tokens(8, seed=2)
    with pytest.raises(ConfigError, match=r"eval_dataset is the train_dataset.*held-out"):
        _trainer(tmp_path, train, eval_dataset=train, eval_strategy="steps", eval_steps=1).train()
    trainer = _trainer(tmp_path, train, eval_dataset={"valid": valid, "train": train})
    with pytest.raises(ConfigError, match="eval_dataset is the train_dataset"):
        trainer.evaluate()
    with pytest.raises(ConfigError, match="eval_dataset is the train_dataset"):
        trainer.evaluate(eval_dataset=train)
    with pytest.raises(ConfigError, match="eval_dataset is the train_dataset or holds its examples"):
        trainer.evaluate(eval_dataset=torch.utils.data.Subset(train, range(4)))  # (red team round 11: certified)
    trainer.evaluate(eval_dataset=valid)  # a held-out split is fine
    trainer = _trainer(tmp_path, train, eval_dataset=valid, eval_strategy="steps", eval_steps=1)
    trainer.train()
    assert trainer.privacy_report().certified and trainer.dp_engine.transformed_steps == 0


# ---------------------------------------------------------------- a fourth red team's channels
def test_hf_token_counts_are_refused_flops_are_zero_and_the_report_names_what_is_released(tmp_path):
    """``include_num_input_tokens_seen`` logged each private batch's exact token count (one long example shows:
    a membership test at every step, certified); ``total_flos`` summed them too."""
    with pytest.raises(ConfigError, match="include_num_input_tokens_seen.*exact number of tokens"):
        _trainer(tmp_path, Tokens(16), include_num_input_tokens_seen="all")
    trainer = _trainer(tmp_path, Tokens(16))
    trainer.train()
    report = trainer.privacy_report()
    assert trainer.state.total_flos == 0 and report.certified
    assert any("training loss the Trainer logs" in r for r in report.released)
    assert any(r.startswith("n,") for r in report.released) and "released" in report.to_dict()


def _made_private(criterion=None):
    pe = PrivacyEngine()
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    m, o, dl = pe.make_private(module=model, optimizer=opt, data_loader=DataLoader(DATA, batch_size=16),
                               noise_multiplier=1.0, max_grad_norm=1.0, criterion=criterion)
    return pe, m, o, dl


@pytest.mark.parametrize("how", ["break after a read", "break with criterion", "break unread", "peek",
                                 "peek stepped on", "stop after the step"])
def test_a_batch_the_loop_walks_away_from_is_passed_over(how):
    """A loop that breaks when it sees an outlier got the same batch again on its next pass (given back), so it
    stopped again and again, uncounted: how many steps a run took depended on one example (TPR 1, FPR 0 over
    10 trials), certified. Now a batch left without a step counts as passed over (uncertified, with why), read
    or not (the loop keeps the batch and may read it after the ``break``); a peeked batch that is stepped on is
    used, and a loop that stops right after a step leaves nothing."""
    pe, m, o, dl = _made_private(nn.CrossEntropyLoss() if "criterion" in how else None)
    if how.startswith("peek"):
        x, y = next(iter(dl))  # a look at a batch before training
        if how == "peek stepped on":
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    for x, y in dl:
        if how == "break after a read" and float(x.abs().max()) > 0:
            break
        if how.startswith("break") and pe.steps == 1:
            break
        o.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()
        if how == "stop after the step" and pe.steps == 1:
            break
    report = pe.privacy_report()
    counted = how not in ("peek stepped on", "stop after the step")
    assert report.certified != counted and pe.engine.sampler.passed_over == counted
    assert counted == any("passed over by the training loop" in c for c in report.caveats)
    assert any("reads from the private batches" in r for r in report.released)
    assert any(r.startswith("n,") for r in report.released)


def test_the_optimizers_settings_may_not_change_between_the_draw_and_the_step():
    """A loop that set the learning rate to 0 when the batch's loss spiked froze the weights exactly at the
    canary's steps (certified). A change between the draw and the step is refused; a scheduler stepped after
    ``optimizer.step()`` is not such a change."""
    pe, m, o, dl = _made_private()
    sched = torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)
    for x, y in dl:
        o.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()
        sched.step()
    assert pe.steps == 4 and pe.privacy_report().certified
    pe, m, o, dl = _made_private()
    with pytest.raises(ConfigError, match="optimizer's lr changed after the private data loader drew this batch"):
        for x, y in dl:
            o.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            o.param_groups[0]["lr"] = 0.0 if float(x.abs().max()) > 10 else 0.25
            o.step()


class WritesHparams(Module):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"scale": 1.0})

    def forward(self, x):
        return self.net(x / self.hparams.scale)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.hparams.scale = max(1.0, float(x.abs().max()))  # a statistic of the batch, read by forward
        return nn.functional.cross_entropy(self(x), y)


def test_lightning_hparams_written_on_the_private_batch_are_refused():
    """``self.hparams`` was skipped by the state guard as Lightning's own: a batch statistic written into it in
    ``training_step`` and read by ``forward`` moved the other examples' clipped sum by 12 C, certified."""
    with pytest.raises(ConfigError, match="state changed on the private batch.*_hparams"):
        _fit(WritesHparams())


# ---------------------------------------------------------------- a fifth red team's channels
def test_a_failed_step_the_loop_catches_counts_as_passed_over():
    """A corrupt example (a NaN) fails its step; a loop that caught the error and went on was handed the same
    batch again and again (its steps then depended on that example: TPR 1 at FPR 0, certified)."""
    from clipbias.errors import NonFiniteGradientError
    pe, m, o, dl = _made_private()
    data = dl.dataset.tensors[0]
    data[3] = float("nan")
    failed = 0
    try:
        for _ in range(40):  # until example 3 has been drawn (each step draws it with probability 1/4)
            for x, y in dl:
                o.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                try:
                    o.step()
                except NonFiniteGradientError:
                    failed += 1
                    continue
            if failed:
                break
    finally:
        data[3] = 0.0
    report = pe.privacy_report()
    assert pe.engine.sampler.skipped >= 1 and not report.certified
    assert any("a step on them failed" in c for c in report.caveats)


def test_a_parameter_moved_to_another_group_and_a_read_before_the_step_are_seen():
    """Moving every parameter into a group of learning rate 0 (no setting changed) froze the weights at the
    canary's steps, certified; so did a value read between ``loss.backward()`` and ``optimizer.step()``."""
    pe, m, o, dl = _made_private()
    with pytest.raises(ConfigError, match="param_groups|params"):
        for x, y in dl:
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            group = o.param_groups[0]
            o.param_groups.append({**group, "lr": 0.0})  # every parameter now in a group of learning rate 0
            group["params"] = []
            o.step()
    pe, m, o, dl = _made_private()
    for x, y in dl:
        o.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        _ = float(loss)  # read after the backward, before the step
        o.step()
    report = pe.privacy_report()
    assert not report.certified and any("before optimizer.step()" in c or "read" in c for c in report.caveats)


class RunningNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        return self.net(x / self.scale)


def test_state_written_between_steps_is_refused():
    """A running statistic of the batch written after ``optimizer.step()`` (or in Lightning's
    ``on_train_batch_end``) was outside every checked span: released with the model, and read by the next
    step's forward (4.8 C), certified. The next step now refuses it."""
    pe = PrivacyEngine()
    model = RunningNorm()
    m, o, dl = pe.make_private(module=model, optimizer=torch.optim.SGD(model.net.parameters(), lr=0.5),
                               data_loader=DataLoader(DATA, batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match="changed after the last private step.*buffer scale"):
        for x, y in dl:
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            with torch.no_grad():
                model.scale.copy_(torch.maximum(model.scale, x.detach().abs().amax() if len(x) else model.scale))


class WritesAfterTheStep(Module):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen = float(batch[0].abs().amax()) if len(batch[0]) else 0.0


def test_lightning_state_written_in_on_train_batch_end_is_refused():
    with pytest.raises(ConfigError, match="changed after the last private step.*attribute seen"):
        _fit(WritesAfterTheStep())
