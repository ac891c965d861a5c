"""Models whose rows are per-example by construction: the fast path's exact alternative to its probe.

The fast path attributes row i of every layer's input and output gradient to example i
(``grads.fast``). That holds when nothing between the inputs and the losses combines rows of
different examples. The fast path checks it every step with a probe (``BookKeeping._check_examples``:
a few secret random examples, each run alone, must get the gradients the rules attribute to them),
which catches a mixing confined to a few examples only with some probability per step. For a model
built only from modules that act on each example alone, the attribution is exact by construction,
and this module proves it from the model's structure, every step (modules can be replaced, and
hooks added, between steps):

* every module is of one of these exact types (a subclass may override ``forward``): ``nn.Sequential``;
  ``nn.Linear`` (acts on the last dimension: its input must have a batch dimension before it),
  ``nn.Conv1d``/``nn.Conv2d`` (their input batched: 3-D / 4-D), ``nn.GroupNorm`` (normalises within
  an example), ``nn.LayerNorm`` with trainable parameters (its input must have more dimensions than
  it normalises), ``nn.Embedding`` without ``max_norm`` and ``scale_grad_by_freq`` (a lookup per
  token); the elementwise activations ``ELEMENTWISE``; max and average pooling (over the
  trailing dimensions only); ``nn.Flatten`` from dimension 1 or later; or a clipbias model class
  that declares ``PER_EXAMPLE = True`` in its own body, whose ``forward`` (reviewed) only composes
  its children example by example (a subclass does not inherit the declaration);
* no module has a ``forward`` of its own on the instance, a torch module type's ``forward`` is the one
  it had when clipbias was imported, and no forward, forward-pre, backward or backward-pre hook is
  registered on any module or globally (a hook can rewrite rows with other examples' data);
* the batched layers' inputs have the batch dimension (checked on the activations of the step);
* the loss is one example's at a time: the default cross-entropy, or a ``loss_fn`` that returns the
  batch's total, which the fast path evaluates under ``vmap`` one example at a time (``BookKeeping``
  checks it; a ``loss_fn`` that returns per-example losses may combine examples, and is probed).

Dropout is not in the list: a random forward keeps its probe (one example recomputed among copies
of itself under the same draws). What this does not see, the probe cannot see either: code outside
the model's modules that rewrites tensors (saved-tensor hooks, torch function modes, torch
functions replaced before clipbias was imported); docs/results.md, "Equality and soundness".
"""

from __future__ import annotations

from torch import Tensor, nn

ELEMENTWISE = (nn.Identity, nn.Tanh, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
               nn.SiLU, nn.Mish, nn.Sigmoid, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Softplus,
               nn.Softsign, nn.Tanhshrink)
"""Activations applied to each entry alone."""

_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d)
_BATCHED_DIMS = {nn.Conv1d: 3, nn.Conv2d: 4}  # an input of one dimension less is one unbatched example
_TYPES = (nn.Sequential, nn.Linear, nn.Conv1d, nn.Conv2d, nn.GroupNorm, nn.LayerNorm, nn.Embedding, nn.Flatten,
          *ELEMENTWISE, *_POOLS)
_FORWARD = {t: t.forward for t in _TYPES}  # as imported: a forward replaced later on the class is not trusted
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def why_not(model: nn.Module) -> str | None:
    """None when the model's structure makes every row per-example (module doc), else why not."""
    glob = nn.modules.module
    if any(getattr(glob, h, None) for h in _GLOBAL_HOOKS):
        return "a global module hook is registered"
    for name, m in model.named_modules():
        t, label = type(m), (f"module '{name}' ({type(m).__name__})" if name else f"the model ({type(m).__name__})")
        if "forward" in vars(m):
            return f"{label} has a forward of its own on the instance"
        if any(getattr(m, h, None) for h in _HOOKS):
            return f"{label} has a hook"
        if t in _FORWARD:
            if t.forward is not _FORWARD[t]:
                return f"{label}: {t.__name__}.forward was replaced"
            if t is nn.Flatten and not m.start_dim >= 1:
                return f"{label} flattens from dimension {m.start_dim}: the batch dimension would be mixed in"
            if t is nn.LayerNorm and not any(p.requires_grad for p in m.parameters()):
                return f"{label} has no trainable affine parameters, so its input's dimensions go unchecked"
            if t is nn.Embedding and (m.max_norm is not None or m.scale_grad_by_freq):
                return f"{label} uses max_norm or scale_grad_by_freq (both depend on the batch's tokens)"
        elif vars(t).get("PER_EXAMPLE") is not True:
            return f"{label} is not a module whose rows are known to be per-example"
    return None


def batched(acts: dict[nn.Module, Tensor]) -> bool:
    """The step's inputs to the batched layers have their batch dimension (``acts``: layer -> input)."""
    for m, a in acts.items():
        want = _BATCHED_DIMS.get(type(m))
        if (want is not None and a.dim() != want) or (type(m) is nn.Linear and a.dim() < 2) or \
                (type(m) is nn.LayerNorm and a.dim() <= len(m.normalized_shape)):
            return False
    return True


def proven(model: nn.Module, acts: dict[nn.Module, Tensor]) -> bool:
    """Whether this step's rows are per-example by construction: ``why_not`` and ``batched``."""
    return why_not(model) is None and batched(acts)
