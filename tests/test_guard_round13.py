"""Red team round 13: products the loss tracer took for per-example ones (48.5-50.8 C, certified), a rearrangement
of the targets through an alias its fingerprint missed (10.6 C, certified), and module attributes the state guard
compared by a representation the attribute chose: each now refused or reported uncertified."""

from __future__ import annotations

import array

import pytest
import torch
import torch.nn.functional as F
from opacus_step import D, K, one_step
from torch import nn

from clipbias.engine.guard import StateGuard
from clipbias.errors import ConfigError


def _one_step(loss_of):
    """``opacus_step.one_step`` with the loop's loss ``loss_of(model, xb, yb)``."""
    return one_step(lambda model, xb, yb, raw, opt: loss_of(model, xb, yb))


def _target_loss(mix):
    def loss(model, xb, yb):
        out = model(xb)
        return F.mse_loss(out, torch.tanh(mix(xb, len(xb))[:, :K] - 20.0), reduction="sum") / len(xb)
    return loss


MIXING = {  # each: a [B, >= K] tensor whose every row sums the batch
    "F.linear of a [B] tensor": lambda x, n: F.linear(x[:, 0], torch.ones(n, n)).unsqueeze(1).expand(n, K),
    "x.__rmatmul__(W)": lambda x, n: x.__rmatmul__(torch.ones(n, n)),
    "unbatched conv1d": lambda x, n: F.conv1d(x, torch.ones(n, n, 1)),
}


@pytest.mark.parametrize("name", list(MIXING))
def test_products_over_the_batch_are_not_per_example(name):
    with pytest.raises(ConfigError, match="not a sum of per-example terms"):
        _one_step(_target_loss(MIXING[name]))


def test_the_same_products_on_each_example_stay_certified():
    """``F.linear`` of a [B, D] batch, ``matmul`` by a weight on the right, a batched conv1d: certified."""
    def mix(x, n):
        return F.linear(x, torch.ones(K, D)) + x @ torch.ones(D, K) + F.conv1d(x.unsqueeze(1), torch.ones(K, 1, D))[..., 0]
    assert _one_step(_target_loss(mix)).certified


def test_a_rearrangement_of_the_targets_through_an_alias_is_seen():
    """Sorting the targets in place through ``.data``, in an order example 0 decides: the sum and the sum of squares
    stay, the values moved (10.6 C certified before). Refused: the memory of the targets was written with values
    of several examples (round 14's taint); through an alias the tracing does not see, the bit-for-bit comparison
    of the targets with their copy reports the step uncertified."""
    def loss(model, xb, yb):
        out = model(xb)
        yb.data.copy_(torch.where(xb[:1, 0] > 10, yb.sort().values, yb.sort(descending=True).values))
        return F.cross_entropy(out, yb)
    with pytest.raises(ConfigError, match="written in place"):
        _one_step(loss)

    def unseen(model, xb, yb):
        out = model(xb)
        with torch.no_grad():
            flipped = yb.flip(0).clone()
        torch._C.TensorBase.copy_(torch._C.TensorBase.as_subclass(yb, torch.Tensor), flipped)  # (no torch function)
        return F.cross_entropy(out, yb)
    assert not _one_step(unseen).certified


class _Quiet(int):
    def __repr__(self) -> str:
        return "0"


class _Holder(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, self.kind = nn.Linear(3, 1), kind
        self.quiet, self.raw, self.arr = _Quiet(0), bytearray(8), array.array("d", [0.0])
        self.held = {torch.zeros(5000)}  # a tensor kept only in a set

    def forward(self, x):
        with torch.no_grad():
            if self.kind == "int subclass with its own repr":
                self.quiet = _Quiet(int(x.sum() * 1000))
            elif self.kind == "bytearray":
                self.raw[0] = int(x.sum().abs() * 10) % 256 or 1
            elif self.kind == "array.array":
                self.arr[0] = float(x.sum())
            elif self.kind == "a tensor in a set":
                next(iter(self.held))[2500] = x.sum()
        return self.lin(x)


@pytest.mark.parametrize("kind", ["int subclass with its own repr", "bytearray", "array.array", "a tensor in a set"])
def test_the_state_guard_compares_attributes_by_their_values(kind):
    m = _Holder(kind)
    with StateGuard(m).watching() as watch:
        m(torch.randn(6, 3))
    assert watch.error is not None and "state changed" in str(watch.error)
    honest = _Holder("none")
    with StateGuard(honest).watching() as watch:
        honest(torch.randn(6, 3))
    assert watch.error is None
