"""Per-example losses for the fast path (an object ``grads.fast.BookKeeping`` holds: ``losses``): the loss function's own
``[b]`` losses when it returns them, else a summed loss mapped over the examples one at a time, decided
once on zeros so that a summed loss never sees a batch whole."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from typing import Callable

from ..data import batch
from ..data.batch import Batch
from ..errors import ConfigError
from .rows import cross_entropy

SHADOW_EXAMPLES = 2
"""Examples in the zeros a summed loss_fn is first called on (``_shadow``)."""

_NO_SAVED_HOOKS = "saved-tensor hooks inside a summed loss_fn (PerExampleLosses.losses_alone)"


class PerExampleLosses:
    """``losses(out, y, b)``: the ``[b]`` per-example losses of ``loss_fn``. State: ``vector`` (whether ``loss_fn``
    returns per-example losses: None until decided, once), ``alone`` (whether the last summed loss was evaluated
    one example at a time with saved-tensor hooks off: the caller sets it True before a step), and ``observer``
    (while set, called with every result: the graph proof's recording of the loss, ``fast_checks``)."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn = loss_fn
        self.vector: bool | None = None
        self.alone = True
        self.observer: Callable[[Tensor], None] | None = None

    def __call__(self, out, y: Batch, b: int) -> Tensor:
        got = self.losses(out, y, b)
        if self.observer is not None:
            self.observer(got)
        return got

    def losses(self, out, y: Batch, b: int) -> Tensor:
        """The ``[b]`` per-example losses: the loss function's own when it returns them, else it is
        mapped over the examples (a loss that returns the batch sum)."""
        if self.loss_fn is cross_entropy:
            return F.cross_entropy(out, y, reduction="none")
        if getattr(self.loss_fn, "per_example", False):  # one example's loss per row by construction
            return self.loss_fn(out, y)
        if self.vector is None:  # decided once, on zeros: a summed loss never sees a batch whole. On the
            # step's output, a hook it registered there ran in the step's backward (one normalising the logits'
            # gradient by the batch's norm moved the clipped sum by 1.27 C), and a statistic it kept (a
            # temperature set from the first batch) entered every later step (an example of the first step
            # moved the second's sum by 0.65 C): benchmarks/redteam/separable/rt_loss_hooks.py, rt_loss_first_call.py
            # Two examples' zeros tell a total from per-example losses (zeros of the whole output would
            # double a language model's first-step peak: 1.65 GB of logits for a 64M GPT at B = 128)
            try:
                zeros = batch.tree_map(_shadow, out), batch.tree_map(lambda t: _shadow(t, grad=False), y)
            except ConfigError:  # an output holding other objects (a Hugging Face cache): decided on the batch,
                zeros, self.alone = None, False  # and this step probed
            losses = self.loss_fn(out, y) if zeros is None else None
            got = losses if zeros is None else self.loss_fn(*zeros)
            self.vector = got.dim() == 1 and got.shape[0] == (b if zeros is None else SHADOW_EXAMPLES)
        else:
            losses = None
        if self.vector:
            losses = self.loss_fn(out, y) if losses is None else losses
            if losses.shape != (b,):
                raise ConfigError(f"loss_fn returned per-example losses of shape (b,) before and shape "
                                  f"{tuple(losses.shape)} now for b = {b}: return one loss per example always")
            return losses
        return self.losses_alone(out, y)

    def one_loss(self, o, t) -> Tensor:
        return self.loss_fn(batch.unsqueeze(o), batch.unsqueeze(t)).sum()

    def losses_alone(self, out, y: Batch) -> Tensor:
        """A summed ``loss_fn`` evaluated one example at a time (``vmap``), with saved-tensor hooks
        disabled inside it: their unpack runs in the backward, outside ``vmap``, on the whole batch's
        tensors (one adding the batch mean to a saved tensor moved the clipped sum by 5.41 C with the
        probe skipped: benchmarks/redteam/separable/rt_loss_hooks.py). A loss that enters them is
        evaluated again with them, and ``self.alone = False``: the step is probed. (Tensor and
        graph-node hooks that a loss registers inside ``vmap`` do not run in the backward.)"""
        try:
            with torch.autograd.graph.disable_saved_tensors_hooks(_NO_SAVED_HOOKS):
                return torch.vmap(self.one_loss)(out, y)
        except RuntimeError as err:
            if _NO_SAVED_HOOKS not in str(err):
                raise
        self.alone = False
        return torch.vmap(self.one_loss)(out, y)


def _shadow(t: Tensor, grad: bool = True) -> Tensor:
    """Zeros shaped as ``SHADOW_EXAMPLES`` examples of ``t``, off the step's graph (requiring grad where
    floating, so that a loss may register hooks on them or change them in place: nothing of it
    reaches the step)."""
    z = t.new_zeros((SHADOW_EXAMPLES, *t.shape[1:]))
    return z.requires_grad_() * 1 if grad and z.is_floating_point() else z
