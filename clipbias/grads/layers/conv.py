"""Convolutions: ``nn.Conv1d``/``nn.Conv2d``/``nn.Conv3d``, weights and biases, any ``groups`` (depthwise
included, whose per-example gradients are always formed, group by group: ``grads.conv_rows``), any padding
mode and ``padding="same"`` (the input padded as the layer pads it). Example i's weight gradient is
``g_i^T a_i`` over its output positions, ``a_i`` the unfolded input: the Linear rule's arithmetic
(``layers.linear.Matrix``), with the per-example gradients formed by the fastest exact kernel
(``conv_rows.conv_weight_rows``) and the ghost norm read off the unfolded input (``conv_rows.input_rows``).
An input without its batch dimension (``[C, L]`` for a Conv1d) is refused at the step."""

from __future__ import annotations

from torch import Tensor, nn

from ..conv_rows import conv_weight_rows, input_rows
from .base import register
from .linear import Matrix, MatrixRule

_BATCHED_DIMS = {nn.Conv1d: 3, nn.Conv2d: 4, nn.Conv3d: 5}  # an input of one dimension less is one unbatched example
_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


class ConvGrads(Matrix):
    """``Matrix`` over a convolution's output positions: the per-example gradients formed by
    ``conv_weight_rows``, the ghost norm's rows from the unfolded input."""

    @staticmethod
    def sizes(m: nn.Module, a: Tensor, g: Tensor) -> tuple[int, int, int]:
        return g[0, 0].numel(), m.weight[0].numel(), g.shape[1]  # without unfolding

    @staticmethod
    def grouped(m: nn.Module) -> bool:
        return m.groups > 1

    @staticmethod
    def prepare(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        return a, g  # the kernels read the input and output gradient as the layer has them

    def form(self, m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
        return conv_weight_rows(m, a, g)

    @staticmethod
    def rows(m: nn.Module, a: Tensor, g: Tensor, formed: bool) -> tuple[Tensor | None, Tensor]:
        return (None if formed else input_rows(m, a)), g.flatten(2).transpose(1, 2)


class ConvRule(MatrixRule):
    name = "conv"
    types = separable = tuple(_BATCHED_DIMS)  # any groups and padding mode: both act within an example
    grads_type = ConvGrads

    def why_not(self, m: nn.Module, name: str) -> str | None:
        why = super().why_not(m, name)
        if why is None and m.padding_mode not in _PADDING_MODES:
            return f"module '{name}' ({type(m).__name__}) uses padding_mode={m.padding_mode!r}"
        return why

    def input_dims(self, m: nn.Module) -> tuple[int, int]:
        d = next(d for t, d in _BATCHED_DIMS.items() if isinstance(m, t))
        return d, d


register(ConvRule())
