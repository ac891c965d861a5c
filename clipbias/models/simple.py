"""Small feed-forward models: logistic regression, a one-hidden-layer MLP, and the
end-to-end CNN of Tramer & Boneh (2021) with an optional GroupNorm variant.

None of them mixes examples (no BatchNorm), so per-example gradients via
``torch.func.vmap(grad(...))`` over batches of size 1 are exact.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import ConfigError

__all__ = ["LogReg", "MLP", "TramerBonehCNN", "channels_last"]


def channels_last(model: nn.Module) -> nn.Module:
    """Store the convolution weights channels-last, so that every activation after them is too (a
    convolution's output follows its weight's memory format): the same values and gradients, laid out
    so that torch's CPU max pooling runs vectorised. Over NCHW tensors it does not (on an AMD EPYC with
    AVX-512 it took 4.9 of the cnn's 8.7 ms forward at B = 256); channels-last takes the cnn's
    non-private step from 11.8 to 6.3 ms and its private fast-path step from 17.1 to 11.9 ms
    (docs/results.md, "Speed and memory"; on an H200 the layouts tie). ``.to(device)`` keeps the
    layout. Models without max pooling (resnet20-gn) stay NCHW: there channels-last was slower."""
    return model.to(memory_format=torch.channels_last)


class LogReg(nn.Module):
    """Multinomial logistic regression: flatten -> Linear(num_classes)."""

    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.fc = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    """flatten -> Linear(hidden) -> tanh -> Linear(num_classes).

    tanh (a bounded "tempered sigmoid") follows Papernot et al. 2021, who found bounded
    activations better suited to DP-SGD than ReLU.
    """

    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 256) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden),
                                 nn.Tanh(), nn.Linear(hidden, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class TramerBonehCNN(nn.Module):
    """End-to-end CNN of Tramer & Boneh 2021 ("Differentially Private Learning Needs Better
    Features", MNIST/Fashion-MNIST architecture, itself from Papernot et al. 2021):

    Conv(16, 8x8, s2, p3) -> tanh -> MaxPool(2, s1) -> Conv(32, 4x4, s2) -> tanh ->
    MaxPool(2, s1) -> Flatten -> Linear(32) -> tanh -> Linear(num_classes).

    26,010 parameters for 1x28x28 input and 10 classes. (The authors' code pads the first
    conv by 2 instead of 3; both give the same shapes and parameter count.)
    ``groupnorm=G`` inserts GroupNorm(G groups) after each conv, before tanh (``cnn-gn``).
    """

    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int,
                 groupnorm: int | None = None, padding: int = 3) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(f"cnn needs (C, H, W) input, got input_shape={tuple(input_shape)}")
        self.input_shape = tuple(input_shape)

        def norm(c: int) -> nn.Module:
            return nn.GroupNorm(groupnorm, c) if groupnorm else nn.Identity()

        self.features = nn.Sequential(
            nn.Conv2d(input_shape[0], 16, 8, stride=2, padding=padding), norm(16), nn.Tanh(),
            nn.MaxPool2d(2, stride=1),
            nn.Conv2d(16, 32, 4, stride=2), norm(32), nn.Tanh(),
            nn.MaxPool2d(2, stride=1),
            nn.Flatten(),
        )
        with torch.no_grad():
            try:
                flat = self.features(torch.zeros(1, *input_shape)).shape[1]
            except RuntimeError as exc:
                raise ConfigError(f"cnn: input_shape {tuple(input_shape)} is too small "
                                 "(it needs about 16x16 pixels or more)") from exc
        self.classifier = nn.Sequential(nn.Linear(flat, 32), nn.Tanh(), nn.Linear(32, num_classes))
        channels_last(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class TramerBonehCIFAR(nn.Module):
    """End-to-end CIFAR-10 CNN of Tramer & Boneh 2021 (from Papernot et al. 2021, "Tempered Sigmoid
    Activations"): two 3x3 convs (32, 32) -> MaxPool(2) -> two (64, 64) -> MaxPool(2) -> two (128, 128)
    -> MaxPool(2) -> Linear(128) -> Linear(num_classes), tanh activations, padding 1: 550,570
    parameters for 3x32x32 input and 10 classes. ``groupnorm=G`` adds GroupNorm(G) after each conv.
    ``build_model("cnn", (3, 32, 32), ...)`` builds this one."""

    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, groupnorm: int | None = None) -> None:
        super().__init__()
        if tuple(input_shape) != (3, 32, 32):
            raise ConfigError(f"the CIFAR-10 cnn needs (3, 32, 32) input, got input_shape={tuple(input_shape)}")
        self.input_shape = (3, 32, 32)
        layers: list[nn.Module] = []
        c = 3
        for width in (32, 64, 128):
            for _ in range(2):
                layers += [nn.Conv2d(c, width, 3, padding=1)] + ([nn.GroupNorm(groupnorm, width)] if groupnorm else [])
                layers.append(nn.Tanh())
                c = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(128 * 4 * 4, 128), nn.Tanh(), nn.Linear(128, num_classes))
        channels_last(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

