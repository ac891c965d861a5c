"""Models whose rows are per-example by construction: the fast path's exact alternative to its probe.

The fast path attributes row i of every layer's input and output gradient to example i
(``grads.fast``). That holds when nothing between the inputs and the losses combines rows of
different examples. The fast path checks it every step with a probe (``BookKeeping._check_examples``:
a few secret random examples, each run alone, must get the gradients the rules attribute to them),
which catches a mixing confined to a few examples only with some probability per step. For a model
built only from modules that act on each example alone, the attribution is exact by construction,
and this module proves it from the model's structure, every step (modules can be replaced, and
hooks added, between steps):

* every module is of one of these exact types (a subclass may override ``forward``; a layer with
  parameters is one of its layer rule's ``separable`` classes, ``grads.layers``): ``nn.Sequential``;
  ``nn.Linear`` (acts on the last dimension: its input must have a batch dimension before it),
  ``nn.Conv1d``/``nn.Conv2d``/``nn.Conv3d`` (their input batched: 3-D / 4-D / 5-D; any ``groups``
  and padding mode: both act within an example's channels and positions), ``nn.GroupNorm``
  (normalises within an example), ``nn.InstanceNorm1d``/``2d``/``3d`` (input batched as a Conv's:
  each example's channel normalised over its own positions, or by constant running statistics in
  evaluation; a training forward that updates running statistics changes a buffer, which the fast
  path refuses at every step whatever this proof says), ``nn.LayerNorm`` and ``nn.RMSNorm`` (each
  position normalised over its own trailing features: the input must have more dimensions than
  they normalise), ``nn.Embedding`` without ``max_norm`` and ``scale_grad_by_freq`` (a lookup per
  token); the elementwise activations ``ELEMENTWISE``, not in place, and ``nn.PReLU`` (each entry
  scaled by its channel's weight where negative); max and average pooling, 1-D
  to 3-D (over the trailing dimensions only); ``nn.Flatten`` from dimension 1 or later; or one of
  clipbias's reviewed model classes: defined in ``clipbias.models`` and declaring
  ``PER_EXAMPLE = True`` in its own body, whose ``forward`` (reviewed) only composes its children
  example by example (a subclass does not inherit the declaration, and a class of the user's that
  declares it, e.g. copied with a model's code, is not reviewed);
* no module has a function of its own on the instance (``forward``, ``_conv_forward``, a model's
  helper such as ``_features``, ``compile()``'s compiled call), a reviewed class's functions (and
  its clipbias bases') are the ones its module defines, the globals of the reviewed classes' modules
  (``F``, ``torch``, resnet's ``_shortcut_a``), the torch types' methods and the functions
  of ``torch``, ``torch.nn.functional``, ``torch._C._nn`` and ``torch.Tensor`` are the ones they
  had when clipbias was imported, and no forward, forward-pre, backward or backward-pre hook is
  registered on any module or globally (a hook can rewrite rows with other examples' data);
* every input of a Linear, Conv, InstanceNorm, LayerNorm or RMSNorm layer, frozen ones included, has
  the batch dimension (``watch`` records them in the step's forward; ``batched``): a frozen Conv1d given ``[B, L]`` reads the batch
  as one example's B channels and mixes every example into every row;
* no tensor subclass among the model's inputs, parameters and buffers (its ``__torch_function__``
  would run inside the layers), and no torch function mode (other than ``with torch.device`` and
  clipbias's keyed dropout, ``randomness.forward``),
  dispatch mode or saved-tensor hooks are active in the forward (``watch``): their code runs inside
  every layer, or rewrites what the backward reads;
* no activation works in place: on a batch whose rows share memory (sliding windows from
  ``Tensor.unfold``) it would apply itself once per row that covers an element, so an example's
  values would depend on which other windows are in the batch;
* the loss is one example's at a time: the default cross-entropy, or a ``loss_fn`` that returns the
  batch's total, which the fast path evaluates under ``vmap`` one example at a time (``BookKeeping``
  checks it; a ``loss_fn`` that returns per-example losses may combine examples, and is probed); and
  the labels are plain tensors (a subclass's ``__torch_function__`` would run inside the loss).

Dropout is not in the list: a random forward keeps its probe (one example recomputed among copies
of itself under the same draws). What this does not see, the probe cannot see either: torch
functions replaced before clipbias was imported; docs/results.md, "Equality and soundness".
"""

from __future__ import annotations

import inspect
import sys
import types
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import _get_current_function_mode_stack as _function_modes  # no public equivalent
from torch.utils._device import DeviceContext as _DeviceContext  # ``with torch.device(...)``: places tensors only
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_modes
from torch.utils._pytree import tree_leaves

