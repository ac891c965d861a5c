"""Red team round 14 (the loop's loss, the hooks around it): each route that kept a run certified while example 0
moved the update by 19 C to 9,655 C, in miniature, now refused or reported uncertified; honest twins certified."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from opacus_step import B, K
from opacus_step import Z as _Z
from opacus_step import one_step as _one_step

import clipbias
from clipbias.errors import ConfigError


def _target(o, t):
    return F.mse_loss(o, 10 * torch.tanh(t - 20.0), reduction="sum") / len(o)


def _cat_one(m, x, y, raw, opt):  # example 0's value in every row, joined to the outputs along dim 1
    c = torch.cat([m(x), x[:1, :1].expand(len(x), 1)], dim=1)
    return ((c[:, 0] - 10 * torch.tanh(c[:, 2] - 20.0)) ** 2).sum() / len(x)


def _hstack(m, x, y, raw, opt):  # hstack of 1-D tensors joins them end to end: each row is the whole column
    n = len(x)
    a = torch.hstack([x[:, 0]] * n).view(n, n)
    return ((m(x)[:, 0] - 10 * torch.tanh(a.sum(1) - 20.0)) ** 2).sum() / n


def _view_write(m, x, y, raw, opt):  # a write through a view of an intermediate; its base kept its label
    t = x[:, 0] * 1
    t[1:].add_(t[:1].expand(len(x) - 1))
    return _target(m(x), torch.stack([t, t], 1))


def _saved_hooks(m, x, y, raw, opt):  # the unpack hook hands the backward example 0's row for every row
    o = m(x)
    d = o - 10 * torch.tanh(x[:, :K] - 20.0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t[:1].expand_as(t).clone()):
        return (d * d).sum() / len(x)


def _public_forward_hook(m, x, y, raw, opt):  # the public forward reads the batch from a closure
    h = raw[2].register_forward_hook(lambda mod, i, out: out * (1 + 10 * torch.tanh(x[:1, :1] - 20.0)))
    try:
        pub = m(clipbias.public(_Z))
    finally:
        h.remove()
    return F.cross_entropy(m(x), y) + pub.sum()


def _step_hook(m, x, y, raw, opt):  # runs inside optimizer.step(), after its checks
    def hook(o, args, kwargs):
        for group in o.param_groups:
            for p in group["params"]:
                p.grad.add_(100.0 * (1 + float(torch.tanh(x[0, 0] - 20.0))) / B)
    opt.original_optimizer.register_step_pre_hook(hook)
    return F.cross_entropy(m(x), y)


REFUSED = {"cat along dim 1 with example 0's column": (_cat_one, "not a sum of per-example terms", {}),
           "hstack of 1-D tensors": (_hstack, "not a sum of per-example terms", {}),
           "a write through a view of an intermediate": (_view_write, "written in place", {}),
           "saved_tensors_hooks": (_saved_hooks, "saved_tensors_hooks", {}),
           "a forward hook in a public forward, exact term": (_public_forward_hook, "public data", {"public_clip": False}),
           "a forward hook in a public forward, clipped rows": (_public_forward_hook, "public data", {}),
           "an optimizer step hook": (_step_hook, "step hook", {})}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused(name):
    loss, match, kw = REFUSED[name]
    with pytest.raises(ConfigError, match=match):
        _one_step(loss, **kw)


def test_a_shape_that_follows_the_batchs_values_is_a_read():
    """``len(x[x[:, 0] > t])`` (19.2 C certified before) and ``F.one_hot(y).shape``: the step runs, uncertified;
    a mask used only to select rows that are summed stays certified."""
    def counted(m, x, y, raw, opt):
        k = len(x[x[:, 0] > 1.0])
        return (1 - 2 * k) * F.cross_entropy(m(x), y, reduction="sum") / len(x)

    def one_hot(m, x, y, raw, opt):
        return F.mse_loss(m(x), F.one_hot(y).float()[:, :K], reduction="sum") / len(x)

    def selected(m, x, y, raw, opt):
        per = F.cross_entropy(m(x), y, reduction="none")
        return per[x[:, 0] > 0].sum() / len(x) + F.mse_loss(m(x), F.one_hot(y, K).float(), reduction="sum") / len(x)
    assert not _one_step(counted).certified
    assert not _one_step(one_hot).certified
    assert _one_step(selected).certified  # (one_hot with num_classes: its shape is public)


def test_honest_twins_stay_certified():
    """A column of the outputs' own rows joined along dim 1, hstack of 2-D rows, a write of public values through a
    view, a public forward without hooks: certified."""
    def loss(m, x, y, raw, opt):
        o = m(x)
        c = torch.cat([o, x[:, :1]], dim=1)
        h = torch.hstack([x[:, :1], x[:, 1:2]])
        t = x[:, 0] * 1
        t[1:].mul_(1.0)
        pub = m(clipbias.public(_Z))
        return ((c[:, 0] - c[:, 2]) ** 2).sum() / len(x) + (o[:, 1] * h.sum(1)).sum() / len(x) \
            + (o[:, 0] * t).sum() / len(x) + 1e-3 * pub.sum()
    assert _one_step(loss).certified
