"""DPCallback (clipbias.integrations.lightning): Trainer.fit of a LightningModule on the engine's Poisson
batches, checked against the engine stepped by hand and the accountant; the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")

from clipbias import algorithms, privacy  # noqa: E402
from clipbias.config import AlgoConfig  # noqa: E402
from clipbias.engine import DPEngine  # noqa: E402
from clipbias.errors import ConfigError  # noqa: E402
from clipbias.integrations.lightning import DPCallback  # noqa: E402
from clipbias.sampling.loader import PoissonLoader  # noqa: E402

g = torch.Generator().manual_seed(0)
X = torch.randn(64, 5, generator=g)
Y = (X[:, 0] > 0).long()
DATA = TensorDataset(X, Y)


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}


def fit(dp: DPCallback, module: L.LightningModule | None = None, ckpt_path: str | None = None, **kw) -> tuple:
    module = module or MLP()
    trainer = L.Trainer(**{**dict(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False, callbacks=[dp]), **kw})
    trainer.fit(module, DataLoader(DATA, batch_size=16), ckpt_path=ckpt_path)
    return module, trainer


def test_fit_takes_exactly_the_engines_steps_and_the_scheduler_keeps_working():
    """Two epochs (4 Poisson batches of expected size 16 each): the weights are those of a DPEngine stepped
    by hand on the same key's batches with the same SGD and StepLR; epsilon is the accountant's."""
    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=11)
    module, trainer = fit(dp)
    ref = MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    engine = DPEngine(ref, "dpsgd", n=64, batch_size=16, noise_multiplier=1.0, noise_seed=11,
                      config=AlgoConfig(clip=1.0), optimizer=opt)
    loader = PoissonLoader(engine, DATA, device="cpu")
    for _ in range(2):
        for x, y, idx in loader.epoch():
            engine.step(x, y, idx)
        sched.step()
    moved = 0.0
    for p, q, p0 in zip(module.parameters(), ref.parameters(), MLP().parameters()):
        assert torch.allclose(p, q, atol=1e-6)
        moved += float((p - p0).detach().norm())
    assert moved > 0 and trainer.global_step == dp.engine.steps_taken == 8
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.125)  # StepLR stepped twice
    spec = algorithms.get("dpsgd").spec(AlgoConfig(clip=1.0), 16 / 64, 1.0, 16.0)
    report = dp.privacy_report()
    assert report.epsilon == pytest.approx(privacy.account(spec, 8, 1e-5, "pld").epsilon, rel=1e-9)
    assert float(trainer.callback_metrics["epsilon"]) == pytest.approx(report.epsilon, rel=1e-6)
    assert not report.certified  # noise_seed: reproducible, so uncertified


def test_target_epsilon_is_calibrated_for_max_epochs_and_certified():
    dp = DPCallback(target_epsilon=2.0, target_delta=1e-3, max_grad_norm=0.5)
    before = [p.detach().clone() for p in MLP().parameters()]
    module, trainer = fit(dp)
    independent = DPEngine(MLP(), "dpsgd", n=64, batch_size=16, steps=8, epsilon=2.0, delta=1e-3,
                           config=AlgoConfig(clip=0.5))
    report = dp.privacy_report()
    assert dp.engine.noise_multiplier == independent.noise_multiplier
    assert report.epsilon == pytest.approx(independent.privacy(8).epsilon, rel=1e-9) and report.epsilon <= 2.0
    assert report.certified and trainer.global_step == 8
    assert any(not torch.equal(p, q) for p, q in zip(module.parameters(), before))


@pytest.mark.parametrize("kw, match", [
    (dict(precision="bf16-mixed"), "16-bit sums"),
    (dict(accumulate_grad_batches=2), "accumulate_grad_batches"),
    (dict(gradient_clip_val=1.0), "gradient_clip_val"),
])
def test_refusals_in_fit_name_the_reason_and_change_nothing(kw, match):
    module = MLP()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ConfigError, match=match):
        fit(DPCallback(noise_multiplier=1.0), module, **kw)
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))


@pytest.mark.parametrize("kw, match", [
    (dict(devices=2, strategy="ddp"), "one device"),
    (dict(precision="16-true"), "16-bit sums"),
])
def test_multi_device_and_half_precision_are_refused_at_setup(kw, match):
    """The setup hook refuses before anything is set up (a multi-device fit is not launched here: its
    processes would run this test suite again)."""
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **kw)
    with pytest.raises(ConfigError, match=match):
        DPCallback(noise_multiplier=1.0).setup(trainer, MLP(), "fit")


def test_bad_settings_are_refused_at_construction():
    with pytest.raises(ConfigError, match="exactly one of"):
        DPCallback(noise_multiplier=1.0, target_epsilon=3.0)
    with pytest.raises(ConfigError, match="max_grad_norm"):
        DPCallback(noise_multiplier=1.0, max_grad_norm=0)
    with pytest.raises(ConfigError, match="max_physical_batch"):
        DPCallback(noise_multiplier=1.0, max_physical_batch=0)


def test_a_checkpoint_resumes_the_same_run(tmp_path):
    """Lightning's checkpoint holds the callback's private state; fit(ckpt_path=...) continues the batches,
    the noise and the accounting: the weights equal those of the uninterrupted run."""
    def run(epochs, ckpt=None, **kw):
        dp = DPCallback(noise_multiplier=1.0, noise_seed=5)
        module, trainer = fit(dp, max_epochs=epochs, default_root_dir=str(tmp_path), ckpt_path=ckpt, **kw)
        return module, dp
    run(1, enable_checkpointing=True)
    ckpt = next(tmp_path.rglob("*.ckpt"))
    assert "engine" in torch.load(ckpt, weights_only=False)["callbacks"]["DPCallback"]
    resumed, dp = run(2, str(ckpt))
    straight, dp2 = run(2)
    assert dp.engine.steps_taken == dp2.engine.steps_taken == 8
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(resumed.parameters(), straight.parameters()))
    assert dp.privacy_report().epsilon == pytest.approx(dp2.privacy_report().epsilon)


def test_a_second_fit_with_the_same_callback_is_refused():
    """A second fit would rebuild the engine and restart the accounting at 0 over the same data."""
    dp = DPCallback(noise_multiplier=1.0)
    module, _ = fit(dp, max_epochs=1)
    with pytest.raises(ConfigError, match="accounted 4 steps"):
        fit(dp, module, max_epochs=1)
    assert dp.engine.steps_taken == 4


def test_blt_noise_through_the_callback_is_the_engines_and_certified():
    """``bands`` and ``bands_strategy`` reach the engine: BLT noise in 4 classes over the fit's 8 steps, the
    batches drawn by class (the engine refuses any other), the report the Gaussian mechanism's."""
    from clipbias.step import BLTNoise
    dp = DPCallback(target_epsilon=2.0, target_delta=1e-3, max_grad_norm=0.5, bands=4, bands_strategy="blt")
    fit(dp)
    report = dp.privacy_report()
    assert isinstance(dp.engine.pipeline.noise, BLTNoise) and dp.engine.pipeline.noise.blt.classes == 4
    assert dp.engine.steps_taken == 8 and report.certified and "BLT noise" in report.basis
    assert 1.99 < report.epsilon <= 2.0