from ..randomness.forward import KeyedForward
from ..models import gpt as _gpt, resnet as _resnet, scatter as _scatter, simple as _simple  # reviewed classes
from .layers import RULES, LayerRule

_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks  # (pack, unpack) or None

ELEMENTWISE = (nn.Identity, nn.Tanh, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
               nn.SiLU, nn.Mish, nn.Sigmoid, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Softplus,
               nn.Softsign, nn.Tanhshrink)
"""Activations applied to each entry alone."""

_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
_STRUCTURE = (nn.Sequential, nn.Flatten, *ELEMENTWISE, *_POOLS)
"""The modules without parameters that act on each example alone; the layers with them are their rules'
(``LayerRule.separable``: exact classes, ``RULES.separable_rule``)."""
_TYPES = (nn.Sequential, *(c for r in RULES.values() for c in r.separable), *_STRUCTURE[1:])
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_MODELS = "clipbias.models."  # where the reviewed model classes live
_PLAIN = (Tensor, nn.Parameter, getattr(nn.parameter, "Buffer", Tensor))  # parameters and buffers as torch makes them


def _methods(ns: object) -> dict[str, object]:
    """The functions (and descriptors wrapping them, and modules) a class or module holds itself, by name."""
    return {k: v for k, v in vars(ns).items()
            if callable(v) or isinstance(v, (staticmethod, classmethod, property, types.ModuleType))}


_BUILD = ("__init__", "__new__", "__setstate__")
"""Not compared: they run when a module is built or unpickled (``torch.compile`` wraps the first and the
last), and what they leave on an instance (functions, hooks, children) is checked on the instance."""

_CLASSES = tuple(dict.fromkeys(c for t in _TYPES for c in t.__mro__ if c is not object))  # nn.Module included
"""The classes whose methods are snapshotted when clipbias is imported (a rule registered later: when it is
registered, ``_admit``)."""
_REVIEWED = (_gpt, _resnet, _scatter, _simple)
"""The modules of the reviewed model classes: their globals (``F``, ``torch``, helpers such as resnet's
``_shortcut_a``) are what the reviewed forwards call, so they are snapshotted too (``_AS_IMPORTED``)."""
_NAMESPACES = (torch, F, torch._C._nn, torch.Tensor, torch._C.TensorBase,
               *dict.fromkeys(sys.modules[c.__module__] for c in _CLASSES), *_REVIEWED)  # their globals: F, torch, ...
_NOT_RUN = {torch: ("compile",)}
"""Functions of a namespace that build callables and compute on no example themselves: ``torch.compile``
(which Lightning replaces by a wrapper on import, to record its keyword arguments). What they build, a
compiled module's call, is checked on the instance."""
_AS_IMPORTED = {ns: {k: v for k, v in _methods(ns).items() if k not in _BUILD and k not in _NOT_RUN.get(ns, ())}
                for ns in _CLASSES + _NAMESPACES}
"""The torch types' methods (``forward``, ``__call__``, ``_conv_forward``, nn.Module's call machinery,
...) and the torch functions their forwards call, as they were when clipbias was imported: one
replaced later (to rewrite rows with other examples' data) is not trusted."""


def _torch_wrapper() -> object:
    """The code of torch's own lazy wrapper (``torch._disable_dynamo``), which importing ``torch._dynamo``
    puts around ``torch.manual_seed``: the function it wraps runs unchanged."""
    wrap = getattr(torch, "_disable_dynamo", None)
    return getattr(wrap(lambda: None), "__code__", None) if wrap is not None else None


_TORCH_WRAPPER = _torch_wrapper()


def _same(now: object, was: object) -> bool:
    return now is was or (getattr(now, "__wrapped__", None) is was and _TORCH_WRAPPER is not None
                          and getattr(now, "__code__", None) is _TORCH_WRAPPER)


def _inherited(cls: type, k: str, v: object) -> bool:
    """Whether ``v``, set on ``cls`` itself, shadows nothing: it is what ``cls`` inherited for ``k`` when
    clipbias was imported, or ``k`` is a name none of its bases defines (a method added for other code,
    e.g. transformers' ``nn.Module.smart_apply``, which no torch code calls)."""
    for c in cls.__mro__[1:]:
        had = _AS_IMPORTED.get(c, vars(c))
        if k in had:
            return had[k] is v
    return True


_SNAPSHOT = {ns: list(vars(ns).values()) for ns in _AS_IMPORTED}
"""Every value each namespace holds, as last accepted: an unchanged namespace costs one list comparison
(identity first), 0.02 ms for all of them a step instead of 0.17 ms name by name."""


_ADMITTED: dict[str, list] = {}
"""The namespaces each rule registered after import added to ``_AS_IMPORTED`` (removed with the rule)."""


