"""Per-example gradients behind one interface.

``PerSampleGradients`` is the seam: today ``FuncGradients`` (``torch.func``: ``functional_call`` +
``vmap(grad)``); a ghost-norm / book-keeping backend and a torch.distributed backend implement the
same call later. Gradients come back *flattened*, one row per example, in the order of
``ParamLayout``: every later stage (clip, normalise, error feedback) is then plain tensor algebra on
a ``[b, d]`` matrix with the global L2 norm over all trainable parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from .errors import NonFiniteGradientError, UnsupportedModelError

LossFn = Callable[[Tensor, Tensor], Tensor]

_CROSS_EXAMPLE = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


def check_model(model: nn.Module) -> None:
    """Refuse models that mix examples: per-example sensitivity would not hold.

    BatchNorm in train mode normalises with batch statistics, so one example's gradient depends on
    every other example. A module can also declare ``mixes_examples = True``.
    """
    for name, m in model.named_modules():
        if (isinstance(m, _CROSS_EXAMPLE) and m.training) or getattr(m, "mixes_examples", False):
            raise UnsupportedModelError(
                f"module '{name or type(model).__name__}' ({type(m).__name__}) mixes examples within a "
                f"batch, so per-example gradients and the DP guarantee are undefined. Replace it with "
                f"nn.GroupNorm (e.g. nn.GroupNorm(num_groups, num_channels)) or nn.LayerNorm.")


@dataclass(frozen=True)
class ParamLayout:
    """Names and shapes of the trainable parameters, and the flat <-> structured maps."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]

    @classmethod
    def of(cls, model: nn.Module) -> "ParamLayout":
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise UnsupportedModelError("the model has no trainable parameters (all requires_grad=False)")
        return cls(tuple(n for n, _ in named), tuple(p.shape for _, p in named))

    @property
    def numels(self) -> list[int]:
        return [s.numel() for s in self.shapes]

    @property
    def dim(self) -> int:
        return sum(self.numels)

    def flatten(self, grads: dict[str, Tensor]) -> Tensor:
        """``{name: [b, *shape]}`` -> ``[b, d]``."""
        return torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in self.names], dim=1)

    def unflatten(self, vec: Tensor) -> list[Tensor]:
        """``[d]`` -> one tensor per parameter, in layout order."""
        return [c.view(s) for c, s in zip(torch.split(vec, self.numels), self.shapes)]

    def params(self, model: nn.Module) -> list[nn.Parameter]:
        named = dict(model.named_parameters())
        return [named[n] for n in self.names]


class PerSampleGradients(Protocol):
    """Computes ``([b, d] per-example gradients, [b] per-example losses)`` for one batch."""

    layout: ParamLayout

    def __call__(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]: ...


def cross_entropy(out: Tensor, y: Tensor) -> Tensor:
    """Default per-example loss: cross-entropy of one example (a batch of one)."""
    return nn.functional.cross_entropy(out, y, reduction="sum")


class FuncGradients:
    """``torch.func`` backend: ``vmap(grad(loss of one example))`` over the batch.

    Frozen parameters (``requires_grad=False``) and buffers are passed as constants. Randomness
    inside the model (dropout) is drawn independently per example.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn = cross_entropy) -> None:
        check_model(model)
        self.model = model
        self.loss_fn = loss_fn
        self.layout = ParamLayout.of(model)

        def loss_one(params: dict[str, Tensor], consts: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
            out = functional_call(self.model, (params, consts), (x.unsqueeze(0),))
            return self.loss_fn(out, y.unsqueeze(0))

        self._fn = vmap(grad_and_value(loss_one), in_dims=(None, None, 0, 0), randomness="different")

    def __call__(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        check_model(self.model)  # a BatchNorm switched to train mode after construction is refused too
        trainable = set(self.layout.names)
        params = {n: p.detach() for n, p in self.model.named_parameters() if n in trainable}
        consts = {n: p.detach() for n, p in self.model.named_parameters() if n not in trainable}
        consts.update(dict(self.model.named_buffers()))
        grads, losses = self._fn(params, consts, x, y)
        return self.layout.flatten(grads), losses.detach()


def check_finite(g: Tensor, indices: Tensor | None = None) -> None:
    """Raise ``NonFiniteGradientError`` naming the offending examples; callers do it before any update."""
    bad = ~torch.isfinite(g).all(dim=1)
    if bad.any():
        rows = bad.nonzero().flatten()
        ids = (indices[rows] if indices is not None else rows).tolist()[:10]
        raise NonFiniteGradientError(
            f"non-finite (NaN/Inf) per-example gradient for example(s) {ids}"
            f"{' ...' if int(bad.sum()) > 10 else ''}; nothing was updated. Check the input data for "
            f"NaN/Inf, lower the learning rate, or use a numerically stable loss.")
