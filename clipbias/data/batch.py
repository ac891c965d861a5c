"""Batches of any structure: a tensor, or tuples, lists and dicts of tensors (nested).

The engine, the row sources and the loaders see a batch only through these functions, so a model
whose input is ``{"input_ids": ..., "attention_mask": ...}`` or ``(tokens, lengths)`` trains like one
whose input is a tensor. Every tensor in a batch has the examples on its first dimension; the
model is called ``model(x)`` for a tensor, ``model(*x)`` for a tuple or list and ``model(**x)`` for a
dict (the Hugging Face convention). ``torch.func.vmap`` maps over the same structures natively.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Union

import torch
from torch import Tensor, nn

from ..errors import ConfigError

Batch = Union[Tensor, tuple, list, Mapping]
"""A tensor, or a (nested) tuple, list or dict of tensors, examples on the first dimension."""


def tree_map(fn: Callable[[Tensor], Any], x: Batch) -> Batch:
    """``fn`` applied to every tensor of ``x``, keeping its structure (a Mapping keeps its type where it
    can be built from its items, a Hugging Face ``ModelOutput`` say, else becomes a dict; a namedtuple
    stays one). Anything else in a batch is refused: it has no example dimension."""
    if isinstance(x, Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        return _mapping(type(x), {k: tree_map(fn, v) for k, v in x.items()})
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(tree_map(fn, v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(tree_map(fn, v) for v in x)
    raise ConfigError(f"a batch must be a tensor or a tuple, list or dict of tensors, got {type(x).__name__}; "
                      f"make the dataset items (or the collate function's output) tensors")


def cat(parts: list) -> Any:
    """Batches of one structure concatenated along the example dimension (tensors, mappings, tuples)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.cat(parts)
    if isinstance(first, Mapping):
        return _mapping(type(first), {k: cat([p[k] for p in parts]) for k in first})
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(cat([p[i] for p in parts]) for i in range(len(first))))
    return type(first)(cat([p[i] for p in parts]) for i in range(len(first)))


def stack(parts: list, dim: int = 1) -> Any:
    """Batches of one structure stacked leaf by leaf along ``dim`` (the views of each example: ``[b, K, ...]``);
    tensors whose shapes differ are refused (``ConfigError``)."""
    first = parts[0]
    if isinstance(first, Tensor):
        if any(not isinstance(p, Tensor) or p.shape != first.shape for p in parts):
            raise ConfigError(f"tensors of shapes {[tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__ for p in parts]} "
                              f"cannot be stacked: every view must have the same shapes")
        return torch.stack(parts, dim)
    if isinstance(first, Mapping):
        if any(not isinstance(p, Mapping) or set(p) != set(first) for p in parts):
            raise ConfigError("views of different structures (other keys) cannot be stacked")
        return _mapping(type(first), {k: stack([p[k] for p in parts], dim) for k in first})
    if isinstance(first, (tuple, list)):
        if any(not isinstance(p, (tuple, list)) or len(p) != len(first) for p in parts):
            raise ConfigError("views of different structures (other lengths) cannot be stacked")
        items = [stack([p[i] for p in parts], dim) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    raise ConfigError(f"a batch must be a tensor or a tuple, list or dict of tensors, got {type(first).__name__}")


def map_tensors(fn: Callable[[Tensor], Any], x: Any) -> Any:
    """``fn`` applied to every tensor of ``x``, its structure kept (a ``ModelOutput`` stays one); unlike
    ``tree_map``, anything that is not a tensor, tuple, list or mapping (a cache object) is kept as it is."""
    if isinstance(x, Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        return _mapping(type(x), {k: map_tensors(fn, v) for k, v in x.items()})
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(map_tensors(fn, v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(map_tensors(fn, v) for v in x)
    return x


def detached(x: Any) -> Any:
    """``x`` with every tensor detached (``map_tensors``)."""
    return map_tensors(Tensor.detach, x)


def _mapping(kind: type, items: dict) -> Mapping:
    """``items`` as a ``kind`` (built from keyword arguments, as a dataclass-like ModelOutput is, or from the
    dict), or as the dict itself."""
    if kind is dict:
        return items
    for build in (lambda: kind(**items), lambda: kind(items)):
        try:
            out = build()
        except Exception:  # a constructor that takes neither: the plain dict
            continue
        if isinstance(out, Mapping) and dict(out.items()).keys() == items.keys():
            return out
    return items


def leaves(x: Batch) -> list[Tensor]:
    """The tensors of ``x`` in a fixed order."""
    out: list[Tensor] = []
    tree_map(out.append, x)
    return out


def size(x: Batch) -> int:
    """The number of examples: the common first dimension of every tensor of ``x``."""
    ts = leaves(x)
    if not ts or any(t.dim() == 0 for t in ts):
        raise ConfigError("a batch needs at least one tensor and every tensor needs an example dimension "
                          "(got a scalar or no tensor); stack the examples on the first dimension")
    sizes = {t.shape[0] for t in ts}
    if len(sizes) != 1:
        raise ConfigError(f"the tensors of a batch disagree on the number of examples (first dimensions "
                          f"{sorted(sizes)}); every tensor needs one row per example")
    return sizes.pop()


def take(x: Batch, idx: Tensor | slice | int) -> Batch:
    """The examples ``idx`` (indices or a slice) of every tensor in ``x``; an int gives one example
    without its batch dimension."""
    if isinstance(idx, Tensor):
        return tree_map(lambda t: t[idx.to(t.device) if t.device != idx.device else idx], x)
    return tree_map(lambda t: t[idx], x)


def to(x: Batch, device: torch.device | str, non_blocking: bool = False) -> Batch:
    """``x`` on ``device`` (tensors already there are not copied)."""
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), x)


def unsqueeze(x: Batch) -> Batch:
    """One example as a batch of one (inside ``vmap``)."""
    return tree_map(lambda t: t.unsqueeze(0), x)


def arguments(x: Batch) -> tuple[tuple, dict]:
    """The model's ``(args, kwargs)`` for input ``x``: ``(x,)``, ``x`` as positional arguments (tuple,
    list) or as keyword arguments (dict)."""
    if isinstance(x, Mapping):
        return (), dict(x)
    if isinstance(x, (tuple, list)):
        return tuple(x), {}
    return (x,), {}


def call(model: nn.Module | Callable, x: Batch) -> Any:
    """``model(x)``, ``model(*x)`` or ``model(**x)`` by the structure of the input."""
    args, kwargs = arguments(x)
    return model(*args, **kwargs)


def describe(x: Batch) -> str:
    """Shapes and dtypes of one example of ``x``, for error messages."""
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape[1:])}, {x.dtype}"
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in x) + ")"
    return type(x).__name__
