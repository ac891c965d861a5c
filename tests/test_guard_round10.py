"""Red team round 10 on the graph proof of keyed dropout: each attack in miniature, now without effect or refused.

* A model that handed its own cross-example tensor to the proof as a keyed mask (through a callback the keyed
  mode kept in a module variable), or swapped ``torch.from_numpy`` around a dropout call so that the mask became
  example 0's signs: 8.79 C and 4.15 C on steps the probe skipped. The proof now takes as a mask only a tensor
  the keyed mode made in the current pass, by identity (``forward.mask_of``), made with ``from_numpy`` as bound at
  import and outside any dispatch mode.
* A model that labelled a tensor as a parameter through the recorder it found on torch's dispatch-mode stack: a
  source named as a parameter or buffer the model does not hold is refused."""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.grads import proof


class _Swapper(nn.Module):
    """Replaces ``torch.from_numpy`` during its dropout call with one that returns example 0's signs (``swap``)."""

    swap = True

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(6, 16), nn.Linear(16, 3), nn.Dropout(0.3)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        real = torch.from_numpy
        if self.swap:
            signs = (x[:1, :1].detach() > 0).expand(len(x), 16).clone()
            torch.from_numpy = lambda a: signs.reshape(a.shape) if a.dtype == np.bool_ else real(a)
        try:
            return self.fc2(self.drop(h))
        finally:
            torch.from_numpy = real


class _Honest(_Swapper):
    swap = False


def _steps(model: nn.Module, steps: int = 4):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
    e = DPEngine(model, "dpsgd", n=32, batch_size=8, steps=steps, noise_multiplier=1.0,
                 config=AlgoConfig(lr=1.0, clip=1.0), grad_path="fast", noise_seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (indices of the test's choosing)
        for s in range(steps):
            idx = torch.arange(s * 8, s * 8 + 8)
            e.step(x[idx], y[idx], idx)
    return e, [p.detach().clone() for p in model.parameters()]


def test_a_model_that_swaps_from_numpy_does_not_make_the_keyed_masks():
    torch.manual_seed(0)
    e, swapped = _steps(_Swapper())
    assert e.fast._proofs.hits >= 2  # proven, the probe skipped: with the masks the keyed mode made
    torch.manual_seed(0)
    _, honest = _steps(_Honest())
    for a, b in zip(swapped, honest):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Relabels(nn.Module):
    """Labels a tensor holding example 0's row in every row as a parameter, through the recorder it finds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        leak = x[:1].detach().expand_as(x).clone()
        for mode in _get_current_dispatch_mode_stack():
            if hasattr(mode, "_set"):
                mode._set(leak, ("p", "fake"))
        return self.fc(x + leak)


def test_a_tensor_labelled_as_a_parameter_the_model_does_not_hold_is_not_proven():
    assert "a parameter or buffer the model does not hold" in proof.prove(_Relabels(), torch.randn(4, 6))


def test_a_spot_probe_on_a_dropout_step_runs_four_examples_alone(monkeypatch):
    """An unproven dropout step runs one secret example alone; a proven one's secret spot probe runs ``PROBES``
    (a leak into a few rows, in a model that leaks only where it expects no probe, is then met more often)."""
    from clipbias.grads import fast_checks
    from clipbias.grads.fast import BookKeeping
    calls = []
    alone = BookKeeping._alone
    monkeypatch.setattr(BookKeeping, "_alone", lambda *a, **k: calls.append(1) or alone(*a, **k))
    monkeypatch.setattr(proof, "SPOT", 1)
    torch.manual_seed(0)
    e, _ = _steps(_Honest())
    assert e.fast._proofs.spot == 3  # steps 2-4: proven before (at step 1, probed), each a spot probe
    assert len(calls) == 1 + 3 * fast_checks.PROBES  # step 1: one example alone
