"""RMS normalisations on the fast path: ``torch.nn.RMSNorm`` and reviewed Hugging Face classes.

An RMS normalisation computes ``weight * x / rms(x)`` over its trailing features, so example i's
weight gradient is ``sum over positions of g * x / rms(x)``: the fast path forms it from the layer's
input and output gradient, one value per feature, as it does for LayerNorm (``grads.layers.norms``).

Hugging Face's decoders (Llama, Qwen2, Qwen3, Mistral) define their own class, which normalises
in float32 and casts back before the weight multiplies::

    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)

Such a class is accepted when it is one of ``REVIEWED`` (by module path and class name, the class
its module defines: transformers is not imported here) and its ``forward`` is this one: the same
bytecode, constants, names and arguments as ``_reviewed_forward`` below, reading the real ``torch``
module (a class whose ``forward`` was replaced, e.g. by a hub kernel, or edited, is refused). Other
RMSNorm variants (Gemma's ``1 + weight``, OLMo's cast after the product) are not reviewed.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

TORCH_RMSNORM: tuple[type, ...] = (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()
"""``torch.nn.RMSNorm`` (torch >= 2.4), else empty."""

REVIEWED = frozenset({
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
    ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"),
})
"""Hugging Face RMSNorm classes whose ``forward`` was reviewed (transformers 5.x): (module, class name)."""


def _reviewed_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


_FIELDS = ("co_code", "co_consts", "co_names", "co_varnames", "co_argcount", "co_posonlyargcount",
           "co_kwonlyargcount", "co_freevars", "co_cellvars")


def same_code(f: object, reviewed=_reviewed_forward) -> bool:
    """``f`` computes what ``reviewed`` computes: same bytecode, constants, names and arguments (line
    numbers and file aside), the same defaults (none, where ``reviewed`` has none), and ``torch`` in its
    globals is torch."""
    code, want = getattr(f, "__code__", None), reviewed.__code__
    if code is None or getattr(f, "__defaults__", None) != reviewed.__defaults__ or \
            getattr(f, "__kwdefaults__", None) != reviewed.__kwdefaults__:
        return False
    consts = tuple(c for c in code.co_consts if not isinstance(c, str))  # a docstring aside
    return (all(getattr(code, k) == getattr(want, k) for k in _FIELDS if k != "co_consts")
            and consts == tuple(c for c in want.co_consts if not isinstance(c, str))
            and getattr(f, "__globals__", {}).get("torch") is torch)


def reviewed_class(m: nn.Module, reviewed) -> bool:
    """``m``'s class is one of ``reviewed`` ((module, qualified name) pairs), the class its module defines
    (not a subclass, not a class of the same name elsewhere), whatever its forward."""
    t = type(m)
    if (t.__module__, t.__qualname__) not in reviewed:
        return False
    home = sys.modules.get(t.__module__)
    return home is not None and getattr(home, t.__qualname__, None) is t


def hf_class(m: nn.Module) -> bool:
    """``m``'s class is one of ``REVIEWED`` (the class its module defines), whatever its forward."""
    return reviewed_class(m, REVIEWED)


def why_not_hf(m: nn.Module) -> str | None:
    """None when ``m`` is a reviewed Hugging Face RMSNorm whose forward is the reviewed one (and
    not overridden on the instance), with a one-dimensional weight; else why not."""
    if not hf_class(m):
        return f"{type(m).__name__} is not a reviewed RMSNorm class"
    if "forward" in m.__dict__ or not same_code(type(m).forward):
        return f"{type(m).__name__}.forward is not the reviewed RMSNorm forward (replaced or edited)"
    w = getattr(m, "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 1 or not isinstance(getattr(m, "variance_epsilon", None), float):
        return f"{type(m).__name__} has a weight that is not one-dimensional, or no float variance_epsilon"
    return None
