"""Private training with Lightning: an MLP on a synthetic two-class problem, made private by ``DPCallback``.

    python examples/lightning_mlp.py                      # epsilon 2 over 5 epochs; prints accuracy and epsilon
    python examples/lightning_mlp.py --noise-multiplier 1.0

The LightningModule is written as usual (``training_step`` returns the loss, ``configure_optimizers`` returns an
optimizer and a scheduler); ``DPCallback`` replaces the train DataLoader by the engine's secret Poisson batches
of expected size B = its ``batch_size``, makes the optimizer private and logs ``epsilon``. The engine's
per-example loss is ``criterion(module(x), y)``: the default, cross-entropy, is the loss this module trains on.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clipbias.integrations.lightning import DPCallback


class MLP(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)}


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epsilon", type=float, default=2.0, help="target epsilon (default 2)")
    p.add_argument("--noise-multiplier", type=float, help="use this noise multiplier instead of --epsilon")
    p.add_argument("--epochs", type=int, default=5, help="epochs (default 5)")
    p.add_argument("--batch-size", type=int, default=128, help="expected Poisson batch size B (default 128)")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    a = p.parse_args()
    torch.manual_seed(0)
    module = MLP(a.lr)
    noise = {"noise_multiplier": a.noise_multiplier} if a.noise_multiplier else {"target_epsilon": a.epsilon}
    dp = DPCallback(**noise, max_grad_norm=1.0)
    trainer = L.Trainer(max_epochs=a.epochs, accelerator="cpu", callbacks=[dp], logger=False,
                        enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=10)
    trainer.fit(module, DataLoader(data(4000, 0), batch_size=a.batch_size),
                DataLoader(data(1000, 1), batch_size=500))
    report = dp.privacy_report()
    print(f"{trainer.global_step} steps, validation accuracy {float(trainer.callback_metrics['val_acc']):.3f}")
    print(f"epsilon {report.epsilon:.3f} at delta {report.delta:.2g} ({report.accountant}), noise multiplier "
          f"{report.noise_multiplier:.3f}, certified {report.certified}")


if __name__ == "__main__":
    main()
