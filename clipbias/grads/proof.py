"""A proof, from the step's own aten-level program, that no operation lets examples see each other: where it
holds, the fast path skips its probe (``RuntimeChecks.check_examples``).

The fast path attributes row i of every layer's input and output gradient to example i (``grads.fast``).
Its probe checks that every step by recomputing a few secret examples alone, a sizeable part of a step
(docs/privacy.md, "The graph proof"). This module proves it instead, from the operations the step ran:

* **The program.** The model's call in the step (and its loss, where that is one plain call) runs under a
  ``TorchDispatchMode`` (``watch``) that records every aten operation below autograd: the operator, its
  non-tensor arguments by value, and each tensor argument by where it came from (an input or label, the
  output of an earlier operation, a parameter or buffer by name, a small constant made in the forward
  by value, any other tensor by identity). The record is the straight-line program this step computed:
  Python control flow, module attributes, globals and counters are resolved in it. Dead operations (the
  fast path's detached copies of layer inputs) are dropped (``_live``).
* **The analysis** (``analyze``) follows the batch dimension through the program: every tensor holds no
  example, or the batch at one dimension ``d``, each example's slice of size ``k`` there a function of
  that example alone (``k > 1`` where the batch is folded with the positions, as a Linear on
  ``[B, T, F]`` views it as ``[B T, F]``). An operation passes only by a rule of ``_RULES`` that gives its
  outputs' batch dimensions from its inputs': element-wise operations, views and reshapes that keep the
  batch whole, reductions, softmax and layer/group norms over other dimensions, matrix products that do
  not sum over the batch, embedding lookups, attention kernels with the batch among the leading
  dimensions and no dropout, convolution and pooling over an example's positions. Operations on
  batch-free tensors only are batch-free. Refused: any other operation on batch data, a rule's
  condition unmet (a reduction over the batch, ``x - x.mean(0)``, BatchNorm in training, attention
  across the batch dimension, a sequence-first layout), a random operation, a write to a parameter,
  buffer, input or a view of one, a tensor from outside the forward that is not a parameter or buffer,
  uninitialised memory read, a Python read of a value of several examples (``.item()``; a batch-wide
  ``all`` that was True, or ``any`` that was False, passes: each example alone gives the same), and,
  in Python during the recorded call (``_watch_python``), a read of tensor memory outside torch's
  operators, a gradient hook, a ``grad_fn`` read, a custom autograd ``Function`` (the backward is not
  recorded), saved-tensor hooks, a global module hook and a draw from Python's or numpy's generator.
  Every trainable layer's input must hold no example or the batch at dimension 0, its output the batch
  at dimension 0 (a batch-free output of b rows is taken as the batch's, so that what reads it keeps
  its rows apart: its gradient rows are each example's), and the losses (else the outputs) too.
* **An example alone.** The first example is run as a batch of one (what the probe runs) and recorded;
  the two programs must be the same up to the batch size (``_aligned``, ``_sized``): an int may differ
  only as a size that follows the batch's (``k b`` in the batch, ``k`` alone) in a shape or slice
  argument (``SIZE_ARGS``), at the batch's dimension of the output, or at a dimension a constant is
  filled or expanded along (``UNIFORM``: then it holds the batch). A float such as ``1 / b``,
  ``arange(b)`` or another branch refuses: a row that depends on the batch's size or its position.
* **Each step.** A program already proven (the same operations, arguments and sources, compared exactly)
  is looked up (``Proofs``, ``CACHED`` per engine); another one is analysed. A model swapped to train or
  eval, a module replaced, a hook added, another sequence length or a counter that changes a branch
  changes the program.

Soundness: on a proven step each example's layer inputs, output gradients and loss come from that
example's inputs and batch-free values alone, by the same program as the example run alone, so its
attributed gradient is its own, which is what the probe compares (to its rounding tolerance). Outside
what this sees: C++ code reading tensor memory around torch's operators, operations run in another
thread during the forward, a model whose batch-of-one computation changes later while its batch program
does not (the example alone is recorded when a program is first proven), and a function of the batch
size equal at b and 1. A forward under autocast, or one that draws random numbers other than the engine's
keyed dropout, keeps the probe (``RuntimeChecks.graph_watch``). **Keyed dropout** (the engine's step:
``clipbias.randomness.forward``) is proven: a tensor the keyed mode made as a mask in this pass
(``forward.mask_of``, by identity) is a source of the batch, ``("k", call, p)``, one row per example: row r is
drawn from example r's own keystream (the key, the step, the call and its index alone), which is what its masks
are run alone; the example alone is recorded under its own masks (``forward.only``), so the call numbers and
rates must match too."""

from __future__ import annotations

import random
import secrets
import sys
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch
from torch import Tensor, nn
from torch.autograd.function import BackwardCFunction
from torch.overrides import handle_torch_function, has_torch_function_unary
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..randomness import forward
from .layers import RULES

_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks  # (pack, unpack) or None

ENABLED = True
"""Whether the fast path tries the proof at all (tests of the probe itself turn it off)."""

CACHED = 8
"""Proven (and refused) programs kept per engine (``Proofs``)."""

GIVE_UP = 3
"""Consecutive steps not proven after which a step is recorded only every ``RETRY`` steps (the probe stays)."""

RETRY = 50

SPOT = 16
"""A step whose program was proven before keeps its probe anyway with probability ``1 / SPOT`` (a secret draw from
the OS CSPRNG; 0: never): a model that computes otherwise than its recorded program only on the steps it expects
to go unprobed, through memory the recording cannot see (a numpy view of a buffer kept from before, C++ code), is
met by the probe on a secret share of its steps (``Proofs.proven``; docs/privacy.md, "The graph proof")."""

_SPOT_RNG = secrets.SystemRandom()

SMALL = 64
"""Tensors from outside the forward with at most this many elements are compared by value."""

_READS = ("tolist", "numpy", "__array__", "data_ptr", "untyped_storage", "storage", "__dlpack__")
"""Tensor methods that read memory without an aten operation: watched during the recorded call (``_WATCHED``)."""

_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called")

_LIFT = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class Src(tuple):
    """Where a tensor argument came from (``Program``): a tuple tagged ``i``, ``o``, ``p``, ``v`` or ``x``."""

    __slots__ = ()


class Program:
    """What ``watch`` records of one call of the model: ``ops`` (``(operator, arguments, keyword arguments,
    outputs)``, tensor arguments as sources: ``("i", k)`` the model's k-th input tensor, ``("o", n, j)``
    output j of operation n, ``("p", name, ...)`` a parameter or buffer, ``("v", ...)`` a small tensor by
    value, ``("x", id, ...)`` any other by identity), the sources of the model's output tensors, of each
    trainable layer's input and output as its rule reads them, and ``why``: why the call cannot be proven
    whatever its operations (a Python read of tensor memory, a generator that moved), else None."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self.shapes: dict[tuple, tuple] = {}  # source -> shape
        self.dtypes: dict[tuple, torch.dtype] = {}
        self.outputs: list[tuple] = []
        self.layers: list[tuple[tuple | None, tuple | None]] = []
        self.inputs: list[tuple] = []  # (shape, dtype) of each input tensor
        self.b = 0
        self.why: str | None = None
        self.names: frozenset = frozenset()  # the model's parameters' and buffers' names (the sources ``p``)
        self.done = False
        self.failed_at: int | None = None  # the operation the analysis stopped at
        self.losses: tuple | None = None  # the source of the per-example losses, where recorded
        self.shared: set[int] = set()  # the layers whose rows are one row shared by the batch, expanded
        self.end: Callable = lambda losses=None: None  # ``watch``'s: the losses computed, the recording ends


class _Recorder(TorchDispatchMode):
    """Records every aten operation of the model's call into a ``Program`` (module doc)."""

    def __init__(self, prog: Program, inputs: list[Tensor], named: dict[int, str]) -> None:
        super().__init__()
        self.prog, self.named = prog, named
        self.where: dict[int, tuple] = {}
        for k, t in enumerate(inputs):
            if id(t) not in self.where:  # labels that are an input too (a language model's ids) stay the input
                self._set(t, ("i", k))

    def _set(self, t: Tensor, src: tuple) -> None:
        src = Src(src)
        self.where[id(t)] = (weakref.ref(t), src)
        self.prog.shapes[src] = tuple(t.shape)
        self.prog.dtypes[src] = t.dtype

    def source(self, t: Tensor, by_value: bool = False) -> tuple:
        hit = self.where.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        mask = forward.mask_of(t)
        if mask is not None:  # a keyed dropout mask made in this pass: the batch's, one row per example
            self._set(t, ("k",) + mask)
            return self.where[id(t)][1]
        meta = (tuple(t.shape), t.dtype, t.device.type)
        name = self.named.get(id(t))
        if name is not None and not by_value:
            src = ("p", name) + meta
        elif (by_value or t.numel() <= SMALL) and not t.requires_grad and type(t) is Tensor:
            src = ("v",) + meta + (_frozen(torch._C.TensorBase.tolist(t)),)
        else:
            src = ("x", id(t)) + meta
        src = Src(src)
        self.prog.shapes[src] = meta[0]
        self.prog.dtypes[src] = t.dtype
        return src

    def _desc(self, a, lift: bool = False):
        if isinstance(a, Tensor):
            return self.source(a, lift)
        if isinstance(a, (list, tuple)):
            return tuple(self._desc(v, lift) for v in a)
        if isinstance(a, dict):
            return tuple(sorted((k, self._desc(v, lift)) for k, v in a.items()))
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
            return a
        return ("?", type(a).__name__, repr(a))

    paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if _saved_tensor_hooks(False) is not None and self.prog.why is None:
            self.prog.why = "saved-tensor hooks are active in the forward (their unpack runs in the backward)"
        lift = func in _LIFT
        dargs, dkw = self._desc(args, lift), self._desc(kwargs, lift)
        out = func(*args, **kwargs)
        n = len(self.prog.ops)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        meta = []
        for j, o in enumerate(outs):
            if isinstance(o, Tensor):
                self._set(o, ("o", n, j))
                meta.append((tuple(o.shape), o.dtype))
            else:
                meta.append(o if isinstance(o, (int, float, bool, type(None))) else ("?", type(o).__name__))
        self.prog.ops.append((func, dargs, dkw, tuple(meta)))
        return out


