"""One step of the Opacus interface on a small fixed data set, the loop's loss given: the red-team tests' harness
(tests/test_guard_round12.py .. round15.py)."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clipbias import PrivacyEngine

N, D, K, B = 32, 5, 2, 16
Z = torch.randn(6, D, generator=torch.Generator().manual_seed(1))  # a public batch


def one_step(loss_of, **kw):
    """One step with the loop's loss ``loss_of(model, xb, yb, raw, opt)`` (``raw``: the module as built, ``opt``: the
    wrapped optimizer); ``make_private``'s other keywords in ``kw``. Returns the privacy report."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    raw = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))
    pe = PrivacyEngine()
    model, opt, loader = pe.make_private(module=raw, optimizer=torch.optim.SGD(raw.parameters(), lr=0.5),
                                         data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
                                         noise_multiplier=1.0, max_grad_norm=1.0, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for xb, yb in loader:
            opt.zero_grad()
            loss_of(model, xb, yb, raw, opt).backward()
            opt.step()
            break
    return pe.privacy_report()
