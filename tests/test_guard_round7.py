"""Red team round 7 on the graph proof and ``public_clip``: each attack in miniature, now refused or bounded.

* rows that depend on their position in the batch (``torch.ones(b, F).tril()``): not proven;
* a custom ``autograd.Function`` applied past the watched ``Function.apply`` (``_FunctionBase.apply``): not
  proven, and the probe refuses its mixing backward;
* a program proven anew keeps the probe on its first step (what the recording cannot see: a read of the batch
  through ``torch._C`` under ``DisableTorchFunction``), so such a model is refused;
* ``public_clip``: the public call's inputs are copied as the call saw them; writing private rows into the public
  tensor before the step leaves the update as it was."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import clipbias
from clipbias import PrivacyEngine
from clipbias.errors import PathRefusal
from clipbias.grads import proof
from clipbias.grads.fast import BookKeeping


def _scale(n):
    return torch.clamp(1.0 / n, max=1.0)


class Positional(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        pos = torch.ones(x.shape[0], 16).tril().sum(1, keepdim=True)  # row i: i + 1, its position
        return self.fc2(F.gelu(self.fc1(x))) * torch.cos(pos * math.pi)


class Mix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        return g + 20.0 * g[:1]  # example 0's gradient into every row


class MixedBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = super(torch.autograd.Function, Mix).apply(self.fc1(x))  # (_FunctionBase.apply: not the watched one)
        return self.fc2(F.gelu(h))


class ReadsRowZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        with torch._C.DisableTorchFunction():
            r0 = torch._C.TensorBase.tolist(x)[0]  # example 0 read into Python, past the watched Tensor methods
        return self.fc2(F.gelu(self.fc1(x + torch.tensor(r0) * 50.0)))


def _xy(b=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 6, generator=g) * 10, torch.randint(0, 3, (b,), generator=g)


def test_tril_over_the_batch_dimension_is_not_proven():
    x, _ = _xy()
    assert "position in the batch" in proof.prove(Positional(), x)


def test_a_custom_function_past_the_watched_apply_is_not_proven_and_its_mixing_is_refused():
    x, y = _xy()
    torch.manual_seed(0)
    assert "custom autograd.Function" in proof.prove(MixedBackward(), x)
    with pytest.raises(PathRefusal, match="lets examples see each other"):
        BookKeeping(MixedBackward())(x, y, _scale, False)


def test_a_program_proven_anew_keeps_the_probe_and_a_hidden_read_of_the_batch_is_refused():
    x, y = _xy()
    torch.manual_seed(0)
    with pytest.raises(PathRefusal, match="lets examples see each other"):
        for _ in range(3):
            BookKeeping(ReadsRowZero())(x, y, _scale, False)


D, B = 5, 8


def _public_clip_step(x, y, mutate: bool):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))
    pe = PrivacyEngine()
    model, opt, loader = pe.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0),
                                         data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
                                         noise_multiplier=1.0, max_grad_norm=1.0, noise_seed=11, public_clip=True)
    bce = nn.BCEWithLogitsLoss()
    xb, yb = next(iter(loader))
    opt.zero_grad()
    err = bce(model(xb)[:, 0], yb)
    fake = clipbias.public(torch.zeros(B, D))
    err = err + bce(model(fake)[:, 0], torch.zeros(B))
    if mutate:
        with torch.no_grad():
            fake.data.copy_(xb[:1].expand(B, D))  # the batch's first example into every "public" row
    err.backward()
    opt.step()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def test_public_clip_takes_the_public_rows_as_the_call_saw_them():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, D, generator=g), (torch.rand(64, generator=g) > 0.5).float()
    torch.testing.assert_close(_public_clip_step(x, y, mutate=True), _public_clip_step(x, y, mutate=False),
                               rtol=0, atol=0)
