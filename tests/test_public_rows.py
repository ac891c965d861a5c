"""``clipped_rows``: a public call's gradient with each row's gradient clipped, against per-row autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from clipbias.integrations.public_rows import clipped_rows


def _setup():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(6, 4) * 3
    out = m(x)
    loss = F.binary_cross_entropy_with_logits(out[:, 0], torch.zeros(6))
    return m, x, loss, torch.autograd.grad(loss, out, retain_graph=True)[0]


def test_no_row_clipped_is_the_calls_exact_gradient():
    m, x, loss, g_out = _setup()
    exact = torch.autograd.grad(loss, list(m.parameters()))
    for a, b in zip(clipped_rows(m, x, g_out, 1e9), exact):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("clip", [0.05, 0.3])
def test_each_rows_gradient_of_its_own_loss_is_clipped_and_the_mean_taken(clip):
    m, x, _, g_out = _setup()
    ref = [torch.zeros_like(p) for p in m.parameters()]
    for j in range(len(x)):
        gj = torch.autograd.grad(F.binary_cross_entropy_with_logits(m(x[j:j + 1])[:, 0], torch.zeros(1)),
                                 list(m.parameters()))
        f = min(1.0, clip / float(torch.sqrt(sum(g.pow(2).sum() for g in gj))))
        ref = [r + f * g / len(x) for r, g in zip(ref, gj)]
    got = clipped_rows(m, x, g_out, clip)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    assert float(torch.sqrt(sum(g.pow(2).sum() for g in got))) <= clip * (1 + 1e-6)
