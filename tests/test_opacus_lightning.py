"""Opacus's Lightning pattern with only the import changed (Opacus's examples/mnist_lightning.py):
``privacy_engine.make_private(module=self, ...)`` in ``configure_optimizers``, the train data wrapped in
``DPLightningDataModule``, ``privacy_engine.get_epsilon(delta)`` logged at each epoch's end. The private step is
the ``DPCallback`` make_private adds to the module's Trainer: the same steps, epsilon and guarantee as a
``DPCallback`` passed to the Trainer, on ``lightning`` and on ``pytorch_lightning``."""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from clipbias import PrivacyEngine
from clipbias.errors import ConfigError
from clipbias.integrations import DPDataLoader
from clipbias.integrations.lightning import DPCallback, DPLightningDataModule

N, B, EPOCHS = 240, 32, 2

_g = torch.Generator().manual_seed(0)
_W = torch.randn(12, 3, generator=_g)
_X = torch.randn(N + 120, 12, generator=_g)
_Y = (_X @ _W).argmax(1)


def _classes(pkg: str):
    pl = importlib.import_module(pkg)

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(TensorDataset(_X[:N], _Y[:N]), batch_size=B, shuffle=True)

        def test_dataloader(self):
            return DataLoader(TensorDataset(_X[N:], _Y[N:]), batch_size=60)

    class Lit(pl.LightningModule):
        """The example's LightningModule, its model a small MLP."""

        def __init__(self, dp: bool = True):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(12, 32), nn.Linear(32, 3)
            self.enable_dp, self.correct = dp, []
            if dp:
                self.privacy_engine = PrivacyEngine()

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(x)))

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0)
            if self.enable_dp:
                data_loader = self.trainer.fit_loop._data_source.dataloader()
                if hasattr(self, "dp"):
                    self.dp["model"].remove_hooks()
                dp_model, optimizer, dataloader = self.privacy_engine.make_private(
                    module=self, optimizer=optimizer, data_loader=data_loader, noise_multiplier=1.0,
                    max_grad_norm=1.0, poisson_sampling=isinstance(data_loader, DPDataLoader))
                self.dp = {"model": dp_model}
            return optimizer

        def training_step(self, batch, batch_idx):
            data, target = batch
            loss = F.cross_entropy(self(data), target)
            self.log("train_loss", loss, on_step=False, on_epoch=True)
            return loss

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.correct.append((self(x).argmax(1) == y).float().sum())

        def on_train_epoch_end(self):
            if self.enable_dp:
                self.log("epsilon", self.privacy_engine.get_epsilon(1e-5), on_epoch=True)
    return pl, Data, Lit


def _trainer(pl, **kw):
    return pl.Trainer(max_epochs=EPOCHS, enable_model_summary=False, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, **kw)


@pytest.mark.parametrize("pkg", ["lightning", "pytorch_lightning"])
def test_opacus_lightning_pattern_trains_privately_as_the_callback_does(pkg):
    pl, Data, Lit = _classes(pkg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Lit()
        trainer = _trainer(pl)
        trainer.fit(model, DPLightningDataModule(Data()))
        trainer.test(model, Data(), verbose=False)
        # the same settings as a DPCallback on a plain module: the same steps and epsilon
        plain = Lit(dp=False)
        callback = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5)
        _trainer(pl, callbacks=[callback]).fit(plain, Data())
    engine = model.privacy_engine
    assert engine.steps == EPOCHS * math.ceil(N / B) == callback.engine.steps_taken
    assert engine.get_epsilon(1e-5) == pytest.approx(callback.get_epsilon(), rel=1e-9) and 0 < engine.get_epsilon(1e-5)
    assert engine.accountant.history == [(1.0, B / N, EPOCHS * math.ceil(N / B))]
    report = engine.privacy_report()
    assert report.certified and report.delta == 1e-5
    assert sum(model.correct).item() / 120 > 0.5  # three classes: above chance
    assert model.dp["model"]._remove is not None and "forward" not in vars(model)  # (the fit's forward is gone)
    assert trainer.callbacks.count(engine.lightning) == 1


