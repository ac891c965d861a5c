"""Normalisations: the affine parameters of ``nn.InstanceNorm1d/2d/3d``, ``nn.GroupNorm``, ``nn.LayerNorm``
and ``nn.RMSNorm``, and the weight of Hugging Face's RMSNorm classes reviewed in ``grads.rms`` (Llama, Qwen2,
Qwen3, Mistral; their ``forward`` checked to be the reviewed one). Per-example gradients computed directly
from the normalised input, one value per channel or feature (``base.ChannelRule``): an InstanceNorm's from
the statistics its forward uses (the example's own in training or without running statistics, the constant
running ones in evaluation; a training forward that tracks running statistics updates buffers: refused at
the step), a Hugging Face RMSNorm's normalised in float32 and cast back, as its forward does."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...errors import ConfigError
from .. import rms
from .base import ChannelRule, register, weight_and_bias_only

_INSTANCE = {nn.InstanceNorm1d: 3, nn.InstanceNorm2d: 4, nn.InstanceNorm3d: 5}  # the dimensions of a batched input


class InstanceNormRule(ChannelRule):
    name = "instance-norm"
    types = separable = tuple(_INSTANCE)  # each example's channel over its own positions, or by constants

    def input_dims(self, m: nn.Module) -> tuple[int, int]:
        d = next(d for t, d in _INSTANCE.items() if isinstance(m, t))
        return d, d

    def check_step(self, m: nn.Module, name: str) -> None:
        """Running statistics updated from the batch in a training forward: refused before the forward, by
        name (``fast._check_buffers`` would refuse any buffer the forward changes)."""
        if m.training and m.track_running_stats:
            raise ConfigError(f"grad_path=\"fast\": module '{name}' ({type(m).__name__}) has track_running_stats=True "
                              f"in training mode: its forward would update running statistics from the private batch, "
                              f"released without noise. Build it with track_running_stats=False (clipbias.fix(model) "
                              f"does), or put the layer in evaluation mode (.eval()) to use its running statistics as "
                              f"constants")

    def normalised(self, m: nn.Module, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        own = m.training or not m.track_running_stats  # the forward's use_input_stats
        xhat = F.instance_norm(a, None if own else m.running_mean, None if own else m.running_var,
                               use_input_stats=own, eps=m.eps)
        return xhat, tuple(range(2, a.dim()))


class GroupNormRule(ChannelRule):
    name = "group-norm"
    types = separable = (nn.GroupNorm,)  # normalises within an example

    def normalised(self, m: nn.Module, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        return F.group_norm(a, m.num_groups, eps=m.eps), tuple(range(2, a.dim()))


class LayerNormRule(ChannelRule):
    name = "layer-norm"
    types = separable = (nn.LayerNorm,)  # each position over its own trailing features

    def input_dims(self, m: nn.Module) -> tuple[int, None]:
        return len(m.normalized_shape) + 1, None

    def normalised(self, m: nn.Module, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        xhat = F.layer_norm(a, m.normalized_shape, eps=m.eps)
        return xhat, tuple(range(1, a.dim() - len(m.normalized_shape)))  # leading positions


def _trailing(m: nn.Module, a: Tensor, n: int) -> tuple[int, ...]:
    """The positions of an RMSNorm's input ``a`` (its leading dimensions), the weight checked against the ``n``
    trailing ones it normalises over."""
    if tuple(m.weight.shape) != tuple(a.shape[a.dim() - n:]) or a.dim() <= n:
        raise ConfigError(f"grad_path=\"fast\": a {type(m).__name__} layer's weight {tuple(m.weight.shape)} "
                          f"does not match the trailing dimensions of its input {tuple(a.shape)}; use "
                          f"grad_path=\"rows\"")
    return tuple(range(1, a.dim() - n))


class RMSNormRule(ChannelRule):
    """``torch.nn.RMSNorm`` (torch >= 2.4): ``weight * x / rms(x)`` over its ``normalized_shape``."""

    name = "rms-norm"
    types = separable = rms.TORCH_RMSNORM

    def input_dims(self, m: nn.Module) -> tuple[int, None]:
        return len(m.normalized_shape) + 1, None

    def normalised(self, m: nn.Module, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        dims = _trailing(m, a, len(m.normalized_shape))
        return F.rms_norm(a, m.normalized_shape, None, m.eps), dims


class ReviewedRMSNormRule(ChannelRule):
    """The Hugging Face RMSNorm classes of ``rms.REVIEWED``, exactly (``rms.hf_class``), their ``forward`` the
    reviewed one (``rms.why_not_hf``): the input normalised over its last dimension in float32, cast back."""

    name = "rms-norm-transformers"

    def kind(self, c: type) -> bool:
        return (c.__module__, c.__qualname__) in rms.REVIEWED

    def claims(self, m: nn.Module) -> bool:
        return rms.hf_class(m)

    def why_not(self, m: nn.Module, name: str) -> str | None:
        why = rms.why_not_hf(m)
        return f"module '{name}': {why}" if why is not None else weight_and_bias_only(m, name)

    def normalised(self, m: nn.Module, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        dims = _trailing(m, a, 1)
        h = a.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
        return h.to(a.dtype), dims


register(InstanceNormRule())
register(GroupNormRule())
register(LayerNormRule())
if rms.TORCH_RMSNORM:
    register(RMSNormRule())
register(ReviewedRMSNormRule())