def _frozen(v):
    return tuple(_frozen(x) for x in v) if isinstance(v, list) else v


def _tensors(obj, depth: int = 0) -> list[Tensor]:
    """The tensors of a model output: its pytree leaves, and those held by objects that are not pytree nodes
    (a Hugging Face cache), a few attributes deep."""
    found = []
    for leaf in tree_leaves(obj):
        if isinstance(leaf, Tensor):
            found.append(leaf)
        elif depth < 4 and hasattr(leaf, "__dict__") and not isinstance(leaf, (type, nn.Module)):
            found += _tensors(list(vars(leaf).values()), depth + 1)
    return found


@contextmanager
def watch(model: nn.Module, layers: list[nn.Module], b: int, labels: list[Tensor] = (),
          until_loss: bool = False, shared: set = frozenset()) -> Iterator[Program]:
    """Records the model's first call inside into a ``Program`` (its operations, the sources of its outputs and
    of every layer's input and output as the rules read them); the program is complete (``done``) when
    the call returned, or, with ``until_loss``, when ``Program.end`` is given the per-example losses
    computed from the output and ``labels`` (then batch inputs too). Hooks on the model (and, during its
    call, on ``layers``) are removed on exit. ``shared``: for a batch of one, the layers whose rows the batch's
    program expanded from one shared row (``Program.shared``), expanded alike."""
    prog = Program()
    prog.b = b
    state: dict = {}

    def start(m: nn.Module, args: tuple, kwargs: dict) -> None:
        if state or prog.done:
            return
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)] + list(labels)
        prog.inputs = [(tuple(t.shape), t.dtype) for t in inputs]
        named = {id(t): n for n, t in [*model.named_parameters(remove_duplicate=False),
                                        *model.named_buffers(remove_duplicate=False)]}
        rec = _Recorder(prog, inputs, named)
        prog.names = frozenset(named.values())
        seen: list = [[None, None] for _ in layers]
        if _saved_tensor_hooks(False) is not None:
            prog.why = "saved-tensor hooks are active in the forward (their unpack runs in the backward)"
        glob = nn.modules.module
        if any(getattr(glob, h, None) for h in _GLOBAL_HOOKS):  # they run before the model's own hooks
            prog.why = "a global module hook is registered"
        state.update(rec=rec, seen=seen, hooks=_layer_hooks(layers, rec, seen, shared), reads=_watch_python(prog),
                     rng=(random.getstate(), np.random.get_state()[1].tobytes()))
        rec.__enter__()

    def stop(m: nn.Module, args: tuple, kwargs: dict, out) -> None:
        if "rec" not in state or prog.done or "out" in state:
            return
        state["out"] = True
        if out is not None:
            prog.outputs = [state["rec"].source(t) for t in _tensors(out)]
            prog.why = prog.why or _custom_backward(_tensors(out))
        prog.layers = [tuple(s) for s in state["seen"]]
        if not until_loss:
            close()

    def close(losses: Tensor | None = None) -> None:
        if "rec" not in state or prog.done or "out" not in state:
            return
        if losses is not None:
            prog.losses = state["rec"].source(losses)
            prog.why = prog.why or _custom_backward([losses])
        _finish(state)
        if (random.getstate(), np.random.get_state()[1].tobytes()) != state["rng"]:
            prog.why = prog.why or "the forward draws from Python's or numpy's generator"
        prog.done = True

    prog.end = close
    handles = [model.register_forward_pre_hook(start, with_kwargs=True, prepend=True),
               model.register_forward_hook(stop, with_kwargs=True, always_call=True)]
    try:
        yield prog
    finally:
        for h in handles:
            h.remove()
        if "rec" in state and not prog.done:  # the forward raised inside, or the loss was not reached
            _finish(state)
            prog.why = "the forward (or the loss) did not return"


def _custom_backward(roots: list) -> str | None:
    """Why the graph behind ``roots`` has a backward the recording does not see: a custom
    ``autograd.Function``'s node (``BackwardCFunction``, however it was applied: ``_FunctionBase.apply`` gets
    past the watched ``Function.apply``); else None. Hooks registered on a graph's nodes cannot be listed from
    Python: the first step of every new program keeps the probe for them (``Proofs.proven``)."""
    seen: set = set()
    todo = [t.grad_fn for t in roots if isinstance(t, Tensor) and t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, BackwardCFunction):
            return f"a custom autograd.Function ({type(node).__name__}) in the step's graph: its backward is not recorded"
        todo.extend(n for n, _ in node.next_functions)
    return None


def _finish(state: dict) -> None:
    """Ends the recording once: the mode popped, the layer hooks removed, the tensor methods restored."""
    if "rec" in state and not state.get("exited"):
        state["exited"] = True
        state["rec"].__exit__(None, None, None)
        for h in state["hooks"]:
            h.remove()
        state["reads"]()


_WATCHED = {**{k: "reads tensor memory outside torch's operators" for k in _READS},
            "register_hook": "registers a gradient hook (it runs in the backward, which is not recorded)",
            "register_post_accumulate_grad_hook": "registers a gradient hook",
            "_typed_storage": "reads tensor memory outside torch's operators",
            "grad_fn": "reads the autograd graph (a hook on a node runs in the backward, which is not recorded)",
            "data": "reads a tensor through .data (a copy no operation made)"}
_PROPERTIES = ("grad_fn", "data")
"""What the recorded call must not do in Python (``_watch_python``): ``Tensor`` attributes, and why they void
the proof."""


