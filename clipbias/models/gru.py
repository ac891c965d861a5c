"""GRU classifiers that read an image row by row (Fashion-MNIST: 28 steps of 28 values).

The cell is written from ``nn.Linear`` layers (no fused ``nn.GRU``) so that
``torch.func.vmap(grad(...))`` gives exact per-example gradients.

* ``gru``: plain GRU (Cho et al. 2014, PyTorch gate convention).
* ``gru-norm``: Xiao et al.'s normalised RNN (Section 5.1): at every step the input
  projection ``W_x x_t`` and the hidden projection ``W_h h_{t-1}`` are each normalised
  over their coordinates (LayerNorm) before the gates combine them. LayerNorm uses one
  example's activations only, so it is DP-safe.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import ConfigError

__all__ = ["GRUClassifier"]


def _sequence_shape(input_shape: tuple[int, ...]) -> tuple[int, int]:
    """(steps, features per step): rows of an image, or a given (T, F)."""
    if len(input_shape) >= 2:
        steps = int(input_shape[-2])
        return steps, math.prod(input_shape) // steps
    side = math.isqrt(int(input_shape[0]))
    if side * side != input_shape[0]:
        raise ConfigError(f"gru needs (C, H, W), (T, F) or a square flat input, got {input_shape}")
    return side, side


class GRUClassifier(nn.Module):
    """GRU over rows, last hidden state -> Linear(num_classes).

    ``norm=True`` is ``gru-norm``. ``per_gate=True`` (default) LayerNorms each of the
    three gate blocks (reset/update/new) of a projection separately, as in the layer-
    normalised GRU of Ba et al. 2016; ``per_gate=False`` normalises the whole
    3*hidden projection at once, as in Xiao et al.'s released code.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 64,
                 norm: bool = False, per_gate: bool = True) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.steps, self.features = _sequence_shape(self.input_shape)
        self.hidden, self.norm, self.per_gate = hidden, norm, per_gate
        # With LayerNorm the projections' biases would be cancelled/duplicated by LN's shift.
        self.w_x = nn.Linear(self.features, 3 * hidden, bias=not norm)
        self.w_h = nn.Linear(hidden, 3 * hidden, bias=not norm)
        if norm:
            width = hidden if per_gate else 3 * hidden
            count = 3 if per_gate else 1
            self.ln_x = nn.ModuleList(nn.LayerNorm(width) for _ in range(count))
            self.ln_h = nn.ModuleList(nn.LayerNorm(width) for _ in range(count))
        self.fc = nn.Linear(hidden, num_classes)

    def _normalise(self, z: Tensor, lns: nn.ModuleList) -> Tensor:
        if len(lns) == 1:
            return lns[0](z)
        return torch.cat([ln(part) for ln, part in zip(lns, z.chunk(3, dim=-1))], dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        seq = x.reshape(x.shape[0], self.steps, self.features)
        h = seq.new_zeros(seq.shape[0], self.hidden)
        for t in range(self.steps):
            gx, gh = self.w_x(seq[:, t]), self.w_h(h)
            if self.norm:
                gx, gh = self._normalise(gx, self.ln_x), self._normalise(gh, self.ln_h)
            rx, zx, nx = gx.chunk(3, dim=-1)
            rh, zh, nh = gh.chunk(3, dim=-1)
            r, z = torch.sigmoid(rx + rh), torch.sigmoid(zx + zh)
            n = torch.tanh(nx + r * nh)
            h = (1 - z) * n + z * h
        return self.fc(h)
