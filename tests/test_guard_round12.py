"""Red team round 12 (the loop's loss proven per example, ``integrations/rowtrace.py``): each attack that kept a run
certified while one example moved the update far beyond the clip bound (46.9 C to 20,239 C through the Opacus
interface), in miniature, now refused; and the honest version of each loop still trains certified."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from opacus_step import K, one_step
from opacus_step import Z as _Z

import clipbias
from clipbias.errors import ConfigError


def _one_step(loss_of, **kw):
    """``opacus_step.one_step`` with the loop's loss ``loss_of(model, xb, yb)``."""
    return one_step(lambda model, xb, yb, raw, opt: loss_of(model, xb, yb), **kw)


MIXING_TARGETS = {  # each row of the targets holds another example's label (46.9 C and 2.8 C measured before)
    "y[:1].expand_as(y)": lambda y: y[:1].expand_as(y),
    "y.flip(0).view_as(y)": lambda y: y.flip(0).view_as(y),
    "y.flip(0).reshape_as(y)": lambda y: y.flip(0).reshape_as(y),
    "y.expand(B, B)[:, 0]": lambda y: y.expand(len(y), len(y))[:, 0],
    "broadcast_to(y, (B, B))[:, 0]": lambda y: torch.broadcast_to(y, (len(y), len(y)))[:, 0],
    "y.expand_as(empty(B, B))[:, 0]": lambda y: y.expand_as(torch.empty(len(y), len(y)))[:, 0],
}


@pytest.mark.parametrize("name", list(MIXING_TARGETS))
def test_reshaping_to_another_tensors_shape_keeps_the_rows_label_of_the_tensor_reshaped(name):
    """``t.expand_as(y)``, ``view_as``, ``reshape_as``: the result's rows are ``t``'s, whatever ``y``'s are, and an
    expansion that adds leading dimensions puts every example's values in each row: refused at the backward."""
    fn = MIXING_TARGETS[name]
    with pytest.raises(ConfigError, match="not a sum of per-example terms"):
        _one_step(lambda model, xb, yb: F.cross_entropy(model(xb), fn(yb)))


def test_honest_reshapes_to_a_shape_stay_certified():
    """The same functions where each row stays its example's: certified."""
    def loss(model, xb, yb):
        out = model(xb)
        t = (yb.view(-1, 1) == torch.arange(K)).float()  # one-hot targets, a row per example
        t = t.view_as(out).reshape_as(out) + yb.view(-1, 1).expand(len(yb), K).float() * 0
        return F.cross_entropy(out, t.expand_as(out))
    report = _one_step(loss)
    assert report.certified and report.epsilon > 0


def _public_hook(model, xb, yb):
    pub = model(clipbias.public(_Z))
    pub.register_hook(lambda gr: gr + 100.0 * yb.float().sum() / len(_Z))
    return F.cross_entropy(model(xb), yb) + 1e-3 * pub.sum()


_handles: list = []


def _parameter_hook(model, xb, yb):
    w = next(model.parameters())
    _handles.append(w.register_hook(lambda gr: gr + 100.0 * yb.float().sum()))
    return F.cross_entropy(model(xb), yb) + 1e-3 * model(clipbias.public(_Z)).sum()


@pytest.mark.parametrize("public_clip", [False, True])
@pytest.mark.parametrize("loss", [_public_hook, _parameter_hook], ids=["on a public output", "on a parameter"])
def test_a_gradient_hook_that_could_carry_the_batch_into_the_public_term_is_refused(loss, public_clip):
    """A hook on a declared-public output (6,035 C with the exact public term) or on a parameter that a public term's
    backward reaches (20,239 C): refused before the backward runs, with the clipped public term too."""
    try:
        with pytest.raises(ConfigError, match="hook"):
            _one_step(loss, public_clip=public_clip)
    finally:
        for h in _handles:
            h.remove()
        _handles.clear()


def test_a_parameter_hook_without_a_public_term_is_not_refused():
    """The private part's gradients reach the outputs, never the parameters' .grad, so a parameter's hook does not
    run on the private term: a loop without a public term trains certified."""
    def loss(model, xb, yb):
        _handles.append(next(model.parameters()).register_hook(lambda gr: gr))
        return F.cross_entropy(model(xb), yb)
    try:
        report = _one_step(loss)
    finally:
        for h in _handles:
            h.remove()
        _handles.clear()
    assert report.certified