def _watch_python(prog: Program) -> Callable[[], None]:
    """Replaces the ``Tensor`` attributes of ``_WATCHED`` and ``torch.autograd.Function.apply`` (a custom backward
    is not recorded) by ones that void the proof and then do what they did; reading ``grad_fn`` is left to
    clipbias's own layer hooks (``clipbias.grads``). Returns the function that restores them."""
    saved = {k: vars(Tensor)[k] for k in _WATCHED if k in vars(Tensor)}
    props = {k: getattr(torch._C.TensorBase, k) for k in _PROPERTIES}
    apply = vars(torch.autograd.Function)["apply"]

    def void(k: str) -> None:
        prog.why = prog.why or f"the forward {_WATCHED[k]} (Tensor.{k})"

    def wrap(k: str):
        orig = props[k] if k in _PROPERTIES else getattr(Tensor, k)
        if k in _PROPERTIES:
            def get(self):
                if not sys._getframe(1).f_globals.get("__name__", "").startswith("clipbias.grads"):
                    void(k)
                if has_torch_function_unary(self):
                    return handle_torch_function(orig.__get__, (self,), self)
                return orig.__get__(self)

            def put(self, value):
                void(k)
                orig.__set__(self, value)
            return property(get, put)

        def call(self, *args, **kwargs):
            void(k)
            if has_torch_function_unary(self):  # a mode (the state guard's) sees torch's own method, not this one
                return handle_torch_function(orig, (self,), self, *args, **kwargs)
            return orig(self, *args, **kwargs)
        return call

    def custom(cls, *args, **kwargs):
        prog.why = prog.why or f"the forward applies a custom autograd Function ({cls.__name__}: its backward is " \
                                f"not recorded)"
        return apply.__func__(cls, *args, **kwargs)
    for k in _WATCHED:
        setattr(Tensor, k, wrap(k))
    torch.autograd.Function.apply = classmethod(custom)

    def restore() -> None:
        torch.autograd.Function.apply = apply
        for k in _WATCHED:
            if k in saved:
                setattr(Tensor, k, saved[k])
            else:
                delattr(Tensor, k)
    return restore


def _layer_hooks(layers: list[nn.Module], rec: _Recorder, seen: list, shared: set) -> list:
    """Hooks that note the sources of each layer's input and output as its rule reads them (registered after the
    fast path's, so an output its hook replaced is seen replaced)."""
    handles = []
    for j, m in enumerate(layers):
        rule = RULES.rule_for(m)

        def note(mod, inp, out, j=j, rule=rule, rows=True):
            a = inp[0] if isinstance(inp, tuple) and inp else None
            if seen[j][0] is not None or not isinstance(a, Tensor) or not isinstance(out, Tensor):
                seen[j] = ["twice", "twice"]  # the fast path refuses a layer used twice; never proven
                return None
            # the output the rule reads, as the fast path's hook makes it (where it has not already: prove()); an
            # example alone gets the batch's expansion of a row shared by the batch, to its batch of one
            b, out2 = rec.prog.b, out
            if rows and out.shape[:1] != (b,):
                out2 = rule.batch_rows(mod, a, out, b)[1]
            if rows and b > 1 and a.shape[:1] == (1,) and out2.shape[:1] == (b,):
                rec.prog.shared.add(j)
            if rows and b == 1 and j in shared:
                out2 = out.expand(1, *out.shape[1:])
            seen[j] = [rec.source(a), rec.source(out2)]
            return None if out2 is out else out2
        if rule is not None and getattr(rule, "name", "") == "vit-embeddings":  # input: its patch embeddings'
            kept: dict = {}  # output; output: its dropout's input (layers.vit)

            def patches(mod, inp, out, kept=kept):
                kept["a"] = out

            def before_dropout(mod, inp, m=m, kept=kept, note=note):
                note(m, (kept.pop("a", None),), inp[0], rows=False)
            handles += [m.patch_embeddings.register_forward_hook(patches),
                        m.dropout.register_forward_pre_hook(before_dropout)]
        elif rule is not None and type(rule).hooks is _default_hooks():
            handles.append(m.register_forward_hook(note))
        # any other rule reads tensors these hooks cannot name: the layer stays unseen (not proven)
    return handles


def _default_hooks():
    from .layers.base import Rule
    return Rule.hooks


# ---------------------------------------------------------------------------------------------- analysis

class _NotProven(Exception):
    pass


def _live(prog: Program) -> list[bool]:
    """Which operations the outputs, the layers' tensors or an effect depend on: the others (the fast path's
    detached copies of layer inputs, say) are dropped."""
    live = [False] * len(prog.ops)
    need = set()
    for src in prog.outputs + [s for pair in prog.layers for s in pair if isinstance(s, tuple)] + (
            [prog.losses] if prog.losses is not None else []):
        if src[0] == "o":
            need.add(src[1])
    for n, (func, *_rest) in enumerate(prog.ops):
        if not _pure(func):
            need.add(n)
    stack = list(need)
    while stack:
        n = stack.pop()
        if live[n]:
            continue
        live[n] = True
        for src in _sources((prog.ops[n][1], prog.ops[n][2])):
            if src[0] == "o" and not live[src[1]]:
                stack.append(src[1])
    return live


_PURE: dict = {}


def _pure(func) -> bool:
    """An aten operation without effects: no argument written, not random, no Python scalar read."""
    got = _PURE.get(func)
    if got is None:
        schema = func._schema
        got = (func.namespace == "aten" and not schema.is_mutable and torch.Tag.nondeterministic_seeded not in
               func.tags and func is not torch.ops.aten._local_scalar_dense.default)
        _PURE[func] = got
    return got


def _sources(desc) -> Iterator[Src]:
    if isinstance(desc, Src):
        yield desc
    elif isinstance(desc, tuple):
        for v in desc:
            yield from _sources(v)


def canonical(prog: Program) -> tuple:
    """The program's live operations, renumbered, with its inputs, outputs and layers: equal for two steps
    exactly when they ran the same computation from the same kinds of sources."""
    live = _live(prog)
    index, k = {}, 0
    for n, is_live in enumerate(live):
        if is_live:
            index[n] = k
            k += 1

    def ren(d):
        if isinstance(d, Src):
            return ("o", index.get(d[1], -1), d[2]) if d[0] == "o" else tuple(d)
        if isinstance(d, tuple):
            return tuple(ren(v) for v in d)
        return d
    ops = tuple((f, ren(a), ren(kw), meta) for n, (f, a, kw, meta) in enumerate(prog.ops) if live[n])
    return (prog.b, tuple(prog.inputs), ops, ren(tuple(prog.outputs)), ren(tuple(prog.layers)), ren(prog.losses))


def analyze(prog: Program, alone: Program | None) -> str | None:
    """None when the program keeps every example's rows apart and ``alone``, the first example's recorded as a
    batch of one, is the same program at batch size 1 (module doc), else why not."""
    for p in (prog, alone):
        if p is None:
            return "not compared with an example alone"
        if p.why is not None:
            return p.why
        if not p.done:
            return "the model's call was not recorded"
    b = prog.b
    if b < 2:
        return "a batch of one example"
    for shape, _ in prog.inputs:
        if not shape or shape[0] != b:
            return "an input tensor of the model has no batch dimension first"
    status: dict[tuple, object] = {}  # source -> None (batch-free) | (d, k) | "all" | "any"
    for k in range(len(prog.inputs)):
        status[("i", k)] = (0, 1)
    for src, shape in prog.shapes.items():  # keyed dropout masks: row r is example r's alone (``forward._keep``)
        if src[0] == "p" and src[1] not in prog.names:
            return "a tensor labelled as a parameter or buffer the model does not hold"
        if src[0] == "k":
            if not shape or shape[0] != b:
                return "a keyed dropout mask whose rows are not the batch's examples"
            status[src] = (0, 1)
    seeds = {}
    for j, (a, out) in enumerate(prog.layers):
        if a is None or out is None or a == "twice":
            return f"trainable layer {j} ran {'twice' if a == 'twice' else 'where its rows could not be seen'}"
        if out[0] != "o":
            return f"trainable layer {j}'s output is not computed in the forward"
        seeds[out] = True
    live = _live(prog)
    roots: dict = {}
    n = len(prog.ops)
    try:
        pairs = _aligned(prog, alone, live)
        for n, (func, args, kwargs, meta) in enumerate(prog.ops):
            if not live[n]:
                continue
            outs = _apply(func, args, kwargs, meta, status, prog, b, roots)
            if n in pairs:  # (a copy that a reshape inserted: its input's checked)
                outs = _sized(func, outs, pairs[n], meta, b)
            for j, r in enumerate(func._schema.returns):  # views and in-place results share their first argument's storage
                if r.alias_info is not None and args and _is_src(args[0]) and j < len(meta):
                    roots[Src(("o", n, j))] = roots.get(args[0], args[0])
            for j, s in enumerate(outs):
                src = ("o", n, j)
                if src in seeds:
                    shape = meta[j][0]
                    if s is None and shape and shape[0] == b:
                        s = (0, 1)
                    elif s != (0, 1):
                        raise _NotProven(f"a trainable layer's output {_fmt(s)}, not one row per example")
                status[src] = s
        _final(prog, status, b)
    except _NotProven as err:
        prog.failed_at = n if n < len(prog.ops) else None
        return str(err)
    return None