def test_epsilon_reaches_the_loggers_at_every_epochs_last_batch(tmp_path):
    """log_every_n_steps larger than an epoch (50 > 4 batches): Lightning writes a step's values only every 50
    steps, so without more epsilon would never reach the logger here; it is written at each epoch's last batch
    (Lightning's step numbering: 3 and 7), the accountant's epsilon after 4 and 8 steps, and is in the bar."""
    import csv
    from lightning.pytorch.loggers import CSVLogger
    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    logger = CSVLogger(str(tmp_path), name="run")
    _, trainer = fit(dp, logger=logger, log_every_n_steps=50)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("epsilon")]
    assert [(r["step"], r["epoch"]) for r in rows] == [("3", "0"), ("7", "1")]
    for row, steps in zip(rows, (4, 8)):
        assert float(row["epsilon"]) == pytest.approx(dp.engine.privacy(steps).epsilon, rel=1e-9)
    assert float(trainer.progress_bar_metrics["epsilon"]) == pytest.approx(dp.engine.privacy(8).epsilon, rel=1e-6)


class Smoothed(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y, label_smoothing=0.3)


class Coupled(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        return nn.functional.cross_entropy(out, y) + ((out - out.mean(0)) ** 2).sum()


class Reads(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        return loss * 2 if loss.item() > 100 else loss  # a value of the batch read before the backward


def _weights(module: L.LightningModule) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_the_loss_training_step_returns_is_the_loss_trained():
    """Without ``criterion`` the step trains the loss ``training_step`` returns (label smoothing 0.3): the
    weights equal those of ``criterion=CrossEntropyLoss(label_smoothing=0.3)`` on the same key's batches and
    noise, and differ from plain cross-entropy's (which the callback trained before, whatever the loop
    returned)."""
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=3)
    followed, _ = fit(DPCallback(**kw), Smoothed())
    given, _ = fit(DPCallback(criterion=nn.CrossEntropyLoss(label_smoothing=0.3), **kw), Smoothed())
    plain, _ = fit(DPCallback(**kw), MLP())
    assert torch.allclose(_weights(followed), _weights(given), atol=1e-5)
    assert float((_weights(followed) - _weights(plain)).abs().max()) > 1e-3


def test_a_criterion_that_is_not_the_loss_training_step_returns_is_said():
    with pytest.warns(UserWarning, match="is not `criterion`'s"):
        fit(DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, criterion=nn.CrossEntropyLoss(label_smoothing=0.3)))


def test_a_loss_that_couples_examples_is_refused_and_a_read_before_backward_is_uncertified():
    with pytest.raises(ConfigError, match="not a sum of per-example terms"):
        fit(DPCallback(noise_multiplier=1.0, max_grad_norm=1.0), Coupled())
    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.warns(UserWarning, match="could not be proved a sum of per-example terms"):
        fit(dp, Reads(), max_epochs=1)
    report = dp.privacy_report()
    assert not report.certified and any(".item()" in c or "read" in c for c in report.caveats)
    plain = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    fit(plain, max_epochs=1)  # (MLP logs its loss with self.log: read after the step, certified)
    assert plain.privacy_report().certified
