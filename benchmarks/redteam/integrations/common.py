"""Shared harness for the red-team scripts: one private step of clipbias.PrivacyEngine in two neighbouring
worlds under the same seeded key (so the noise and the batches are identical and cancel), and the change of
the noise-free clipped sum in units of C.  Model: w . x (Linear, no bias, w = 0), per-example loss = output,
so example i's gradient is its (model-input) row x_i; C = 1."""
from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))  # the checkout's clipbias

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import clipbias
from clipbias.engine.core import SEEDED_CAVEAT

D = 4
C = 1.0


def dataset(n: int, target: bool, k: int = 0, big: float = 100.0):
    """n examples, all zero but example k = big * e_1 (world D) or 0 (world D')."""
    x = torch.zeros(n, D)
    if target:
        x[k, 0] = big
    return x, torch.zeros(n, dtype=torch.long)


def linear():
    m = nn.Linear(D, 1, bias=False)
    nn.init.zeros_(m.weight)
    return m


def loss(out, y):
    return out.sum()


def one_step(loop, x, y, *, n_b=None, model=None, criterion=loss, seed=7, steps=1, **kw):
    """Run ``loop(model, opt, loader, pe)`` on a PrivacyEngine with a seeded key; return (w, sum-scale, caveats
    other than the seeded-key one).  q = 1 by default (every example in every batch)."""
    model = model or linear()
    n = len(x)
    pe = clipbias.PrivacyEngine()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    dl = DataLoader(TensorDataset(x, y), batch_size=n_b or n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, o, l = pe.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0,
                                  max_grad_norm=C, criterion=criterion, noise_seed=seed, **kw)
        loop(m, o, l, pe)
    rep = pe.privacy_report()
    cav = [c for c in rep.caveats if c != SEEDED_CAVEAT]
    B = pe.engine.expected_batch_size
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return w * B, cav  # -(clipped sum + noise); the noise cancels between worlds


def effect(loop, n=16, **kw):
    """||released(D) - released(D')|| / C and whether each world is certified (no caveat but the seed's)."""
    xa, ya = dataset(n, True)
    xb, yb = dataset(n, False)
    wa, ca = one_step(loop, xa, ya, **kw)
    wb, cb = one_step(loop, xb, yb, **kw)
    return float((wa - wb).norm() / C), (not ca, not cb), ca or cb


def plain(model, opt, loader, pe):
    for xb, yb in loader:
        opt.zero_grad()
        model(xb).sum().backward()
        opt.step()
        break
