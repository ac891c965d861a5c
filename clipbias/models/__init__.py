"""Model zoo for DP training: every model is per-example-gradient safe.

Each example may be run alone (batch of size 1) through ``torch.func.functional_call``
under ``vmap(grad(...))``: no BatchNorm, no cross-example layer, no fused RNN kernels.
Build one with :func:`build_model`; :data:`MODEL_NAMES` lists the names. Every model has
an ``input_shape`` attribute: the per-example shape its ``forward`` takes. Scatter models
take scattering features: call ``model.preprocess(x)`` once per data split first.
See ``docs/models.md`` for sources and parameter counts.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from clipbias.errors import ConfigError
from clipbias.models.gru import GRUClassifier
from clipbias.models.resnet import ResNet20, WSConv2d
from clipbias.models.scatter import ScatterCNN, ScatterFeatures, ScatterLinear
from clipbias.models.simple import MLP, LogReg, TramerBonehCIFAR, TramerBonehCNN

__all__ = [
    "MODEL_NAMES", "build_model", "num_params", "GRUClassifier", "LogReg", "MLP", "ResNet20",
    "ScatterCNN", "ScatterFeatures", "ScatterLinear", "TramerBonehCIFAR", "TramerBonehCNN", "WSConv2d",
]

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "logreg": LogReg,
    "mlp": MLP,
    "cnn": lambda s, c, **kw: (TramerBonehCIFAR if tuple(s) == (3, 32, 32) else TramerBonehCNN)(s, c, **kw),
    "cnn-gn": lambda s, c, groupnorm=4, **kw: (TramerBonehCIFAR if tuple(s) == (3, 32, 32) else TramerBonehCNN)(
        s, c, groupnorm=groupnorm, **kw),
    "scatter-linear": ScatterLinear,
    "scatter-cnn": ScatterCNN,
    "resnet20-gn": lambda s, c, **kw: ResNet20(s, c, enhanced=False, **kw),
    "resnet20-enhanced": lambda s, c, **kw: ResNet20(s, c, enhanced=True, **kw),
    "gru": lambda s, c, **kw: GRUClassifier(s, c, norm=False, **kw),
    "gru-norm": lambda s, c, **kw: GRUClassifier(s, c, norm=True, **kw),
}

MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)
"""Names accepted by :func:`build_model`."""


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **kw: Any) -> nn.Module:
    """Build a model of the zoo.

    Args:
        name: One of ``MODEL_NAMES`` (``logreg``, ``mlp``, ``cnn``, ``cnn-gn``, ``scatter-linear``,
            ``scatter-cnn``, ``resnet20-gn``, ``resnet20-enhanced``, ``gru``, ``gru-norm``).
        input_shape: The per-example input shape (e.g. ``(1, 28, 28)``, the dataset's shape; scatter models
            derive their feature shape from it).
        num_classes: The number of outputs.
        **kw (Any): Extra keywords, passed to the model's constructor.

    Returns:
        The model (an ``nn.Module`` with an ``input_shape`` attribute).

    Raises:
        ConfigError: an unknown name.
    """
    if name not in _BUILDERS:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return _BUILDERS[name](tuple(input_shape), int(num_classes), **kw)


def num_params(model: nn.Module) -> int:
    """Number of trainable parameters (the ``d`` that DP noise scales with)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