def _aligned(prog: Program, alone: Program, live: list[bool]) -> dict[int, list]:
    """For each live operation of ``prog``, the int arguments that differ in ``alone`` (the first example run as
    a batch of one: ``(value here, value alone, in a size argument)``) and the outputs' shapes there; raises
    ``_NotProven`` where the two are not the same program up to the batch size."""
    other = _live(alone)
    skip_a, skip_b = _copies(prog, live), _copies(alone, other)
    mine = [n for n, v in enumerate(live) if v and n not in skip_a]
    theirs = [n for n, v in enumerate(other) if v and n not in skip_b]
    if len(mine) != len(theirs) or prog.inputs[1:] != alone.inputs[1:] and len(prog.inputs) != len(alone.inputs):
        raise _NotProven("an example run alone runs other operations than the batch (its program depends on the "
                         "batch's size or content)")
    pos_a, pos_b = {n: k for k, n in enumerate(mine)}, {n: k for k, n in enumerate(theirs)}
    for skip, pos in ((skip_a, pos_a), (skip_b, pos_b)):  # a copy stands for its input
        for n in sorted(skip):
            pos[n] = pos.get(skip[n], ("in", skip[n]))
    for (sa, ta), (sb, tb) in zip(prog.inputs, alone.inputs):
        if sa[1:] != sb[1:] or ta != tb or sb[:1] != (1,):
            raise _NotProven("an example alone has other input shapes than in the batch")
    out = {}
    for na, nb in zip(mine, theirs):
        fa, aa, ka, ma = prog.ops[na]
        fb, ab, kb, mb = alone.ops[nb]
        if _VIEWS.get(fa, fa) is not _VIEWS.get(fb, fb) or len(ma) != len(mb):
            raise _NotProven(f"an example run alone runs {fb} where the batch runs {fa}")
        diffs: list = []
        _diff((aa, ka), (ab, kb), pos_a, pos_b, fa, (), diffs)
        out[na] = [diffs, mb]
    for xa, xb in ((tuple(prog.outputs), tuple(alone.outputs)), (tuple(prog.layers), tuple(alone.layers)),
                   ((prog.losses,), (alone.losses,))):
        diffs = []
        _diff(xa, xb, pos_a, pos_b, None, (), diffs)
        if diffs:
            raise _NotProven("an example alone is read otherwise than in the batch")
    return out


_COPIES = {torch.ops.aten.clone.default, torch.ops.aten.alias.default, torch.ops.aten.detach.default}
_VIEWS = {torch.ops.aten._unsafe_view.default: torch.ops.aten.view.default}
"""Value-preserving operations a reshape inserts or not by the strides (a batch of one is contiguous where a
batch is not): left out of the comparison with an example alone, a copy standing for its input."""


def _copies(prog: Program, live: list[bool]) -> dict:
    """``{copy's index: the index of the operation whose output it copies}`` for the live copies (``_COPIES``)
    of an operation's output (an input's copy is kept: it stands for no operation)."""
    out = {}
    for n, (f, args, _, _) in enumerate(prog.ops):
        if live[n] and f in _COPIES and args and isinstance(args[0], Src) and args[0][0] == "o":
            out[n] = out.get(args[0][1], args[0][1])
    return out


SIZE_ARGS = {"view": 1, "_unsafe_view": 1, "reshape": 1, "expand": 1, "zeros": 0, "ones": 0, "full": 0,
             "new_zeros": 1, "new_ones": 1, "new_full": 1, "slice": 3, "native_group_norm": 3}
"""The argument of each operation that may hold the batch's size (a shape, a slice's end), by position."""

UNIFORM = {"zeros", "ones", "full", "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like",
           "expand"}
"""Operations whose output is the same for every index of a dimension that follows the batch's size (a constant
filled, or copies along an expanded dimension): such a dimension holds the batch (every example's slice alike)."""


def _diff(a, b, pos_a: dict, pos_b: dict, func, path: tuple, out: list) -> None:
    """Appends ``(path, a, b)`` for every int that differs between the arguments ``a`` (the batch's) and ``b`` (an
    example's alone); raises where anything else differs (a float, a source)."""
    if isinstance(a, Src) or isinstance(b, Src):
        if not (isinstance(a, Src) and isinstance(b, Src)) or a[0] != b[0]:
            raise _NotProven("an example alone reads other tensors than in the batch")
        if a[0] == "o":
            same = pos_a.get(a[1], "a") == pos_b.get(b[1], "b") and a[2] == b[2]
        elif a[0] == "i":
            same = a == b
        else:  # a parameter or constant: the same, at the same shape
            same = tuple(a) == tuple(b)
        if not same:
            raise _NotProven("an example alone reads other tensors than in the batch")
        return
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        for k, (u, v) in enumerate(zip(a, b)):
            _diff(u, v, pos_a, pos_b, func, path + (k,), out)
        return
    if a == b and type(a) is type(b):
        return
    if type(a) is int and type(b) is int:
        out.append((path, a, b))
        return
    raise _NotProven(f"{func} takes {a!r} in the batch and {b!r} for an example alone (a value that depends on "
                     f"the batch's size)")


def _sized(func, outs: list, pair: list, meta: tuple, b: int) -> list:
    """The outputs' statuses checked against their shapes alone: a dimension whose size follows the batch's
    (``k b`` here, ``k`` alone) must be the batch's, or a constant's filled or expanded along it
    (``UNIFORM``: then it holds the batch); every other size, and every other argument, the same. The ints
    that differ must be sizes (``SIZE_ARGS``) that the shapes account for."""
    diffs, theirs = pair
    name = func._schema.name.split("::")[-1].rstrip("_")
    for path, va, vb in diffs:
        if outs == ["all"] and name == "eq" and va == vb * b:  # the count compared with its numel (_marker)
            continue
        if path[:2] != (0, SIZE_ARGS.get(name, -1)) or va != vb * b:
            raise _NotProven(f"{name} takes {va} in the batch and {vb} for an example alone (a value that depends "
                             f"on the batch's size)")
    outs = list(outs)
    for j, (s, m_a, m_b) in enumerate(zip(outs, meta, theirs)):
        if not (isinstance(m_a, tuple) and len(m_a) == 2 and isinstance(m_a[0], tuple)):
            if m_a != m_b:
                raise _NotProven(f"{name} gives {m_a!r} in the batch and {m_b!r} for an example alone")
            continue
        (sh_a, dt_a), (sh_b, dt_b) = m_a, m_b
        grown = [d for d, (u, v) in enumerate(zip(sh_a, sh_b)) if u != v]
        if dt_a != dt_b or len(sh_a) != len(sh_b) or any(sh_a[d] != sh_b[d] * b for d in grown):
            raise _NotProven(f"{name}'s output is shaped {sh_a} in the batch and {sh_b} for an example alone")
        if s == "uninit":  # nothing may read it (_apply)
            continue
        if isinstance(s, tuple):
            if grown != [s[0]] or sh_b[s[0]] != s[1]:
                raise _NotProven(f"{name}'s output holds the batch at dimension {s[0]}, and its size does not follow "
                                 f"the batch's")
        elif grown:
            if s is not None or name not in UNIFORM or len(grown) != 1:
                raise _NotProven(f"{name} makes a batch-free tensor whose size follows the batch's (its values may "
                                 f"depend on the batch's size or an example's position)")
            outs[j] = (grown[0], sh_b[grown[0]])
    return outs


def _final(prog: Program, status: dict, b: int) -> None:
    """The layers' rows and the losses (or the outputs) one per example, or ``_NotProven``."""
    for a, out in prog.layers:
        if a[0] in ("x", "v"):
            raise _NotProven("a trainable layer's input comes from outside the forward")
        if _status(a, status) not in (None, (0, 1)):
            raise _NotProven(f"a trainable layer's input {_fmt(_status(a, status))}, not one row per example")
    if prog.losses is not None:  # the loss read the outputs: its values must be one per example
        s = _status(prog.losses, status)
        if s != (0, 1) or prog.shapes.get(prog.losses) != (b,):
            raise _NotProven(f"the per-example losses {_fmt(s)}")
        return
    for src in prog.outputs:
        if src[0] in ("x", "v") or _status(src, status) not in (None, (0, 1)):
            raise _NotProven(f"an output of the model {_fmt(_status(src, status))}, not one row per example")


def _fmt(s) -> str:
    if s is None:
        return "holds no example"
    if isinstance(s, str):
        return f"is a batch-wide {s}"
    d, k = s
    return f"holds the batch at dimension {d}" + (f" folded with {k} positions" if k > 1 else "")


