"""A model's weights moved to other values for the length of a ``with`` block (DiSK's second point)."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def at_weights(model: torch.nn.Module, values: list[torch.Tensor]):
    """``enter`` for ``at=(enter, c)``: a context in which ``model``'s parameters hold ``values``, restored after."""
    @contextmanager
    def enter():
        saved = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p, v in zip(model.parameters(), values):
                p.copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(model.parameters(), saved):
                    p.copy_(v)
    return enter
