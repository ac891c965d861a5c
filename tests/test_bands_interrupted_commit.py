"""Banded noise: an exception that lands in ``DPEngine.step``'s ``finally`` block after the noisy update was
applied (a KeyboardInterrupt there; injected by wrapping ``optimizer.zero_grad`` or ``rows.commit``) must not
let a later step reuse the step's noise draw or release a class at another class's noise position.
Otherwise the reused draw cancels exactly in the difference of the two updates, and the shifted classes
give mu 0.608 against the accounted 0.500 (b = 4, T = 16, z = 4). BLT noise (``bands_strategy="blt"``) the same."""

from __future__ import annotations

import pytest
import torch

from clipbias.audit.white_box import Coordinates
from clipbias.engine.core import DPEngine
from clipbias.errors import ClipbiasError

B, M, T = 4, 32, 12


@pytest.mark.parametrize("strategy", ["taylor", "blt"])
@pytest.mark.parametrize("where", ["zero_grad", "rows.commit"])
def test_an_exception_while_committing_a_step_never_reuses_a_draw_or_shifts_the_classes(where, strategy):
    x = torch.eye(M)
    e = DPEngine(Coordinates(M), "dpsgd", n=M, batch_size=M / (2 * B), steps=T, noise_multiplier=4.0, noise_seed=0,
                 loss_fn=lambda out, y: out.sum(), grad_path="rows", bands=B, bands_strategy=strategy)
    target, name = (e.optimizer, "zero_grad") if where == "zero_grad" else (e.rows, "commit")
    real, calls = getattr(target, name), [0]

    def hit(*a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    setattr(target, name, hit)
    applied, refused = [], 0  # (noise position, indices) of every update that reached the model
    while e.steps_taken < T and refused < 50:
        idx = e.sampler.sample()
        pos = e.pipeline.noise.draws
        try:
            e.step(x[idx], torch.zeros(len(idx), dtype=torch.long), idx)
        except KeyboardInterrupt:
            pass  # the update was applied to the model
        except ClipbiasError:
            refused += 1  # a refusal changes nothing (a loop that refuses forever is safe)
            continue
        applied.append((pos, idx))
    positions = [p for p, _ in applied]
    labels = e.sampler.labels
    assert len(positions) == len(set(positions)), f"noise positions used twice: {positions}"
    assert all((labels[i] == p % B).all() for p, i in applied), \
        [(p, sorted(set(labels[i].tolist()))) for p, i in applied]
