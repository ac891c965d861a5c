"""Which models clipbias can train privately, and the fixes for the common ones that it cannot as they are
(Opacus's ``ModuleValidator``).

A layer that mixes the examples of a batch breaks per-example clipping: BatchNorm normalises each example with
the batch's statistics (and keeps running statistics of the private data in its buffers), so one example moves
every other example's gradient and the sensitivity is no longer the clip. ``fix`` replaces it by GroupNorm,
which normalises each example on its own, and turns in-place activations into out-of-place ones (the fast
gradient path refuses a layer output changed in place).
"""

from __future__ import annotations

import math

from torch import nn

from ..errors import ConfigError
from ..grads.fast import why_unsupported

_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_INSTANCENORM = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


class ModuleValidator:
    """``validate(model)`` lists what keeps ``model`` from private training; ``fix(model)`` repairs what it can."""

    @staticmethod
    def validate(model: nn.Module, *, strict: bool = False) -> list[ConfigError]:
        """The model's problems for private training.

        Args:
            model: The model to check.
            strict: Raise the first problem instead of returning the list.

        Returns:
            The problems, each a ``ConfigError`` naming the module and the fix (BatchNorm, InstanceNorm with
                running statistics, an Embedding with ``max_norm``, a sequence-first recurrent layer). An empty
                list: every example's computation depends on that example alone.

        Raises:
            ConfigError: the first problem, when ``strict``.
        """
        errors = []
        for name, m in model.named_modules():
            where = f"module '{name or type(model).__name__}' ({type(m).__name__})"
            if isinstance(m, _BATCHNORM):
                errors.append(ConfigError(f"{where} normalises with the batch's statistics, so each example's "
                                          f"gradient depends on the others: use clipbias.fix(model) (GroupNorm)"))
            elif isinstance(m, _INSTANCENORM) and m.track_running_stats:
                errors.append(ConfigError(f"{where} keeps running statistics of the private data in its buffers: "
                                          f"use clipbias.fix(model) (track_running_stats=False)"))
            elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
                errors.append(ConfigError(f"{where} has max_norm={m.max_norm}: its forward renormalises, in place, "
                                          f"the weight rows of the tokens in the batch, which would release which "
                                          f"tokens the private batch holds without noise (the step refuses it). "
                                          f"Build it with max_norm=None and, if you want the bound, renormalise "
                                          f"all rows after each optimizer step (a public post-processing)"))
            elif isinstance(m, (nn.LSTM, nn.GRU, nn.RNN)) and not m.batch_first:
                errors.append(ConfigError(f"{where} is sequence-first: build it with batch_first=True so that each "
                                          f"row of the input is one example"))
        if strict and errors:
            raise errors[0]
        return errors

    @staticmethod
    def is_valid(model: nn.Module) -> bool:
        """Whether ``validate(model)`` finds no problem."""
        return not ModuleValidator.validate(model)

    @staticmethod
    def fix(model: nn.Module) -> nn.Module:
        """Repair what can be repaired: every BatchNorm replaced by a GroupNorm of gcd(32, channels) groups
        (affine like the BatchNorm), InstanceNorm without running statistics and in-place activations made
        out-of-place. Other problems (``validate``) stay and are listed.

        Args:
            model: The model, changed in place.

        Returns:
            ``model`` itself.
        """
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                new = _fixed(child)
                if new is not child:
                    setattr(parent, child_name, new)
        return model

    @staticmethod
    def fast_path_notes(model: nn.Module) -> str | None:
        """Why the fast gradient path (``grad_path="fast"``) does not apply to ``model``.

        Args:
            model: The model to check.

        Returns:
            The reason, or None where it applies. A model it does not apply to trains on the rows path
                (per-example gradients by ``torch.func``), which takes any layer.
        """
        return why_unsupported(model)


def _fixed(m: nn.Module) -> nn.Module:
    if isinstance(m, _BATCHNORM):
        c = m.num_features
        g = nn.GroupNorm(math.gcd(32, c), c, eps=m.eps, affine=m.affine)
        return g.to(m.weight.device) if m.affine else g
    if isinstance(m, _INSTANCENORM) and m.track_running_stats:
        return type(m)(m.num_features, eps=m.eps, affine=m.affine, track_running_stats=False)
    if getattr(m, "inplace", False) is True and not m._parameters:
        m.inplace = False
    return m


def fix(model: nn.Module) -> nn.Module:
    """``ModuleValidator.fix`` (``clipbias.fix``): BatchNorm -> GroupNorm, in-place activations out-of-place.

    Args:
        model: The model, changed in place.

    Returns:
        ``model`` itself.
    """
    return ModuleValidator.fix(model)