def _admit(rule: LayerRule, added: bool) -> None:
    """A layer rule registered after clipbias was imported: its separable classes' methods (and their
    modules' globals) snapshotted as they are when it is registered, as torch's are at import; a rule
    removed: what it added dropped."""
    if not added:
        for ns in _ADMITTED.pop(rule.name, []):
            _AS_IMPORTED.pop(ns, None)
            _SNAPSHOT.pop(ns, None)
        return
    classes = [c for t in rule.separable for c in t.__mro__ if c is not object]
    new = [ns for ns in dict.fromkeys(classes + [sys.modules.get(c.__module__) for c in classes])
           if ns not in _AS_IMPORTED and ns is not None]
    for ns in new:
        _AS_IMPORTED[ns] = {k: v for k, v in _methods(ns).items() if k not in _BUILD}
        _SNAPSHOT[ns] = list(vars(ns).values())
    _ADMITTED[rule.name] = new


RULES.watchers.append(_admit)


def _unchanged(ns: object) -> bool:
    try:
        return list(vars(ns).values()) == _SNAPSHOT[ns]
    except Exception:  # a value whose == does not give a bool (a tensor): compare name by name
        return False


def _replaced() -> str | None:
    """The first torch method or function replaced since import, as ``Owner.name``, else None."""
    for ns, was in _AS_IMPORTED.items():
        if _unchanged(ns):
            continue
        now = vars(ns)  # changed since last accepted: name by name (torch's own wrappers are accepted)
        for k, v in was.items():
            if not _same(now.get(k), v):
                return f"{getattr(ns, '__name__', ns)}.{k}"
        if isinstance(ns, type) and len(methods := _methods(ns)) != len(was) + sum(k in now for k in _BUILD):
            added = [k for k, v in methods.items() if k not in was and k not in _BUILD and not _inherited(ns, k, v)]
            if added:  # a method set on the class, shadowing its base's
                return f"{ns.__name__}.{added[0]}"
        _SNAPSHOT[ns] = list(now.values())  # accepted as it is now
    return None


def _unreviewed(t: type) -> str | None:
    """None when ``t`` is a reviewed clipbias model class (``PER_EXAMPLE = True`` in its own body, defined
    in ``clipbias.models``) whose methods, and its clipbias bases', are the ones its module defines;
    else why not. A class of the user's that declares ``PER_EXAMPLE`` (copied with a model's code) is
    not reviewed."""
    if vars(t).get("PER_EXAMPLE") is not True or not t.__module__.startswith(_MODELS):
        return "is not a module whose rows are known to be per-example"
    home = sys.modules.get(t.__module__)
    if home not in _REVIEWED or _AS_IMPORTED[home].get(t.__name__) is not t:
        return "is not a module whose rows are known to be per-example (not a class its reviewed module defines)"
    for c in t.__mro__:
        if c is object or c in _AS_IMPORTED:
            continue
        if not c.__module__.startswith(_MODELS):
            return f"has a base class {c.__name__} that is not a reviewed model"
        for k, v in _methods(c).items():
            f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v.fget if isinstance(v, property) else v
            if not (inspect.isfunction(f) and f.__module__ == c.__module__
                    and f.__qualname__ == f"{c.__qualname__}.{k}"):
                return f"{c.__name__}.{k} was replaced"
    return None


def why_not(model: nn.Module) -> str | None:
    """None when the model's structure makes every row per-example (module doc), else why not."""
    glob = nn.modules.module
    if any(getattr(glob, h, None) for h in _GLOBAL_HOOKS):
        return "a global module hook is registered"
    replaced = _replaced()
    if replaced is not None:
        return f"{replaced} was replaced after clipbias was imported"
    for name, m in model.named_modules():
        why = _module_why_not(m)
        if why is not None:
            label = f"module '{name}' ({type(m).__name__})" if name else f"the model ({type(m).__name__})"
            sentence = why.startswith(("is ", "has ", "works ", "flattens ", "uses "))
            return f"{label} {why}" if sentence else f"{label}: {why}"
    return None


def _module_why_not(m: nn.Module) -> str | None:
    """Why one module voids the proof (the message without its name), else None; every step, so plain
    attribute reads."""
    own = next((k for k, v in vars(m).items() if callable(v)), None)
    if own is not None:  # forward, _conv_forward, a model's helper, a compiled call: run instead of the class's
        return f"has a {own} of its own on the instance"
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
        return "has a hook"
    for group in (m._parameters, m._buffers):
        sub = next((n for n, v in group.items() if v is not None and type(v) not in _PLAIN), None)
        if sub is not None:  # a weight whose __torch_function__ runs inside the layer (centring its input: 1.25 C)
            return f"its {sub} is a tensor subclass ({type(group[sub]).__name__})"
    if getattr(m, "inplace", False):
        return ("works in place: where the batch's rows share memory (sliding windows), it would write one "
                "example's values into another's")
    t = type(m)
    if t in _STRUCTURE:
        if t is nn.Flatten and not m.start_dim >= 1:
            return f"flattens from dimension {m.start_dim}: the batch dimension would be mixed in"
        return None
    rule = RULES.separable_rule(t)
    if rule is not None:  # its options (an Embedding's max_norm, say)
        return rule.why_not_separable(m)
    return _unreviewed(t)