def test_remove_hooks_takes_the_callback_off_the_trainer_and_a_second_make_private_replaces_it():
    pl, Data, Lit = _classes("lightning")
    model = Lit()
    trainer = _trainer(pl)
    trainer.strategy.connect(model)  # (attach the Trainer as fit would: make_private needs it)
    model.trainer = trainer
    loader = Data().train_dataloader()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp, _, _ = model.privacy_engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                                 noise_multiplier=1.0, max_grad_norm=1.0)
    first = model.privacy_engine.lightning
    assert first in trainer.callbacks
    dp.remove_hooks()
    assert first not in trainer.callbacks
    model.privacy_engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                      max_grad_norm=1.0)
    second = model.privacy_engine.lightning
    assert second is not first and trainer.callbacks.count(second) == 1
    with pytest.raises(ConfigError, match="poisson_sampling=False"):
        model.privacy_engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                          max_grad_norm=1.0, poisson_sampling=False)
    with pytest.raises(ConfigError, match=r"epochs=3.*max_epochs=2"):
        model.privacy_engine.make_private_with_epsilon(module=model, optimizer=opt, data_loader=loader,
                                                       target_epsilon=2.0, target_delta=1e-5, epochs=3,
                                                       max_grad_norm=1.0)


def test_dp_lightning_data_module_marks_the_train_loader_and_passes_the_others_through():
    pl, Data, _ = _classes("pytorch_lightning")
    dm = DPLightningDataModule(Data())
    assert isinstance(dm, pl.LightningDataModule) and isinstance(dm, DPLightningDataModule)
    train = dm.train_dataloader()
    assert isinstance(train, DPDataLoader) and len(train) == math.ceil(N / B) and len(train.dataset) == N
    with pytest.raises(ConfigError, match="marked for private training"):
        next(iter(train))
    assert len(dm.test_dataloader().dataset) == 120
    with pytest.raises(ConfigError, match="LightningDataModule"):
        DPLightningDataModule(object())
    with pytest.raises(ConfigError, match="generator"):
        DPLightningDataModule(Data(), generator=torch.Generator())


def test_a_resumed_fit_accounts_the_steps_before_the_checkpoint(tmp_path):
    """``trainer.fit(..., ckpt_path=)`` of the Opacus pattern: Lightning restores the callbacks' states before
    ``configure_optimizers`` adds the DPCallback, which then loads its own from the checkpoint (a resumed run
    counted from 0 was certified at 5 of its 10 steps); a checkpoint without that state is refused."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    pl, Data, Lit = _classes("lightning")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = Lit()
        pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(first, DPLightningDataModule(Data()))
        resumed = Lit()
        _trainer(pl).fit(resumed, DPLightningDataModule(Data()), ckpt_path=str(tmp_path / "last.ckpt"))
        assert resumed.privacy_engine.steps == EPOCHS * math.ceil(N / B)
        plain = Lit(dp=False)
        pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[ModelCheckpoint(dirpath=tmp_path / "plain", save_last=True)]).fit(plain, Data())
        with pytest.raises(ConfigError, match="holds no DPCallback state"):
            _trainer(pl, callbacks=[DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)]).fit(
                Lit(dp=False), Data(), ckpt_path=str(tmp_path / "plain" / "last.ckpt"))


def test_validation_on_training_examples_through_a_subset_or_new_tensors_is_refused():
    """Validating on the training data through ``Subset(train, ...)`` or a new ``TensorDataset`` over the same
    tensors logged the training examples' loss without noise, certified; a held-out part of the same tensors
    (disjoint memory) or a disjoint ``random_split`` part is validation data."""
    from torch.utils.data import Subset

    from clipbias.integrations.refusals import _shares_examples
    train = TensorDataset(_X[:N], _Y[:N])
    assert _shares_examples(Subset(train, range(10)), train)
    assert _shares_examples(TensorDataset(_X[:20], _Y[:20]), train)
    assert not _shares_examples(TensorDataset(_X[N:], _Y[N:]), train)
    a, b = torch.utils.data.random_split(train, [N // 2, N - N // 2], generator=torch.Generator().manual_seed(0))
    assert not _shares_examples(b, a) and _shares_examples(Subset(a, [0]), a)
