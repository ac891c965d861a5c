"""A4: `_same_inputs` casts the recorded input to the drawn tensor's dtype before comparing.  A drawn uint8/int
batch (raw images, token counts) and a model input x.float() + delta with 0 <= delta < 1 cast back (truncated)
to the drawn values: any sub-unit perturbation passes as "the batch as drawn", including one computed from
other examples (here delta_i = 0.99 * sigmoid(sum of the batch) rows-wide, which carries the target into every
example's input)."""
import torch
from torch import nn
from torch.utils.data import TensorDataset
from common import D, one_step, C


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1, bias=False)
        nn.init.zeros_(self.lin.weight)

    def forward(self, x):
        return self.lin(x.float())


def data(n, target):
    x = torch.zeros(n, D, dtype=torch.uint8)
    if target:
        x[0, 0] = 255
    return x, torch.zeros(n, dtype=torch.long)


def coupled(model, opt, loader, pe):
    for xb, yb in loader:
        xf = xb.float()
        delta = 0.99 * torch.tanh(xf[:, 0].sum() / 10).expand(len(xb), D)   # in [0, 0.99): the batch's stat
        model(xf + delta).sum().backward()
        opt.step()
        break


def honest(model, opt, loader, pe):
    for xb, yb in loader:
        model(xb.float()).sum().backward(); opt.step(); break


for name, loop in [("x.float() (control)", honest), ("x.float() + batch-stat in [0,1)", coupled)]:
    wa, ca = one_step(loop, *data(16, True), model=Net())
    wb, cb = one_step(loop, *data(16, False), model=Net())
    print(f"{name:32s} effect = {float((wa - wb).norm() / C):7.3f} C   certified(D, D') = {(not ca, not cb)}")