class Inputs(dict):
    """``{Linear/Conv layer: the numbers of dimensions of its inputs}`` in a forward, and ``outside``:
    why something outside the modules took part in it (a tensor subclass as an input, a torch
    function or dispatch mode or saved-tensor hooks active), else None."""

    outside: str | None = None


def _subclass(m: nn.Module, inp: tuple) -> str | None:
    sub = next((type(a).__name__ for a in inp if isinstance(a, Tensor) and type(a) is not Tensor), None)
    if sub is not None:  # its __torch_function__ runs inside every layer it reaches
        return f"an input of a {type(m).__name__} is a tensor subclass ({sub})"
    return None


def _modes() -> str | None:
    """A torch function or dispatch mode, or saved-tensor hooks, active now. Checked when the model's
    forward starts: the forwards the proof admits enter none of them."""
    modes = [type(md).__name__ for md in _function_modes()  # clipbias's keyed dropout passes every other op through
             if not isinstance(md, _DeviceContext) and type(md) is not KeyedForward] + \
        [type(md).__name__ for md in _dispatch_modes()]
    if modes:
        return f"a torch function or dispatch mode ({modes[0]}) is active in the forward"
    if _saved_tensor_hooks(False) is not None:  # their unpack can rewrite what the backward reads
        return "saved-tensor hooks are active in the forward"
    return None


@contextmanager
def watch(model: nn.Module, known: Iterable[nn.Module] = ()) -> Iterator[Inputs]:
    """What ``proven`` needs of the forward passes run inside: the number of dimensions of every input
    that each Linear, Conv and LayerNorm of the model receives (frozen ones too; ``known``: layers whose
    inputs the caller records itself, not hooked), and whether code outside the modules took part: a
    tensor subclass among the model's inputs, a torch function or dispatch mode or saved-tensor hooks
    active when its forward starts. Such code runs inside every layer, and may rewrite rows with other
    examples' data. Only the model's own call is hooked besides those layers (a hook on every module
    slowed the cnn's step by 0.3 ms): the forwards the proof admits create no subclass (parameters and
    buffers must be plain: ``why_not``) and enter no mode."""
    seen, known = Inputs(), set(known)

    def layer(m: nn.Module, inp: tuple) -> None:
        seen.setdefault(m, []).append(inp[0].dim() if isinstance(inp[0], Tensor) else -1)

    def start(m: nn.Module, args: tuple, kwargs: dict) -> None:
        if seen.outside is None:
            seen.outside = _subclass(m, tuple(tree_leaves((args, kwargs)))) or _modes()
    handles = [m.register_forward_pre_hook(layer) for m in model.modules() if _dims(m) is not None and m not in known]
    handles.append(model.register_forward_pre_hook(start, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def batched(inputs: dict[nn.Module, Tensor | int | list[int]]) -> bool:
    """Every input of the batched layers has its batch dimension (``inputs``: layer -> its input, or
    the numbers of dimensions of its inputs, as ``watch`` records them)."""
    for m, seen in inputs.items():
        want = _dims(m)
        if want is None:
            continue
        lo, hi = want
        for a in seen if isinstance(seen, list) else [seen]:
            d = a if isinstance(a, int) else a.dim()
            if d < lo or (hi is not None and d > hi):
                return False
    return True


def _dims(m: nn.Module) -> tuple[int, int | None] | None:
    """The dimensions a batched input of ``m`` has, where ``m``'s exact class is a separable rule's that
    requires some (``LayerRule.input_dims``: a Linear's input at least 2, a Conv2d's exactly 4, a LayerNorm's
    more than it normalises), else None."""
    rule = RULES.separable_rule(type(m))
    return None if rule is None else rule.input_dims(m)


def proven(model: nn.Module, inputs: dict[nn.Module, Tensor | int | list[int]], labels: list[Tensor] = ()) -> bool:
    """Whether this step's rows are per-example by construction: ``why_not``, nothing outside the
    modules in the forward, ``batched`` (``inputs``: what ``watch`` recorded in the step's forward), and
    the ``labels`` plain tensors (a subclass's ``__torch_function__`` would run inside the loss)."""
    return why_not(model) is None and getattr(inputs, "outside", None) is None and batched(inputs) and all(
        type(t) is Tensor for t in labels)
