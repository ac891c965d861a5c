"""PReLU: ``y = max(0, x) + w min(0, x)``, one weight per channel (channels on dimension 1) or a single
one, so ``dy/dw = min(0, x)``: the per-channel rule (``base.ChannelRule``) with ``min(0, x)`` for the
normalised input, summed over each channel's positions (one weight: over everything). Each entry is
scaled by its channel's weight where negative: per-example by construction."""

from __future__ import annotations

from torch import Tensor, nn

from .base import ChannelRule, register


class PReLURule(ChannelRule):
    name = "prelu"
    types = separable = (nn.PReLU,)

    def normalised(self, m: nn.Module, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        # F.prelu refuses C > 1 weights unless dimension 1 has C channels
        return a.clamp(max=0), tuple(range(1 if m.weight.numel() == 1 else 2, a.dim()))


register(PReLURule())