def _status(src, status: dict):
    if src[0] in ("p", "v", "x"):
        return None
    if src not in status:
        raise _NotProven("a tensor of unknown origin")
    return status[src]


_UNINIT = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
"""Operations whose output holds whatever the memory held (another example's freed activations, say)."""

_DROPOUT_ARG = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"}
"""Random only through their ``dropout_p``, which their rule requires to be 0."""


_NAMES: dict = {}


class _Op:
    """One operation's view for the rules: its tensor arguments' statuses and shapes."""

    def __init__(self, func, args, kwargs, meta, status, prog, b):
        self.func, self.args, self.kwargs, self.meta, self.b = func, args, kwargs, meta, b
        self.status, self.prog = status, prog

    def st(self, d):
        return _status(d, self.status) if _is_src(d) else None

    def shape(self, d):
        return self.prog.shapes[d]

    def dtype(self, d):
        return self.prog.dtypes[d]

    def out_shape(self, j: int = 0):
        return self.meta[j][0]

    def arg(self, i: int, name: str, default=None):
        """The argument ``name`` (at position ``i`` where the schema does not name it)."""
        names = _NAMES.get(self.func)
        if names is None:
            names = _NAMES[self.func] = [a.name for a in self.func._schema.arguments]
        i = names.index(name) if name in names else i
        if i < len(self.args):
            return self.args[i]
        return dict(self.kwargs).get(name, default)

    def tensors(self):
        """(source, status) of every tensor argument, nested lists included."""
        return [(s, _status(s, self.status)) for s in _sources((self.args, self.kwargs))]


def _is_src(d) -> bool:
    return isinstance(d, Src)


def _apply(func, args, kwargs, meta, status, prog, b, roots) -> list:
    op = _Op(func, args, kwargs, meta, status, prog, b)
    name = func._schema.name.split("::")[-1]
    if func.namespace != "aten":
        raise _NotProven(f"operation {func} is not one of torch's")
    if torch.Tag.nondeterministic_seeded in func.tags and name not in _DROPOUT_ARG:
        raise _NotProven(f"random operation {name}")
    schema = func._schema
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    inplace = bool(written)
    if inplace:
        if written != [0] or not name.endswith("_") or schema.arguments[0].kwarg_only:
            raise _NotProven(f"operation {func} writes to an argument other than its first")
        target = args[0]
        if not _is_src(target) or target[0] != "o":
            raise _NotProven(f"in-place {name} on a parameter, buffer, input or outside tensor")
        root = roots.get(target, target)
        if root[0] != "o":
            raise _NotProven(f"in-place {name} on a view of a parameter, buffer, input or outside tensor")
    ins = op.tensors()
    if func not in _LIFT and any(src[0] in ("x", "v") for src, _ in ins):
        raise _NotProven(f"{name} reads a tensor from outside the forward that is not a parameter or buffer of the "
                         f"model (made in another thread, through .data, or kept from another call)")
    if inplace and op.st(args[0]) == "uninit" and name in ("fill_", "zero_", "copy_"):
        return _pointwise(_Op(func, args[1:], kwargs, meta, status, prog, b)) if name == "copy_" else [None]
    if name in _UNINIT:
        return ["uninit"] * len(meta)  # its values are whatever the memory held: nothing may read them
    if func is torch.ops.aten._local_scalar_dense.default:
        s = ins[0][1]
        if s is None or (s == "all" and meta[0] is True) or (s == "any" and meta[0] is False):
            return [None]
        raise _NotProven("a Python read of a value that depends on several examples (.item(), a branch on it)")
    if any(isinstance(s, str) for _, s in ins):
        return [_marker(name, op, ins)]
    if all(s is None for _, s in ins):  # nothing of the batch: batch-free (written in place: stays so)
        outs = [None] * len(meta)
    else:
        base = name[:-1] if inplace else name
        rule = _RULES.get(base)
        if rule is None:
            raise _NotProven(f"operation {name} on batch data has no batch-dimension rule")
        outs = rule(op)
        if len(outs) != len(meta):
            raise _NotProven(f"operation {name}: its rule does not describe all its outputs")
    if inplace and outs[0] != op.st(args[0]):
        raise _NotProven(f"in-place {name} changes which example its target's rows hold")
    return outs


# ------------------------------------------------------------------------------------------------ rules

def _norm(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _pointwise(op: _Op) -> list:
    """Element-wise with broadcasting: each batched argument's dimension, right-aligned to the output's."""
    out = op.out_shape()
    n = len(out)
    got = None
    for src, s in op.tensors():
        if s is None:
            continue
        d, k = s
        e = d + n - len(op.shape(src))
        if e < 0 or out[e] != op.shape(src)[d]:
            raise _NotProven(f"{op.func._schema.name} broadcasts the batch dimension")
        if got is not None and got != (e, k):
            raise _NotProven(f"{op.func._schema.name} combines examples batched at different dimensions "
                             f"(one example's values with another's)")
        got = (e, k)
    return [got] * len(op.meta)


def _same(op: _Op) -> list:
    """One tensor in, the same layout out (views that keep every dimension, positional masks)."""
    return [op.st(op.args[0])]


def _reduce_dims(op: _Op, dims, keepdim: bool, n_out: int = 1) -> list:
    src = op.args[0]
    s = op.st(src)
    nd = len(op.shape(src))
    if s is None:
        return [None] * n_out
    d, k = s
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(nd))
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [_norm(x, nd) for x in dims]
    if d in dims:
        raise _NotProven(f"{op.func._schema.name} reduces over the batch dimension (a statistic of the batch)")
    e = d if keepdim else d - sum(x < d for x in dims)
    return [(e, k)] * n_out


def _reduction(dim_pos: int, keep_pos: int | None, n_out: int = 1, full_default: bool = True):
    def rule(op: _Op) -> list:
        dims = op.arg(dim_pos, "dim", None)
        keep = op.arg(keep_pos, "keepdim", False) if keep_pos is not None else False
        if dims is None and not full_default:
            raise _NotProven(f"{op.func._schema.name} without a dimension")
        return _reduce_dims(op, dims, bool(keep), len(op.meta))
    return rule


def _along(dim_pos: int, n_out: int = 1):
    """Shape-preserving along one dimension (softmax, cumsum, sort): not the batch's."""
    def rule(op: _Op) -> list:
        s = op.st(op.args[0])
        if s is None:
            return [None] * n_out
        nd = len(op.shape(op.args[0]))
        dim = _norm(op.arg(dim_pos, "dim", -1), max(nd, 1))
        if dim == s[0]:
            raise _NotProven(f"{op.func._schema.name} runs along the batch dimension")
        return [s] * n_out
    return rule


def _full_bool(kind: str):
    def rule(op: _Op) -> list:
        if op.arg(1, "dim", None) not in (None, (), []):
            return _reduce_dims(op, op.arg(1, "dim"), bool(op.arg(2, "keepdim", False)))
        return [kind]  # only a Python read of it as a branch is admitted (_apply)
    return rule


def _sum(op: _Op) -> list:
    """A sum over some dimensions; the full sum of a boolean tensor is a count (``_marker``)."""
    if op.func._schema.overload_name == "" and op.dtype(op.args[0]) == torch.bool and op.arg(1, "dtype") is None:
        n = 1
        for x in op.shape(op.args[0]):
            n *= x
        return [f"count:{n}"]
    return _reduction(1, 2)(op)


