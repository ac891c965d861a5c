"""ResNet20 for small grey images, without BatchNorm, in two flavours.

* ``resnet20-gn``: the plain DP baseline -- He et al.'s CIFAR ResNet20 (3 stages x 3
  basic blocks, 16/32/64 channels, parameter-free "option A" shortcuts) with every
  BatchNorm swapped for GroupNorm in the usual place: conv -> GN -> ReLU.
* ``resnet20-enhanced``: the normalisation-enhanced design of Xiao et al. (Section 5.1,
  "A Theory to Instruct Differentially-Private Learning via Clipping Bias Reduction"):
  GroupNorm placed AFTER the activation, ELU instead of ReLU, and Weight
  Standardisation (Qiao et al. 2019) on every conv weight (:class:`WSConv2d`).

GroupNorm normalises each example on its own, so both are per-example-gradient safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError

__all__ = ["WSConv2d", "ResNet20"]


class WSConv2d(nn.Conv2d):
    """Conv2d with Weight Standardisation (Qiao et al. 2019, "Micro-Batch Training with
    Batch-Channel Normalization and Weight Standardization").

    Each output filter is standardised to zero mean and unit variance over its fan-in
    before the convolution. With ``fan_in_scale`` (default, as in Xiao et al.'s code)
    it is further divided by sqrt(fan_in), so outputs keep unit scale at any width.
    The transform acts on weights only, never mixes examples, and is vmap-safe.
    """

    def __init__(self, *args, eps: float = 1e-5, fan_in_scale: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.eps, self.fan_in_scale = eps, fan_in_scale

    def standardized_weight(self) -> Tensor:
        """The weight actually used by the convolution."""
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (w - mean) * torch.rsqrt(var + self.eps)
        if self.fan_in_scale:
            w = w / (w[0].numel() ** 0.5)
        return w

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.standardized_weight(), self.bias)


def _shortcut_a(x: Tensor, planes: int, stride: int) -> Tensor:
    """He et al.'s parameter-free shortcut: subsample, zero-pad the new channels."""
    if stride != 1:
        x = x[:, :, ::stride, ::stride]
    extra = planes - x.shape[1]
    if extra:
        x = F.pad(x, (0, 0, 0, 0, extra // 2, extra - extra // 2))
    return x


class _Block(nn.Module):
    """Basic residual block, plain (conv-GN-ReLU) or enhanced (WSconv-ELU-GN)."""

    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, in_planes: int, planes: int, stride: int, enhanced: bool,
                 groups: int, affine: bool) -> None:
        super().__init__()
        conv = WSConv2d if enhanced else nn.Conv2d
        self.enhanced, self.planes, self.stride = enhanced, planes, stride
        self.conv1 = conv(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(groups, planes, affine=affine)
        self.conv2 = conv(planes, planes, 3, stride=1, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(groups, planes, affine=affine)

    def forward(self, x: Tensor) -> Tensor:
        short = _shortcut_a(x, self.planes, self.stride)
        if self.enhanced:  # norm after activation, ELU
            out = self.gn1(F.elu(self.conv1(x)))
            return self.gn2(F.elu(self.conv2(out) + short))
        out = F.relu(self.gn1(self.conv1(x)))
        return F.relu(self.gn2(self.conv2(out)) + short)


class ResNet20(nn.Module):
    """ResNet20 (3x3 basic blocks, 16/32/64 channels, global average pool, linear head)
    for ``(C, H, W)`` input such as 1x28x28 (spatial 28 -> 14 -> 7).

    ``enhanced=True`` gives Xiao et al.'s normalisation-enhanced variant (see module doc).
    ``groups`` GroupNorm groups per layer (4, as in Xiao et al.'s code); ``affine`` turns
    the GroupNorm scale/shift on (default) or off.
    """

    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, enhanced: bool = False,
                 groups: int = 4, affine: bool = True, blocks: int = 3) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(f"resnet20 needs (C, H, W) input, got {tuple(input_shape)}")
        self.input_shape, self.enhanced = tuple(input_shape), enhanced
        conv = WSConv2d if enhanced else nn.Conv2d
        self.conv1 = conv(input_shape[0], 16, 3, stride=1, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(groups, 16, affine=affine)
        layers, in_planes = [], 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks):
                layers.append(_Block(in_planes, planes, stride if i == 0 else 1, enhanced,
                                     groups, affine))
                in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.linear = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if self.enhanced:
            out = self.gn1(F.elu(self.conv1(x)))
        else:
            out = F.relu(self.gn1(self.conv1(x)))
        out = self.layers(out)
        return self.linear(out.mean(dim=(2, 3)))
