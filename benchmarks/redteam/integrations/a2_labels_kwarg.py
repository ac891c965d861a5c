"""A2: a Hugging Face style call model(x=..., labels=...): the engine takes the targets from the `labels`
keyword, and `_same_inputs` checks only the other inputs, so labels rewritten in the loop from other examples
(here: every example gets the batch's max label, i.e. the target's) pass as certified."""
import torch
from torch import nn
from common import D, effect, one_step, C


class LabelModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1, bias=False)
        nn.init.zeros_(self.lin.weight)

    def forward(self, x, labels=None):
        return self.lin(x)


def crit(out, y):          # per-example loss out * y: gradient x_i * y_i
    return (out.squeeze(-1) * y.float()).sum()


def data(n, target):
    x = torch.zeros(n, D); x[:, 0] = 1.0
    y = torch.zeros(n, dtype=torch.long)
    if target:
        y[0] = 100
    return x, y


def run(loop):
    wa, ca = one_step(loop, *data(16, True), model=LabelModel(), criterion=crit)
    wb, cb = one_step(loop, *data(16, False), model=LabelModel(), criterion=crit)
    return float((wa - wb).norm() / C), (not ca, not cb)


def honest(model, opt, loader, pe):
    for xb, yb in loader:
        model(x=xb, labels=yb).sum().backward(); opt.step(); break


def spread(model, opt, loader, pe):
    for xb, yb in loader:
        model(x=xb, labels=yb.max().expand_as(yb).clone()).sum().backward(); opt.step(); break


for name, loop in [("labels as drawn (control)", honest), ("labels = batch max (coupled)", spread)]:
    d, cert = run(loop)
    print(f"{name:30s} effect = {d:7.3f} C   certified(D, D') = {cert}")