def _view(op: _Op) -> list:
    src = op.args[0]
    s = op.st(src)
    if s is None:
        return [None]
    d, k = s
    shape, out, b = op.shape(src), op.out_shape(), op.b
    outer = 1
    for x in shape[:d]:
        outer *= x
    inner = k
    for x in shape[d + 1:]:
        inner *= x
    acc = 1
    for e, x in enumerate(out):
        if acc == outer and x % b == 0 and x >= b:
            rest = 1
            for y in out[e + 1:]:
                rest *= y
            if (x // b) * rest == inner:
                return [(e, x // b)]
        acc *= x
    raise _NotProven(f"a view {shape} -> {out} splits or merges the batch dimension with the ones before it")


def _expand(op: _Op) -> list:
    s = op.st(op.args[0])
    if s is None:
        return [None]
    return [(s[0] + len(op.out_shape()) - len(op.shape(op.args[0])), s[1])]


def _permute(op: _Op) -> list:
    s = op.st(op.args[0])
    nd = len(op.shape(op.args[0]))
    dims = [_norm(x, nd) for x in op.arg(1, "dims")]
    return [None] if s is None else [(dims.index(s[0]), s[1])]


def _transpose(op: _Op) -> list:
    s = op.st(op.args[0])
    if s is None:
        return [None]
    nd = len(op.shape(op.args[0]))
    if op.func._schema.name.endswith("::t"):
        a, c = (0, 1) if nd == 2 else (0, 0)
    else:
        a, c = _norm(op.arg(1, "dim0"), nd), _norm(op.arg(2, "dim1"), nd)
    d = s[0]
    return [(c if d == a else a if d == c else d, s[1])]


def _unsqueeze(op: _Op) -> list:
    s = op.st(op.args[0])
    if s is None:
        return [None]
    dim = _norm(op.arg(1, "dim"), len(op.out_shape()))
    return [(s[0] + (dim <= s[0]), s[1])]


def _squeeze(op: _Op) -> list:
    s = op.st(op.args[0])
    if s is None:
        return [None]
    shape = op.shape(op.args[0])
    dims = op.arg(1, "dim", None)
    dims = range(len(shape)) if dims is None else [dims] if isinstance(dims, int) else dims
    removed = {_norm(x, max(len(shape), 1)) for x in dims}
    removed = {x for x in removed if x < len(shape) and shape[x] == 1}  # the batch dimension (>= 2) stays
    return [(s[0] - sum(x < s[0] for x in removed), s[1])]


def _select(op: _Op) -> list:
    s = op.st(op.args[0])
    if s is None:
        return [None]
    dim = _norm(op.arg(1, "dim"), len(op.shape(op.args[0])))
    if dim == s[0]:
        raise _NotProven("a selection of one position along the batch dimension (one example's data for all)")
    return [(s[0] - (dim < s[0]), s[1])]


def _slice(op: _Op) -> list:
    s = op.st(op.args[0])
    if s is None:
        return [None]
    dim = _norm(op.arg(1, "dim", 0), len(op.shape(op.args[0])))
    if dim == s[0] and op.out_shape()[dim] != op.shape(op.args[0])[dim]:
        raise _NotProven("a slice of the batch dimension")
    return [s]


def _split(op: _Op) -> list:
    s = op.st(op.args[0])
    n_out = len(op.meta)
    if s is None:
        return [None] * n_out
    dim = _norm(op.arg(2, "dim", 0), len(op.shape(op.args[0])))
    if dim == s[0]:
        raise _NotProven("a split of the batch dimension")
    return [s] * n_out


def _unbind(op: _Op) -> list:
    s = op.st(op.args[0])
    n_out = len(op.meta)
    if s is None:
        return [None] * n_out
    dim = _norm(op.arg(1, "dim", 0), len(op.shape(op.args[0])))
    if dim == s[0]:
        raise _NotProven("an unbind of the batch dimension")
    return [(s[0] - (dim < s[0]), s[1])] * n_out


def _cat(op: _Op) -> list:
    tensors = op.args[0]
    nd = len(op.out_shape())
    dim = _norm(op.arg(1, "dim", 0), nd)
    got = None
    for t in tensors:
        s = op.st(t)
        if s is None:
            continue
        if len(op.shape(t)) != nd or s[0] == dim or (got is not None and got != s):
            raise _NotProven("a concatenation along or across the batch dimension")
        got = s
    return [got]


def _stack(op: _Op) -> list:
    tensors = op.args[0]
    nd = len(op.out_shape())
    dim = _norm(op.arg(1, "dim", 0), nd)
    got = None
    for t in tensors:
        s = op.st(t)
        if s is None:
            continue
        e = (s[0] + (dim <= s[0]), s[1])
        if got is not None and got != e:
            raise _NotProven("a stack across batch dimensions")
        got = e
    return [got]


def _mm(op: _Op, a, bm, extra=None) -> list:
    sa, sb = op.st(a), op.st(bm)
    if sa is not None and sb is not None:
        raise _NotProven("a matrix product of two batched operands (each example's rows with the others')")
    if sa is not None:
        if sa[0] != 0:
            raise _NotProven("a matrix product that sums over the batch dimension")
        got = sa
    elif sb is not None:
        if sb[0] != 1:
            raise _NotProven("a matrix product that sums over the batch dimension")
        got = sb
    else:
        got = None
    if extra is not None:
        return _merge(op, got, [extra])
    return [got]


def _merge(op: _Op, got, others) -> list:
    """``got`` for the output, combined with element-wise arguments ``others`` broadcast to it."""
    out = op.out_shape()
    for t in others:
        s = op.st(t)
        if s is None:
            continue
        e = s[0] + len(out) - len(op.shape(t))
        if e < 0 or out[e] != op.shape(t)[s[0]] or (got is not None and got != (e, s[1])):
            raise _NotProven(f"{op.func._schema.name} adds another example's values")
        got = (e, s[1])
    return [got]


def _bmm(op: _Op, a, bm, extra=None) -> list:
    sa, sb = op.st(a), op.st(bm)
    ok_a = sa is None or sa[0] in (0, 1)
    ok_b = sb is None or sb[0] in (0, 2)
    if not (ok_a and ok_b):
        raise _NotProven("a batched matrix product that sums over the batch dimension")
    if sa is not None and sb is not None:
        if sa != sb or sa[0] != 0:
            raise _NotProven("a batched matrix product pairing one example with another")
        got = sa
    else:
        got = sa if sa is not None else sb
    return _merge(op, got, [extra]) if extra is not None else [got]


def _sdpa(mask_pos: int | None, mask_name: str, dropout_pos: int | None):
    """A ``scaled_dot_product_attention`` kernel: the batch among query, key, value and mask's leading dimensions
    (not the positions attended over), no dropout."""
    def rule(op: _Op) -> list:
        if op.arg(99, "dropout_p", 0.0):
            raise _NotProven("attention with dropout")
        if op.arg(99, "return_debug_mask", False):
            raise _NotProven("attention returning its probabilities")
        q = op.args[0]
        nd = len(op.shape(q))
        got = None
        mask = op.arg(99, mask_name)
        for t in [op.args[0], op.args[1], op.args[2]] + ([mask] if _is_src(mask) else []):
            s = op.st(t)
            if s is None:
                continue
            e = s[0] + nd - len(op.shape(t))
            if e >= nd - 2 or (got is not None and got != (e, s[1])):
                raise _NotProven("attention across the batch dimension (examples attending to each other)")
            got = (e, s[1])
        n_out = len(op.meta)
        return [got, got] + [None] * (n_out - 2)
    return rule


def _embedding(op: _Op) -> list:
    w, idx = op.args[0], op.args[1]
    if op.st(w) is not None:
        raise _NotProven("an embedding table computed from the batch")
    return [op.st(idx)]


def _index_select(op: _Op) -> list:
    src, dim, idx = op.args[0], op.args[1], op.args[2]
    s, si = op.st(src), op.st(idx)
    nd = len(op.shape(src))
    dim = _norm(dim, nd)
    if s is not None and si is not None:
        raise _NotProven("an index_select of batched data by batched indices")
    if s is not None:
        if dim == s[0]:
            raise _NotProven("an index_select along the batch dimension")
        return [s]
    return [(dim, si[1])] if si[0] == 0 else _fail("an index_select by indices batched elsewhere")


def _gather(op: _Op) -> list:
    src, dim, idx = op.args[0], op.args[1], op.args[2]
    s, si = op.st(src), op.st(idx)
    nd = len(op.shape(src))
    dim = _norm(dim, nd)
    if s is not None:
        if dim == s[0] or (si is not None and si != s) or op.shape(idx)[s[0]] != op.shape(src)[s[0]]:
            raise _NotProven("a gather across the batch dimension")
        return [s]
    return [si]


def _index(op: _Op) -> list:
    """``x[i0, i1, ...]`` with tensor indices: batch-free indices into one example's dimensions after the
    batch, or batch-free data indexed by batched indices (a lookup per example)."""
    src, indices = op.args[0], list(op.args[1])
    s = op.st(src)
    idx_st = [op.st(i) if _is_src(i) else None for i in indices]
    if s is not None:
        used = [p for p, i in enumerate(indices) if i is not None]
        if any(v is not None for v in idx_st) or not used or min(used) <= s[0]:
            raise _NotProven("advanced indexing of the batch dimension")
        if used != list(range(used[0], used[-1] + 1)):
            raise _NotProven("advanced indexing by separated dimensions")
        return [s]
    used = [p for p, i in enumerate(indices) if i is not None]
    if used != list(range(used[0], used[-1] + 1)):
        raise _NotProven("advanced indexing by separated dimensions")
    nb = max(len(op.shape(indices[p])) for p in used)
    got = None
    for p in used:
        v = idx_st[p]
        if v is None:
            continue
        e = used[0] + v[0] + nb - len(op.shape(indices[p]))
        if got is not None and got != (e, v[1]):
            raise _NotProven("advanced indexing by indices batched at different dimensions")
        got = (e, v[1])
    return [got]


def _marker(name: str, op: _Op, ins: list) -> str:
    """A batch-wide boolean carried one step further: ``t.sum() == t.numel()`` of a boolean ``t`` (Hugging Face's
    fast ``all``) is an ``all``, ``t.sum() > 0`` (or ``!= 0``) an ``any``; anything else is refused."""
    (_, s), = ins if len(ins) == 1 else (("", ""),)
    if isinstance(s, str) and s.startswith("count:") and len(op.args) == 2:
        n, v = int(s[6:]), op.args[1]
        if name == "eq" and v == n:
            return "all"
        if name in ("gt", "ne") and v == 0:
            return "any"
    raise _NotProven("a batch-wide all/any/count used otherwise than read as a branch")


def _nll(op: _Op) -> list:
    """``nll_loss_forward`` / ``nll_loss2d_forward`` without reduction: one loss per example (and position)."""
    x, target, weight = op.args[0], op.args[1], op.arg(2, "weight")
    if op.arg(3, "reduction", 1) != 0:
        raise _NotProven("a loss reduced over the batch")
    if _is_src(weight) and op.st(weight) is not None:
        raise _NotProven("a loss weight computed from the batch")
    sx, st = op.st(x), op.st(target)
    if (sx is not None and sx[0] != 0) or (st is not None and st[0] != 0) or (sx and st and sx != st):
        raise _NotProven("a loss whose examples are not along the first dimension")
    return [sx or st, "mixed"]  # total_weight: never read (a reduction's)


def _fail(why: str):
    raise _NotProven(why)


def _layer_norm(op: _Op) -> list:
    x = op.args[0]
    s = op.st(x)
    for t in (op.arg(2, "weight"), op.arg(3, "bias")):
        if _is_src(t) and op.st(t) is not None:
            raise _NotProven("a layer norm whose weight depends on the batch")
    if s is None:
        return [None, None, None]
    axis = len(op.shape(x)) - len(op.arg(1, "normalized_shape"))
    if s[0] >= axis:
        raise _NotProven("a layer norm over the batch dimension")
    return [s, s, s]


def _group_norm(op: _Op) -> list:
    s = op.st(op.args[0])
    for t in (op.args[1], op.args[2]):
        if _is_src(t) and op.st(t) is not None:
            raise _NotProven("a group norm whose weight depends on the batch")
    if s is None:
        return [None, None, None]
    if s[0] != 0:
        raise _NotProven("a group norm over the batch dimension")
    return [s, s, s]


def _batch_norm(train_pos: int | None):
    def rule(op: _Op) -> list:
        if train_pos is None or op.arg(train_pos, "training", True):
            raise _NotProven("BatchNorm in training mode (statistics of the batch)")
        s = op.st(op.args[0])
        for t in op.args[1:5]:
            if _is_src(t) and op.st(t) is not None:
                raise _NotProven("a batch norm whose statistics depend on the batch")
        if s is not None and s[0] == 1:
            raise _NotProven("a batch norm over the batch dimension")
        return [s, None, None]
    return rule


def _conv(op: _Op) -> list:
    s = op.st(op.args[0])
    for t in (op.args[1], op.arg(2, "bias")):
        if _is_src(t) and op.st(t) is not None:
            raise _NotProven("a convolution whose weight depends on the batch")
    if s is not None and s[0] != 0:
        raise _NotProven("a convolution over the batch dimension")
    return [s]


def _spatial(n: int):
    """Pooling over the last ``n`` dimensions."""
    def rule(op: _Op) -> list:
        s = op.st(op.args[0])
        n_out = len(op.meta)
        if s is not None and s[0] >= len(op.shape(op.args[0])) - n:
            raise _NotProven("pooling over the batch dimension")
        return [s] * n_out
    return rule


def _pad(op: _Op) -> list:
    s = op.st(op.args[0])
    if s is None:
        return [None]
    pad = list(op.arg(1, "pad"))
    nd = len(op.shape(op.args[0]))
    for i in range(len(pad) // 2):
        if nd - 1 - i == s[0] and (pad[2 * i] or pad[2 * i + 1]):
            raise _NotProven("padding of the batch dimension")
    return [s]


def _flip(op: _Op) -> list:
    s = op.st(op.args[0])
    nd = len(op.shape(op.args[0]))
    dims = [_norm(x, nd) for x in op.arg(1, "dims")]
    if s is not None and s[0] in dims:
        raise _NotProven("a flip of the batch dimension")
    return [s]


def _roll(op: _Op) -> list:
    s = op.st(op.args[0])
    nd = len(op.shape(op.args[0]))
    dims = [_norm(x, nd) for x in op.arg(2, "dims", [])]
    if s is not None and (not dims or s[0] in dims):
        raise _NotProven("a roll of the batch dimension")
    return [s]


def _repeat(op: _Op) -> list:
    s = op.st(op.args[0])
    if s is None:
        return [None]
    reps = list(op.arg(1, "repeats"))
    e = s[0] + len(reps) - len(op.shape(op.args[0]))
    if reps[e] != 1:
        raise _NotProven("a repeat of the batch dimension")
    return [(e, s[1])]


def _unfold(op: _Op) -> list:
    s = op.st(op.args[0])
    if s is not None and _norm(op.arg(1, "dimension"), len(op.shape(op.args[0]))) == s[0]:
        raise _NotProven("windows along the batch dimension")
    return [s]


def _diagonal(op: _Op) -> list:
    s = op.st(op.args[0])
    if s is None:
        return [None]
    nd = len(op.shape(op.args[0]))
    d1, d2 = _norm(op.arg(2, "dim1", 0), nd), _norm(op.arg(3, "dim2", 1), nd)
    if s[0] in (d1, d2):
        raise _NotProven("a diagonal through the batch dimension")
    return [(s[0] - (d1 < s[0]) - (d2 < s[0]), s[1])]


def _const(op: _Op) -> list:
    """Its output's values depend on its input's shape and type only (``zeros_like``, ``_fused_sdp_choice``)."""
    return [None] * len(op.meta)


_POINTWISE = """abs absolute acos acosh add addcdiv addcmul alias asin asinh atan atan2 atanh bitwise_and bitwise_not
bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift ceil celu clamp clamp_max clamp_min clip clone copy cos
cosh deg2rad detach digamma div elu eq erf erfc erfinv exp exp2 expm1 fill float_power floor floor_divide fmax fmin
fmod frac gcd ge gelu gt hardshrink hardsigmoid hardswish hardtanh heaviside hypot i0 isfinite isinf
isnan isneginf isposinf le leaky_relu lerp lgamma lift_fresh lift_fresh_copy log log10 log1p log2 log_sigmoid_forward
logaddexp logaddexp2 logical_and logical_not logical_or logical_xor logit lt masked_fill maximum minimum mish mul
nan_to_num ne neg negative nextafter polygamma positive pow rad2deg reciprocal relu relu6 remainder
round rsqrt rsub selu sgn sigmoid sign signbit silu sin sinc sinh softplus softshrink sqrt square sub
tan tanh threshold trunc true_divide where xlogy _to_copy to _conj resolve_conj resolve_neg
special_erfcx zero""".split()
"""Each output element a function of the same element of every (broadcast) input."""


def _triangular(op: _Op) -> list:
    """``tril``/``triu``: each element kept or zeroed by its position in the last two dimensions; a batch
    dimension among them would make a row depend on its position in the batch (row i keeps i + 1 elements)."""
    src = op.args[0]
    s = op.st(src)
    if s is not None and s[0] >= len(op.shape(src)) - 2:
        raise _NotProven(f"{op.func._schema.name} over the batch dimension (each row by its position in the batch)")
    return [s] * len(op.meta)


_RULES: dict[str, Callable[[_Op], list]] = {k: _pointwise for k in _POINTWISE}
_RULES.update(tril=_triangular, triu=_triangular)
_RULES.update({
    "view": _view, "_unsafe_view": _view, "reshape": _view, "_reshape_alias": _view, "view_as": _view,
    "expand": _expand, "expand_as": _expand, "permute": _permute, "transpose": _transpose, "t": _transpose,
    "unsqueeze": _unsqueeze, "squeeze": _squeeze, "select": _select, "slice": _slice, "narrow": _slice,
    "split": _split, "split_with_sizes": _split, "unsafe_split": _split, "chunk": _split, "unbind": _unbind,
    "cat": _cat, "stack": _stack, "contiguous": _same, "unfold": _unfold, "diagonal": _diagonal,
    "sum": _sum, "mean": _reduction(1, 2), "nansum": _reduction(1, 2), "nanmean": _reduction(1, 2),
    "prod": _reduction(1, 2, full_default=True), "amax": _reduction(1, 2), "amin": _reduction(1, 2),
    "logsumexp": _reduction(1, 2), "argmax": _reduction(1, 2), "argmin": _reduction(1, 2),
    "max": _reduction(1, 2, 2), "min": _reduction(1, 2, 2), "var": _reduction(1, 3), "std": _reduction(1, 3),
    "var_mean": _reduction(1, 3, 2), "std_mean": _reduction(1, 3, 2), "linalg_vector_norm": _reduction(2, 3),
    "norm": _reduction(2, 3), "count_nonzero": _reduction(1, None),
    "all": _full_bool("all"), "any": _full_bool("any"),
    "_softmax": _along(1), "softmax": _along(1), "_log_softmax": _along(1), "log_softmax": _along(1),
    "cumsum": _along(1), "cumprod": _along(1), "sort": _along(1, 2), "argsort": _along(1), "topk": _along(2, 2),
    "mm": lambda op: _mm(op, op.args[0], op.args[1]),
    "addmm": lambda op: _mm(op, op.args[1], op.args[2], op.args[0]),
    "_addmm_activation": lambda op: _mm(op, op.args[1], op.args[2], op.args[0]),
    "mv": lambda op: _mm(op, op.args[0], op.args[1]) if op.st(op.args[1]) is None else _fail("mv over the batch"),
    "bmm": lambda op: _bmm(op, op.args[0], op.args[1]),
    "baddbmm": lambda op: _bmm(op, op.args[1], op.args[2], op.args[0]),
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa(None, "attn_mask", 3),
    "_scaled_dot_product_efficient_attention": _sdpa(3, "attn_bias", 5),
    "_scaled_dot_product_flash_attention": _sdpa(None, "attn_mask", 3),
    "_scaled_dot_product_cudnn_attention": _sdpa(3, "attn_bias", 6),
    "_fused_sdp_choice": _const, "zeros_like": _const, "ones_like": _const, "full_like": _const,
    "new_zeros": _const, "new_ones": _const, "new_full": _const, "_shape_as_tensor": _const,
    "embedding": _embedding, "index_select": _index_select, "gather": _gather, "index": _index,
    "native_layer_norm": _layer_norm, "native_group_norm": _group_norm,
    "native_batch_norm": _batch_norm(5), "_native_batch_norm_legit_no_training": lambda op: _bn_eval(op),
    "_native_batch_norm_legit": _batch_norm(5),
    "convolution": _conv, "_convolution": _conv,
    "max_pool1d": _spatial(1), "avg_pool1d": _spatial(1), "adaptive_avg_pool1d": _spatial(1),
    "max_pool2d_with_indices": _spatial(2), "avg_pool2d": _spatial(2), "_adaptive_avg_pool2d": _spatial(2),
    "adaptive_max_pool2d": _spatial(2), "max_pool3d_with_indices": _spatial(3), "avg_pool3d": _spatial(3),
    "_adaptive_avg_pool3d": _spatial(3), "constant_pad_nd": _pad, "flip": _flip, "roll": _roll,
    "repeat": _repeat, "nll_loss_forward": _nll, "nll_loss2d_forward": _nll,
})
def _bn_eval(op: _Op) -> list:
    s = op.st(op.args[0])
    for t in op.args[1:5]:
        if _is_src(t) and op.st(t) is not None:
            raise _NotProven("a batch norm whose statistics depend on the batch")
    if s is not None and s[0] == 1:
        raise _NotProven("a batch norm over the batch dimension")
    return [s, None, None]


# ------------------------------------------------------------------------------------------------ cache

class Proofs:
    """The proofs of one engine: programs already analysed (``CACHED``, least recently used dropped) with their
    verdicts, and whether to record at all: after ``GIVE_UP`` steps in a row that were not proven (a
    recorded program refused, or not judged because the forward drew random numbers or the loss is not
    one example's), only every ``RETRY``-th step is recorded."""

    def __init__(self) -> None:
        self.cache: dict[tuple, str | None] = {}
        self.failures = 0
        self.skipped = 0
        self.unjudged = False  # a program was recorded and not judged (its step kept the probe)
        self.last: str | None = None  # why the last judged step was not proven, or None
        self.hits = self.analysed = self.spot = 0  # (spot: proven steps that kept the probe by ``SPOT``)
        self.spotted = False  # this step is a spot probe (``RuntimeChecks.check_examples`` then probes more)

    def recording(self) -> bool:
        """Whether to record this step's forward (once per step)."""
        self.spotted = False
        if self.unjudged:
            self.failures += 1
            self.last = "the step kept its probe (a random forward, or a loss of several examples)"
        self.unjudged = False
        if self.failures >= GIVE_UP:
            self.skipped += 1
            if self.skipped % RETRY:
                return False
        self.unjudged = True
        return True

    def refuse(self, why: str) -> None:
        self.unjudged, self.last = False, why
        self.failures += 1

    def proven(self, prog: Program, alone: Callable[[], Program | None]) -> bool:
        """Whether the recorded step keeps every example's rows apart; ``last`` says why not. ``alone()`` records
        the first example run as a batch of one (called for a program not analysed before)."""
        self.unjudged = False
        why = prog.why if prog.why is not None else (None if prog.done else "the model's call was not recorded")
        if why is None:
            try:
                key = canonical(prog)
                hit = key in self.cache
            except TypeError:  # an unhashable argument: analysed every time
                key, hit = None, False
            if hit:
                self.hits += 1
                why = self.cache.pop(key)
            else:
                self.analysed += 1
                why = analyze(prog, alone())
            if key is not None:
                self.cache[key] = why
                while len(self.cache) > CACHED:
                    self.cache.pop(next(iter(self.cache)))
            fresh = not hit
        self.last = why
        self.failures = 0 if why is None else self.failures + 1
        self.skipped = 0 if why is None else self.skipped
        # a program proven just now keeps the probe on this step: what the recording cannot see (a read of the
        # batch through torch._C under DisableTorchFunction, a custom backward through _FunctionBase.apply or a
        # node hook) then meets the probe on the first step of every new program; a steady program skips it but
        # on a secret share of its steps (``SPOT``: a model that leaks only where it expects no probe)
        if why is None and not fresh and SPOT and _SPOT_RNG.randrange(SPOT) == 0:
            self.spot, self.spotted = self.spot + 1, True
            return False
        return why is None and not fresh


def prove(model: nn.Module, x, layers: list[nn.Module] | None = None) -> str | None:
    """None when one forward of ``model`` on the batch ``x`` (a tensor, a tuple or a dict of them, as the fast
    path calls it) is proven to keep every example's rows apart, else why not. ``layers``: the trainable
    layers whose inputs and outputs must be one row per example (default: every module with a fast-path
    rule and trainable parameters). For tests and tools; the fast path records its own forward."""
    from ..data import batch
    if layers is None:
        layers = [m for m in model.modules() if RULES.rule_for(m) is not None and any(
            p.requires_grad for p in m.parameters(recurse=False))]
    progs: list[Program] = []
    for xs in (x, batch.tree_map(lambda t: t[:1], x)):
        with torch.enable_grad(), watch(model, layers, batch.size(xs), shared=progs[0].shared if progs else set()) \
                as prog:
            try:
                batch.call(model, xs)
            except Exception as err:  # noqa: BLE001  (a model that cannot run one example alone)
                prog.why = f"the model cannot run one example alone: {type(err).__name__}: {err}"
        progs.append(prog)
    return analyze(*progs)
