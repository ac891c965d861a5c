"""Which examples each tensor of a training loop depends on: the proof that the loss a loop computes is a sum
of per-example terms, and that a forward on other data is public.

The Opacus interface trains the loss the training loop computes (``make_private`` without ``criterion``): the
model's outputs are handed to the loop as leaves, the loop's ``loss.backward()`` leaves in them the gradient of
its own loss, and the private step differentiates ``<f(x_i), g_i>`` for each example ``i`` (``g_i``: row ``i`` of
that gradient), whose gradient is example ``i``'s gradient of the loop's loss. Clipping bounds each such
gradient; the sensitivity argument also needs ``g_i`` to depend on example ``i`` alone (and on public
values). A loss such as ``((out - out.mean(0)) ** 2).sum()``, or a mean weighted by the batch's own label
counts, makes every ``g_i`` depend on every example, and one example added or removed would then move all the
others' clipped gradients. This module proves the property from what the loop does, op by op, instead of
assuming it.

Every tensor of the private batch the data loader yields, and every output the model returns on it, is a
``Traced`` tensor (a ``torch.Tensor`` subclass: it behaves as a tensor, and every torch function applied to it
passes through ``__torch_function__``) carrying a ``Label``:

* ``ROWS``: row ``r`` along the first dimension depends on example ``r // g`` of the batch alone (``g`` rows per
  example: ``logits.view(-1, vocab)`` of a ``[b, t, vocab]`` output has ``g = t``), and on public values;
* ``ONE``: each element depends on one example at most, the alignment of rows lost (``loss[mask]``);
* ``SUM``: each element is a sum over examples of one-example terms, plus public terms (``loss.mean()``);
* ``PUBLIC``: computed from a forward on data the loader did not draw (a DCGAN's generated images), and
  from nothing private;
* ``MIXED``: anything else, with the reason: the first operation the rules do not prove.

The rules (``_label``) are a whitelist: elementwise operations on aligned rows, operations along a dimension
other than the first, reshapes that keep the first dimension first, sums and means of rows, the loss
functions of ``torch.nn.functional`` with the reductions whose denominator is public (``reduction="mean"``
with class weights or ignored targets divides by a count of the batch's labels: refused), matrix products
of rows by public matrices. ``SUM`` terms combine with public terms and with terms of the parameters alone
(weight decay) by addition only, and are scaled by public constants only. Any other operation on a private
tensor gives ``MIXED``; the backward of a loss that is not ``SUM`` (or ``ROWS`` with an explicit gradient) is
refused before it runs, with the reason. A ``PUBLIC`` forward's gradient, and a term of the parameters alone,
reach the update exactly and unclipped (post-processing: they depend on no private example).

What the labels cannot see, and docs/integrations.md states: values that leave torch. Any read of a value of
the batch out of torch (``.item()``, ``bool``, ``repr``, ``.numpy()``, ``.tolist()``, ``torch.equal``: any
call on a traced tensor whose result holds no tensor, but its shape) is recorded (``Rows.escaped``), and a
backward after it is not proved (``_unproven``): the loss, or whether and which loss reaches the backward, may
depend on the value read (a shape that follows the batch's values too: ``_dynamic``); so is a step whose batch
or outputs changed through an alias (copies, compared bit for bit), whose
loss has a custom ``autograd.Function``, or that called the model on other data not declared public
(``public``): torch lets a copy of the batch escape without a read (``torch.tensor(x)``,
``torch.asarray(x, copy=True)``, ``torch.nested``, dlpack, ``_make_subclass``), also into declared public data
combined with it (``UNDECLARED``). Such a step is released, counted and reported uncertified, with the reason.
A call on an alias or an exact copy of the batch's rows is the private forward.

Between steps: a model call on a batch already stepped on returns its rows (``outputs_of``); an in-place
write of a value of such a batch into a parameter is refused before it runs (``_refuse_state_write``), and
parameters that move after the loop first computed with such a value make the next step unproven
(``Run.touched``, ``Run.moved``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..data import batch
from ..engine.guard import same_bits
from ..errors import ConfigError

ROWS, ONE, SUM, PUBLIC, MIXED = "rows", "one", "sum", "public", "mixed"
UNDECLARED = "public data combined with a tensor not declared public"
"""The ``why`` of a ``PUBLIC`` label computed with a plain tensor that requires no grad (``forward_kind``)."""


class Rows:
    """One yielded chunk of the private batch: its number of examples, what escaped tracing since, and the
    public part of the update its backward passes left in the parameters (``_backward``)."""

    def __init__(self, size: int, params: list[Tensor], run: "Run | None" = None) -> None:
        self.size, self.params, self.run = size, params, run
        self.stepped = False  # its step was taken: a read now is a read of an earlier batch (``Run``)
        self.escaped: str | None = None  # the first read of a value of the chunk out of torch (``_escape``)
        self.reaches_params = False  # a public output or a parameter met a loss term (``_backward`` snapshots)
        self.backwards = 0  # backward passes followed (proved per-example)
        self.public: list[Tensor | None] = [None] * len(params)  # what they added to the parameters' .grad
        self.unproven: str | None = None  # why a backward could not be proved per example (``_backward``)
        self.watched: list[tuple[Tensor, Tensor]] = []  # yielded tensors and handed outputs, with their copies
        self.tainted: dict[int, tuple] = {}  # memory written in place with values of several examples: (why, it)
        self.made: set[int] = set()  # the leaves clipbias handed to the loop (the outputs of private and public calls)
        self.undeclared = False  # a public term met a computed tensor that requires grad, not declared public

    def watch(self, t: Tensor) -> None:
        """Fingerprint ``t`` now: an in-place change through an alias the labels do not see (``x.data -= ...``)
        is found at the backward (``changed``)."""
        self.watched.append((t, _fingerprint(t)))

    def changed(self) -> bool:
        return any(not _same(t, f) for t, f in self.watched)


class Run:
    """What the chunks of one training share: whether a value of a batch was read out of torch after its step
    (``read_after_step``). Such a value may feed a later step's public term, which reaches the update unclipped:
    a later step with a public part is then not proved (``clipbias.integrations.session.Session.follow``).
    ``model``: the model trained, whose parameters a value of a batch may not be written into after its step
    (``_refuse_state_write``; before it, and for buffers between steps, the state guard refuses); ``since``: its
    parameters' fingerprints when the loop first computed with a value of a batch already stepped on, after the
    last step (``touched``): parameters that move after that are not proved post-processing (``moved``)."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.read_after_step: str | None = None
        self.model = model
        self.since: list | None = None

    def touched(self) -> None:
        """The loop computed with a value of a batch after its step: fingerprint the parameters now (once a
        window between two steps)."""
        if self.since is None and self.model is not None:
            self.since = _param_prints(self.model)

    def moved(self) -> bool:
        """Whether a parameter was written since ``touched`` (cleared: the next window starts with the step)."""
        since, self.since = self.since, None
        return since is not None and _param_prints(self.model) != since

    def state_storages(self) -> set[int]:
        """The storages of the model's parameters."""
        if self.model is None:
            return set()
        with torch._C.DisableTorchFunctionSubclass():
            return {_storage_of(t) for t in self.model.parameters()} - {None}


def _param_prints(model: torch.nn.Module) -> list:
    with torch._C.DisableTorchFunctionSubclass():
        return [(id(p), p._version, _storage_of(p), p.storage_offset(), tuple(p.shape)) for p in model.parameters()]


def _storage_of(t: Tensor) -> int | None:
    """The address of ``t``'s storage (a traced tensor's too: read without tracing), or None where it has none."""
    with torch._C.DisableTorchFunctionSubclass():
        try:
            return torch._C.TensorBase.untyped_storage(t).data_ptr()
        except (RuntimeError, NotImplementedError):
            return None


def _fingerprint(t: Tensor) -> Tensor:
    """A copy of ``t``'s values, compared bit for bit (``_same``): a sum and a sum of squares missed every
    rearrangement of the rows written through an alias (red team round 13: 10.6 C, certified)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().clone()


def _same(t: Tensor, copy: Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return same_bits(t.detach(), copy)


@dataclass(frozen=True)
class Label:
    kind: str
    rows: Rows | None = None  # the chunk (for PUBLIC: the chunk whose step it joins)
    why: str = ""

    @property
    def private(self) -> bool:
        return self.kind in (ROWS, ONE, SUM)


def mixed(why: str) -> Label:
    return Label(MIXED, None, why)


class Traced(Tensor):
    """A tensor of the private batch, or computed from it, with its ``Label`` (``_label``); ``_dynamic``: its
    shape depends on values of the batch (a selection by a private mask, or computed from one)."""

    _label: Label
    _dynamic: bool = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "").split(".")[0]  # (``torch.ops.aten.copy_.default``: ``copy_``)
        if name == "__get__":  # an attribute: .shape, .dtype, .data, .T, .grad ...
            name = getattr(getattr(func, "__self__", None), "__name__", "__get__")
        traced = _traced(args, kwargs)
        found = [_label_now(t) for t in traced]
        _after_step(found)
        if torch.is_grad_enabled() and any(lab.kind != PUBLIC for lab in found) and \
                torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            raise ConfigError("the loop computes on the private batch inside `saved_tensors_hooks` (or activation "
                              "checkpointing in the loss): its unpack hook may hand the backward other values than "
                              "those the loss was computed from, which clipbias cannot follow per example")
        if name in SHAPE_READS and any(t._dynamic for t in traced) or name in DYNAMIC and \
                _dynamic_result(name, args, kwargs, found) or _count_argument(name, args, kwargs) or name == "__setstate__" or name in RUNNING and \
                _running_stats(args, kwargs) or name == "__set__" and \
                getattr(getattr(func, "__self__", None), "__name__", "") == "data":  # (``t.data = v``: unlabelled)
            _escape(found, name, args)  # a shape that depends on values of the batch is a value read out of torch
        if _writes(name, kwargs) and any(lab.kind != PUBLIC and lab.rows is not None and lab.rows.stepped
                                         for lab in found):
            _refuse_state_write(name, args, kwargs, found)
        if name in ("backward", "grad") and func in (Tensor.backward, torch.autograd.backward, torch.autograd.grad):
            return _backward(func, args, kwargs, found)
        if name in HOOKS and found:  # (a public tensor's too: its hook may add the private batch to the exact
            # public term, unclipped: red team round 12 moved the update by 6,035 C so)
            raise ConfigError(f"`{name}` on a tensor of the private step: a hook may change the gradient in ways "
                              f"clipbias cannot follow per example (a hook that normalises by the batch couples the "
                              f"examples; one on a public output can carry the private batch into the public term); "
                              f"compute what it does in the loss instead")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if name == "grad" and found and isinstance(out, Tensor):  # the gradient of a private loss is private
            lab = found[0]
            return wrap(out, lab if lab.kind in (ROWS, PUBLIC) else mixed("the gradient of a tensor of the batch"))
        if name == "grad_fn" and any(lab.kind != PUBLIC for lab in found):  # (hooks on its node are unseen)
            _escape(found, name, args)
        if name in META or not found:
            return out
        if name in READS or out is not None and not _holds_tensor(out):  # a value leaves torch
            _escape(found, name, args)
            if not _holds_tensor(out):
                return out
        if name in LIKE and any(t._dynamic for t in traced):  # (its shape is the batch's values)
            _escape(found, name, args)
        if name in LIKE and not _traced(args[1:], kwargs) or name in ESCAPES:  # (a public tensor's shape: public)
            return wrap(out, Label(PUBLIC, None)) if name in LIKE and all(lab.kind == PUBLIC for lab in found) \
                and isinstance(out, Tensor) else out
        label = _label(name, args, kwargs, found, out)
        if label.rows is None:  # (a combination that is refused keeps its chunk: a read of it is the chunk's)
            label = Label(label.kind, next((lab.rows for lab in found if lab.rows is not None), None), label.why)
        if _writes(name, kwargs):
            _written(name, args, kwargs, label)
        dynamic = any(t._dynamic for t in traced) or name == "__getitem__" and _private_index(args)
        return _dynamic_shape(wrap(out, label), dynamic)

    def __deepcopy__(self, memo):  # (a copy, not a read: it stays traced)
        with torch._C.DisableTorchFunctionSubclass():
            return wrap(_plain(self).clone(), self._label)

    def __copy__(self):  # (``copy.copy``: a copy, it stays traced)
        with torch._C.DisableTorchFunctionSubclass():
            return wrap(_plain(self).clone(), self._label)

    def as_subclass(self, cls):  # (``Tensor.as_subclass`` never reaches ``__torch_function__``): an untraced copy
        _escape([self._label], "as_subclass", (self,))
        return torch._C.TensorBase.as_subclass(self, cls)

    def __reduce_ex__(self, proto):  # pickled (torch.save, a pickle): a plain tensor, its values read out of torch
        _escape([self._label], "__reduce_ex__", ())
        with torch._C.DisableTorchFunctionSubclass():
            return _plain(self).__reduce_ex__(proto)


SHAPE_READS = frozenset("size shape __len__ numel nelement stride nbytes unbind split chunk tensor_split __iter__ "
                        "split_with_sizes hsplit vsplit dsplit".split())
"""Reads of a tensor's shape: values of the batch where its shape follows them (``Traced._dynamic``)."""

DYNAMIC = frozenset("nonzero argwhere masked_select unique unique_consecutive bincount one_hot where "
                    "nonzero_static".split())
RUNNING = frozenset("batch_norm instance_norm".split())
"""Functions that write running statistics of their input into tensors passed to them (``_running_stats``)."""


def _running_stats(args, kwargs) -> bool:
    """``F.batch_norm(x, running_mean, running_var, training=True)``: the batch's statistics written into the
    running tensors, untraced copies (a read)."""
    names = ("running_mean", "running_var")
    given = [kwargs.get(n, args[i + 1] if len(args) > i + 1 else None) for i, n in enumerate(names)]
    training = kwargs.get("training", kwargs.get("use_input_stats", args[5] if len(args) > 5 else False))
    return any(t is not None for t in given) and bool(training)
"""Operations whose result's shape may depend on the values of their input (``_dynamic_result``)."""


SIZED = frozenset("""zeros ones empty full rand randn randint arange linspace logspace eye pad expand narrow reshape
view topk kthvalue roll repeat tile unflatten split tensor_split split_with_sizes repeat_interleave select new_zeros
new_ones new_empty new_full new_tensor broadcast_to resize_ as_strided""".split())
"""Operations that read sizes, counts or positions from their arguments: any integer tensor of the batch there
(``tensor_split(o, idx)`` too) is read (``_count_argument``)."""


FACTORIES = frozenset("""zeros ones empty full rand randn randint randperm arange range linspace logspace eye
empty_strided tril_indices triu_indices hann_window hamming_window blackman_window bartlett_window kaiser_window
repeat_interleave""".split())
"""Functions whose first argument is a number (a size, a count), not a tensor operated on."""


def _count_argument(name: str, args, kwargs) -> bool:
    """A one-element integer or boolean tensor computed from the batch passed where an operation takes a number (a
    size, a count, a position, a dimension, a slice's bound: ``o[:, :k]``, ``o.chunk(k)``, ``o.unsqueeze(k)``,
    ``F.max_pool1d(o, k)``): torch reads its value (red teams 16-17, 19.2 C through a dozen such functions).
    Operands of elementwise operations, products and losses are values the labels follow, not numbers read."""
    if name in POINTWISE or name in PRODUCTS or name in LOSSES or name in ("__setitem__", "backward", "grad"):
        return False
    rest = [args[1:] if args and isinstance(args[0], Tensor) and name not in FACTORIES else args, kwargs]
    found: list = []
    # one element, any shape (torch reads ``[k]`` as a number too; rows of the batch, ``y`` of a batch of one, are
    # operands, not counts), or any integer tensor where ``name`` takes sizes or positions
    sized = name in SIZED
    _visit(_slices_opened(rest), lambda t: found.append(t) if isinstance(t, Traced) and not t.is_floating_point() and
           not t.is_complex() and t._label.kind != PUBLIC and (sized or t.numel() == 1 and t._label.kind != ROWS)
           else None, -1)
    return bool(found)


def _slices_opened(obj):
    """``obj`` with every ``slice`` replaced by its (start, stop, step): their tensors visited too."""
    if isinstance(obj, slice):
        return (obj.start, obj.stop, obj.step)
    if isinstance(obj, (list, tuple)):
        return [_slices_opened(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _slices_opened(v) for k, v in obj.items()}
    return obj


def _dynamic_result(name: str, args, kwargs, found: list[Label]) -> bool:
    """``name`` applied to a private tensor gives a result whose shape depends on the batch's values (a read)."""
    if not any(lab.kind != PUBLIC for lab in found):
        return False
    if name == "where":
        return len(args) + len(kwargs) == 1  # ``torch.where(cond)``: ``nonzero``
    if name == "one_hot":
        k = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
        return k is None or int(k) < 0
    return name != "nonzero_static"


def _private_index(args) -> bool:
    """A ``__getitem__`` whose index holds a private boolean mask (its result's shape follows the mask's values;
    a private integer index is refused: ``_shape_label``)."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, Traced) and p._label.kind != PUBLIC and p.dtype == torch.bool for p in parts)


def _dynamic_shape(out: Any, dynamic: bool) -> Any:
    if dynamic:
        for t in batch.leaves(out) if _tensor_tree(out) else []:
            if isinstance(t, Traced) and t.dim() > 0:
                t._dynamic = True
    return out


def _label_now(t: "Traced") -> Label:
    """``t``'s label, or MIXED where memory it shares was written with values of several examples."""
    rows = t._label.rows
    if rows is None or not rows.tainted or t._label.kind == PUBLIC:
        return t._label
    hit = rows.tainted.get(_storage_of(t))
    return t._label if hit is None else mixed(f"a tensor whose memory was written in place ({hit[0]})")


def _plain(t: Tensor) -> Tensor:
    """``t`` as a plain tensor, for clipbias's own use (not a read: ``Traced.as_subclass`` is the loop's)."""
    return torch._C.TensorBase.as_subclass(t, Tensor)


def _writes(name: str, kwargs: dict) -> bool:
    """An in-place operation (its first argument, or ``out=``, written)."""
    return name.endswith("_") and not name.startswith("__") or name in ("__setitem__", "copy_", "set_") \
        or "out" in kwargs


def _after_step(found: list[Label]) -> None:
    """The loop computes with a value of a batch whose step was taken (``Run.touched``)."""
    for lab in found:
        if lab.rows is not None and lab.rows.stepped and lab.rows.run is not None and lab.kind != PUBLIC:
            lab.rows.run.touched()
            return


def _refuse_state_write(name: str, args, kwargs, found: list[Label]) -> None:
    """Refuse, before it runs, an in-place write of a value computed from a batch already stepped on into the
    model's parameters (``m.bias.sub_(x.abs().amax())`` after ``optimizer.step()``, which the state guard leaves
    to post-processing): released with the model, unclipped and without noise (22,572 times the bound,
    certified, before)."""
    target = kwargs.get("out", args[0] if args else None)
    targets = [t for t in (target if isinstance(target, (tuple, list)) else [target])
               if isinstance(t, Tensor) and not isinstance(t, Traced)]
    run = next((lab.rows.run for lab in found if lab.rows is not None and lab.rows.run is not None), None)
    if not targets or run is None:
        return
    state = run.state_storages()
    if not any(_storage_of(t) in state for t in targets):
        return
    raise ConfigError(
        f"an in-place `{name}` after optimizer.step() would write a value computed from the private batch into the "
        f"model's parameters: the model is released, and such a write reaches it unclipped and without noise (the "
        f"DP guarantee covers only the noisy update). Only the private step may change the parameters from the data; "
        f"post-processing between steps (weight clipping, renormalising) must use constants and the parameters "
        f"alone")


def _holds_tensor(out: Any) -> bool:
    return isinstance(out, Tensor) or isinstance(out, (tuple, list)) and any(_holds_tensor(o) for o in out)


def wrap(out: Any, label: Label) -> Any:
    """``out``'s tensors as ``Traced`` with ``label`` (tuples, lists and torch's named tuples kept)."""
    if isinstance(out, Tensor):
        t = torch._C.TensorBase.as_subclass(out, Traced) if type(out) is not Traced else out
        t._label = label
        return t
    if isinstance(out, tuple) and hasattr(out, "_fields") or type(out).__module__ == "torch.return_types":
        return type(out)([wrap(o, label) for o in out])
    if isinstance(out, (tuple, list)):
        return type(out)(wrap(o, label) for o in out)
    return out


def plain(x: Any) -> Any:
    """``x`` with every ``Traced`` tensor as a plain tensor (the same storage and autograd node)."""
    def unwrap(t: Tensor) -> Tensor:
        if not isinstance(t, Traced):
            return t
        with torch._C.DisableTorchFunctionSubclass():
            return _plain(t)
    return batch.map_tensors(unwrap, x)


def label_of(x: Any) -> Label | None:
    return x._label if isinstance(x, Traced) else None


def _visit(x: Any, each: Callable[[Tensor], None], depth: int = 0) -> None:
    """Every tensor inside ``x``: tuples, lists, any Mapping, dataclasses and other objects' attributes
    (one level: a forward's argument object holding the batch)."""
    if isinstance(x, Tensor):
        each(x)
    elif isinstance(x, (str, bytes, int, float, bool, type(None))) or depth > 3:
        return
    elif isinstance(x, (tuple, list, set, frozenset)):
        for v in x:
            _visit(v, each, depth + 1)
    elif isinstance(x, Mapping):
        for v in x.values():
            _visit(v, each, depth + 1)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            _visit(getattr(x, f.name, None), each, depth + 1)
    elif hasattr(x, "__dict__") and depth <= 1 and not isinstance(x, (type, torch.nn.Module)) and not callable(x):
        for v in vars(x).values():
            _visit(v, each, depth + 1)


def _traced(args, kwargs) -> list:
    out: list = []
    _visit((args, kwargs), lambda t: out.append(t) if isinstance(t, Traced) else None, -1)
    return out


def _plain_tensors(args, kwargs) -> list[Tensor]:
    out: list = []
    _visit((args, kwargs), lambda t: out.append(t) if not isinstance(t, Traced) else None, -1)
    return out


META = frozenset("""size dim ndim numel __len__ shape dtype device layout is_cuda is_cpu is_sparse is_quantized is_meta
is_floating_point is_complex is_contiguous is_leaf requires_grad grad_fn names stride storage_offset element_size
nelement itemsize nbytes __hash__ get_device is_pinned register_hook retains_grad _version __get__
dim_order is_set_to __dir__ __setstate__ _is_view is_nested is_mkldnn has_names __dlpack_device__""".split())
"""Attributes that hold no value of the tensor (its shape, dtype, device; the number of rows of a batch is
visible): returned as they are. Any other call whose result holds no tensor reads values out of torch
(``_escape``): ``.item()``, ``bool``, ``repr``, ``torch.equal``, ``.tolist()``, ``.storage()``, ..."""

LIKE = frozenset("""zeros_like ones_like empty_like full_like rand_like randn_like randint_like new_zeros new_ones
new_empty new_full empty_strided""".split())
"""Constructors that read only their argument's shape, dtype and device: their result holds nothing private."""

ESCAPES = frozenset("""numpy tolist __array__ __dlpack__ data_ptr untyped_storage _typed_storage
__array_wrap__ as_subclass""".split())
"""Operations that take a tensor's values out of torch, where the labels cannot follow them (``Rows.escaped``)."""

READS = ESCAPES | frozenset("item __float__ __int__ __index__ __bool__ __complex__ apply_ map_ map2_".split())
"""Reading values of the private step out of torch (``_escape``): before the backward, the loss or the control
flow that reaches the backward may depend on them, which the labels cannot follow."""

HOOKS = frozenset("register_hook register_post_accumulate_grad_hook retain_grad".split())


def _escape(found: list[Label], name: str, args) -> None:
    """A read of a value of the batch (or computed from it) out of torch: recorded on its chunk (``escaped``);
    a backward after it is not proved per example (``_backward``). Public values are not the batch's."""
    for lab in found:
        rows = lab.rows
        if lab.kind != PUBLIC and rows is not None and rows.stepped and rows.run is not None \
                and rows.run.read_after_step is None:
            rows.run.read_after_step = f"`.{name}` read a value of an earlier batch out of torch"
        if lab.kind != PUBLIC and rows is not None and rows.escaped is None:
            what = {"__float__": "float(...)", "__int__": "int(...)", "__bool__": "a condition (bool(...), if ...)",
                    "__index__": "an index", "__complex__": "complex(...)",
                    "grad_fn": "`.grad_fn` (a hook on it)"}.get(name, f"`.{name}()`")
            rows.escaped = f"{what} read a value computed from the private batch out of torch"


def _written(name: str, args, kwargs, label: Label) -> None:
    """An in-place operation: the tensor written carries the result's label; an untraced one cannot. Where the
    result is not one row per example, every tensor sharing the memory written is no longer either (``tainted``:
    the base of a view written, ``t[1:].add_(t[:1])``, kept its label before: 50.8 C, red team round 14)."""
    target = kwargs.get("out", args[0] if args else None)
    # (an elementwise write of the target's own values and constants moves no value to another position)
    own = name in POINTWISE and "out" not in kwargs and all(t is target for t in _traced(args[1:], kwargs))
    for t in (target if isinstance(target, (tuple, list)) else [target]):
        if isinstance(t, Traced):
            t._label = label
            if label.kind not in (ROWS, PUBLIC) and label.rows is not None and not own:
                with torch._C.DisableTorchFunctionSubclass():  # (the storage held: its address is not reused)
                    memory = torch._C.TensorBase.untyped_storage(t)
                label.rows.tainted[memory.data_ptr()] = (label.why or f"an in-place `{name}` that combines examples",
                                                         memory)
        elif isinstance(t, Tensor) and label.kind != PUBLIC and label.rows is not None and label.rows.escaped is None:
            label.rows.escaped = f"an in-place `{name}` wrote a tensor of the private batch into an untraced tensor"


# ---------------------------------------------------------------------------------------------- the rules
POINTWISE = frozenset("""add sub rsub mul multiply div divide true_divide floor_divide remainder fmod pow float_power
neg negative positive abs absolute exp exp2 expm1 log log2 log10 log1p sqrt rsqrt square sigmoid logit tanh sinh
cosh sin cos tan asin acos atan atan2 arcsin arccos arctan erf erfc erfinv relu relu6 elu selu celu gelu silu mish
softplus softsign hardtanh hardsigmoid hardswish leaky_relu logsigmoid tanhshrink threshold clamp clip clamp_min
clamp_max minimum maximum fmin fmax where eq ne lt le gt ge equal_ isnan isinf isfinite nan_to_num sign sgn
signbit floor ceil round trunc frac reciprocal logical_and logical_or logical_xor logical_not bitwise_and
bitwise_or bitwise_xor bitwise_not lerp addcmul addcdiv xlogy special_xlogy hypot copysign heaviside one_hot
masked_fill masked_fill_ to type float double half bfloat16 long int short bool byte char cpu cuda clone detach
detach_ contiguous requires_grad_ pin_memory fill_ zero_ copy_ __add__ __radd__ __iadd__ __sub__ __rsub__
__isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__ __itruediv__ __div__ __rdiv__ __floordiv__
__rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __ipow__ __neg__ __pos__ __abs__ __eq__ __ne__ __lt__ __le__
__gt__ __ge__ __and__ __or__ __xor__ __invert__ __rand__ __ror__ __rxor__ data add_ sub_ mul_ div_ clamp_
log_ exp_ neg_ sigmoid_ relu_ tanh_ sqrt_ pow_ abs_ square_ float_ type_as view_as_real
dropout alpha_dropout feature_alpha_dropout""".split())
"""Elementwise: each element of the result from the same elements of its inputs (broadcast)."""

ADDITIVE = frozenset("""add sub rsub neg negative positive __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__
__neg__ __pos__ to type float double half bfloat16 cpu cuda clone detach contiguous sum mean nansum reshape view
squeeze unsqueeze flatten view_as reshape_as add_ sub_ data""".split())
"""Operations that keep a sum of one-example terms such a sum when their other operands are public."""

SCALING = frozenset("""mul multiply div divide true_divide __mul__ __rmul__ __imul__ __truediv__ __itruediv__ __div__
mul_ div_""".split())
"""Operations that keep such a sum one when their other operands are constants (a learning-rate-free scale)."""

ALONG = frozenset("""softmax log_softmax argmax argmin max min amax amin aminmax logsumexp cumsum cumprod cummax
cummin norm vector_norm topk sort argsort gather index_select take_along_dim normalize std var std_mean var_mean
prod all any count_nonzero median nanmedian mode kthvalue sum mean nansum nanmean diff glu""".split())
"""Operations along a dimension (``dim``): per example when it is not the first."""

SHAPES = frozenset("""view reshape flatten unflatten view_as reshape_as squeeze unsqueeze expand expand_as
broadcast_to repeat tile transpose swapaxes swapdims permute movedim moveaxis t T mT H mH __getitem__ select
narrow split chunk unbind tensor_split flip roll unfold squeeze_ unsqueeze_ flatten_ ravel
index_put index_put_""".split())

LOSSES = frozenset("""cross_entropy nll_loss binary_cross_entropy binary_cross_entropy_with_logits mse_loss l1_loss
smooth_l1_loss huber_loss kl_div soft_margin_loss poisson_nll_loss gaussian_nll_loss multilabel_soft_margin_loss
multi_margin_loss multilabel_margin_loss hinge_embedding_loss""".split())

PRODUCTS = frozenset("""matmul mm bmm linear __matmul__ __rmatmul__ addmm baddbmm conv1d conv2d conv3d
bilinear""".split())


def _label(name: str, args, kwargs, found: list[Label], out: Any) -> Label:
    """The label of ``out = func(*args, **kwargs)`` from its inputs' labels ``found`` (module docstring)."""
    bad = next((lab for lab in found if lab.kind == MIXED), None)
    if bad is not None:
        return bad
    if name == "__setitem__":
        return _setitem_label(args, found)
    private = [lab for lab in found if lab.private]
    if not private:  # (combined with a tensor not declared public, a copy of the batch may hide in it: ``UNDECLARED``)
        # (a plain tensor that requires grad and is computed, not a parameter, may hold a copy of the batch that the
        # tracing did not see: ``torch.tensor(v) + 0 * p.sum()`` scaled a public term by 96,553 C, red team round 16)
        undeclared = any(not t.requires_grad or t.grad_fn is not None for t in _plain_tensors(args, kwargs))
        why = UNDECLARED if undeclared else next((lab.why for lab in found if lab.why), "")
        if undeclared and found[0].rows is not None and any(t.requires_grad for t in _plain_tensors(args, kwargs)):
            found[0].rows.undeclared = True  # (a public term that may carry such a copy: ``_unproven``)
        return Label(PUBLIC, found[0].rows, why)
    rows = private[0].rows
    if any(lab.rows is not rows for lab in private):
        return mixed(f"`{name}` combines tensors of two different batches")
    kinds = {lab.kind for lab in private}
    others = _plain_tensors(args, kwargs)
    # (a tensor that requires grad is a parameter the result's gradient reaches; under no_grad it is a constant:
    # a frozen teacher's forward, ``with torch.no_grad(): teacher(x)``)
    public = any(lab.kind == PUBLIC for lab in found) or torch.is_grad_enabled() and any(t.requires_grad for t in others)
    if kinds == {SUM}:
        if name in ADDITIVE:
            rows.reaches_params |= public
            return Label(SUM, rows)
        if name in SCALING and not public and _single_sum_operand(name, args, kwargs):
            return Label(SUM, rows)
        return mixed(f"`{name}` applied to a sum over the batch's examples" + (
            " and a public output or a parameter" if public else "") + " (only additions of such sums, and scaling by "
            "constants, keep the loss a sum of per-example terms)")
    if public:
        return mixed(f"`{name}` combines a tensor of the private batch with a public output or with a tensor that "
                     f"requires grad outside the model's private forward (a parameter): only whole per-example "
                     f"losses may be added to such terms (a submodule called directly on the private batch, "
                     f"`model.encoder(x)` or Lightning's `self.net(x)`, is such a meeting: call the model itself, "
                     f"`model(x)` or `self(x)`, whose forward is the recorded private one)")
    if SUM in kinds:
        return mixed(f"`{name}` combines a sum over the batch with the batch's rows (each example's term then "
                     f"depends on the others)")
    one = rows.size <= 1  # a batch of at most one example: every function of it is that example's
    tensors = [t for t in batch.leaves(out)] if _tensor_tree(out) else []
    first = args[0] if args else None
    if name in LOSSES:
        return _loss_label(name, args, kwargs, rows, one)
    if name in ALONG:
        dims = _dims(args, kwargs, first, name)
        if name in ("sum", "nansum") and (kinds == {ONE} or dims is None or 0 in dims):
            return Label(SUM, rows)  # (each element a sum of one-example terms)
        if ONE in kinds and not one:  # rows whose examples are unknown: along any dimension they may combine
            return mixed(f"`{name}` on a tensor whose rows are no longer one example each (after a transpose, a "
                         f"selection or a concatenation along the batch)")
        if dims is not None and 0 not in dims:
            return Label(ROWS, rows) if (_same_rows(args, kwargs) and _leading(tensors, rows)
                                         and _index_ok(name, args, kwargs, rows)) or one \
                else mixed(f"`{name}` on tensors whose rows are not aligned")
        if name == "mean" and kinds == {ROWS}:  # (over the examples: divided by B times a public count)
            return Label(SUM, rows)
        if one:
            return Label(ROWS, rows) if _leading(tensors, rows) else Label(ONE, rows)
        return mixed(f"`{name}` over the batch's first dimension (it combines examples" + (
            "; the mean of a selection of rows divides by a count that depends on other examples: sum it and divide "
            "by the batch size" if name == "mean" else "") + ")")
    if name == "one_hot" and kinds == {ROWS} or name in PRODUCTS and _product_of_rows(args, kwargs, name):
        return _product_label(name, args, rows, kinds, tensors, one)
    if name in POINTWISE:
        if kinds == {ROWS} and (_aligned(args, kwargs, rows, tensors) or one):
            return Label(ROWS, rows) if _leading(tensors, rows) else Label(ONE, rows)
        if len(private) == 1 and kinds == {ONE} and name in POINTWISE:
            return Label(ONE, rows)
        return Label(ROWS, rows) if one and _leading(tensors, rows) else mixed(
            f"`{name}` combines rows of different examples (the rows of its operands are not aligned)")
    if name in SHAPES or name in ("cat", "concat", "concatenate", "stack", "hstack", "column_stack"):
        return _shape_label(name, args, kwargs, rows, kinds, tensors, one)
    if one:
        return Label(ROWS, rows) if _leading(tensors, rows) else Label(ONE, rows)
    return mixed(f"`{name}` (an operation clipbias does not prove to keep examples apart)")


def _product_label(name: str, args, rows: Rows, kinds: set, tensors: list[Tensor], one: bool) -> Label:
    """``F.one_hot`` of rows (a row per example, a new last dimension), or a product whose first operand is the rows
    (``_product_of_rows``): its other operands are weights, not aligned with the rows; a result with more dimensions
    than the rows broadcast the batch against them (``x @ W`` with W [B, D, K]: row b of the result is ``x @ W[b]``)."""
    if name == "one_hot":
        return Label(ROWS, rows) if _leading(tensors, rows) else Label(ONE, rows)
    if kinds == {ROWS} and all(t.dim() <= args[0].dim() for t in tensors) and _leading(tensors, rows) or \
            one and _leading(tensors, rows):
        return Label(ROWS, rows)
    return mixed(f"`{name}` combines rows of different examples (a product over the batch)")


def _setitem_label(args, found: list[Label]) -> Label:
    """``t[index] = value``: ``t`` keeps its label where the index is public or ``t``'s own rows (a mask of the same
    examples) and the value public; anything else may move one example's values into another's row."""
    target, index, value = (list(args) + [None, None, None])[:3]
    tl = label_of(target)
    if isinstance(value, Traced) and value._label.private:
        return mixed("an in-place assignment `t[i] = v` of private values")
    idx = index if isinstance(index, tuple) else (index,)
    for i in idx:
        il = label_of(i)
        if il is not None and il.private and not (tl is not None and il.kind == ROWS and il.rows is tl.rows
                                                 and i.dim() > 0 and i.shape[0] == target.shape[0]):
            return mixed("an in-place assignment `t[i] = v` whose index is private and not the rows of `t`")
    if tl is None:
        return mixed("an in-place assignment into an untraced tensor")
    return tl


def _single_sum_operand(name: str, args, kwargs) -> bool:
    """One operand is the sum, the numerator of a division (``c / loss`` is not a scaling of it); the other a
    number or a constant tensor without gradient."""
    if name in DIVISIONS and not (args and isinstance(args[0], Traced)) or name in ("__rtruediv__", "__rdiv__"):
        return False
    return all(not (isinstance(t, Tensor) and t.requires_grad and not isinstance(t, Traced))
               for t in _plain_tensors(args, kwargs)) and len(_traced(args, kwargs)) == 1


DIVISIONS = frozenset("div divide true_divide __truediv__ __itruediv__ __div__ div_".split())


def _tensor_tree(out: Any) -> bool:
    return isinstance(out, Tensor) or isinstance(out, (tuple, list)) and all(isinstance(o, Tensor) for o in out)


def _leading(tensors: list[Tensor], rows: Rows) -> bool:
    """Every result tensor has a first dimension of whole examples (``g`` rows each)."""
    b = rows.size
    return bool(tensors) and all(t.dim() > 0 and (b == 0 and t.shape[0] == 0 or b > 0 and t.shape[0] % b == 0
                                                  and t.shape[0] > 0) for t in tensors)


def _aligned(args, kwargs, rows: Rows, tensors: list[Tensor]) -> bool:
    """Elementwise operands whose private rows line up with the result's: every traced operand has the result's
    number of dimensions and first dimension (no broadcast along the examples), every untraced one either the
    same first dimension (a row per example: constant targets) or broadcasts along it."""
    if not tensors:
        return False
    shape = tensors[0].shape
    if len(shape) == 0:
        return False
    for t in _traced(args, kwargs):
        if t.dim() != len(shape) or t.shape[0] != shape[0]:
            return False
    for t in _plain_tensors(args, kwargs):
        if t.dim() >= len(shape) and t.dim() > 0 and t.shape[0] not in (1, shape[0]):
            return False
    return True


def _same_rows(args, kwargs) -> bool:
    """Every traced operand has a first dimension, the same for all (an operation along another dimension)."""
    ts = _traced(args, kwargs)
    return all(t.dim() > 0 for t in ts) and len({t.shape[0] for t in ts}) == 1


DIM_AT = {"topk": 2, "kthvalue": 2, "diff": 2, "norm": 2, "normalize": 2, "vector_norm": 2, "split": 2, "chunk": 2,
          "tensor_split": 2, "roll": 2, "take_along_dim": 2}
"""Where an operation takes its ``dim`` positionally, counting the tensor as 0, where it is not 1."""


def _dims(args, kwargs, first, name: str = "") -> set[int] | None:
    """The dimensions an operation along ``dim`` reduces or acts on (normalized), None for all of them (also an
    empty tuple: ``sum(dim=())`` reduces every dimension)."""
    dim = kwargs.get("dim", kwargs.get("axis", kwargs.get("dims")))
    at = DIM_AT.get(name, 1)
    if dim is None and len(args) > at and isinstance(args[at], (int, tuple, list)) and not isinstance(args[at], bool):
        dim = args[at]
    if dim is None or not isinstance(first, Tensor) or isinstance(dim, (tuple, list)) and not dim:
        return None
    n = max(first.dim(), 1)
    dims = dim if isinstance(dim, (tuple, list)) else [dim]
    try:
        return {int(d) % n for d in dims}
    except (TypeError, ValueError):
        return None


def _index_ok(name: str, args, kwargs, rows: Rows) -> bool:
    """An index tensor of the batch is one row per example of the same rows (``gather``); a private index into
    another dimension (``index_select(1, y)``, ``take_along_dim``) reads other examples' values."""
    idx = [t for t in _traced(args[1:], kwargs)]
    if not idx:
        return True
    return name == "gather" and all(t._label.kind == ROWS and t._label.rows is rows and t.dim() == args[0].dim()
                                    and t.shape[0] == args[0].shape[0] for t in idx)


_CONV_DIMS = {"conv1d": 3, "conv2d": 4, "conv3d": 5}
"""A convolution's batched input: its examples, channels and spatial dimensions."""


def _product_of_rows(args, kwargs, name: str) -> bool:
    """A matrix product acting on each example's rows alone: the first operand private rows, the others
    constants (a weight); only a batched product (``bmm``, ``matmul`` of 3-D tensors) takes private rows of the
    same examples as its second operand (``F.linear(out, out)`` is the Gram matrix of the batch)."""
    if not args or not isinstance(args[0], Traced) or args[0].dim() < 2 or name == "__rmatmul__":
        return False  # (a [B] input is one example of B features; ``x.__rmatmul__(W)`` is ``W @ x``, over the rows)
    if args[0].dim() != _CONV_DIMS.get(name, args[0].dim()):  # an unbatched conv takes the batch for channels
        return False
    batched = name in ("bmm", "baddbmm", "matmul", "__matmul__") and args[0].dim() >= 3
    return all(batched and t.dim() >= 3 and t.shape[0] == args[0].shape[0]
               for t in _traced(args[1:], kwargs)) and kwargs.get("weight") is None


def _shape_label(name: str, args, kwargs, rows: Rows, kinds: set, tensors: list[Tensor], one: bool) -> Label:
    """Reshapes and selections: rows stay rows while the first dimension stays first and whole."""
    if kinds == {ONE}:
        return Label(ONE, rows)
    if name in ("cat", "concat", "concatenate", "stack", "hstack", "column_stack"):
        seq = args[0] if args else kwargs.get("tensors", [])
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        ts = [t for t in seq if isinstance(t, Tensor)]
        along_rows = dim == 0 if name not in ("hstack", "column_stack") else \
            name == "hstack" and any(t.dim() == 1 for t in ts)  # (hstack joins 1-D tensors end to end)
        if not along_rows and all(t.dim() > 0 and t.shape[0] == ts[0].shape[0] for t in ts) \
                and all(isinstance(t, Traced) for t in ts if t.requires_grad) and _leading(tensors, rows) \
                and all(_label_now(t).kind in (ROWS, PUBLIC) for t in ts if isinstance(t, Traced)) \
                and (name != "stack" or dim != 0):
            return Label(ROWS, rows)
        return Label(ROWS if one and _leading(tensors, rows) else ONE, rows)
    first = args[0] if args else None
    if not isinstance(first, Traced):  # a constant indexed by private rows: w[y]
        idx = args[1] if len(args) > 1 else None
        idx = idx[0] if isinstance(idx, tuple) and idx else idx
        if isinstance(idx, Traced) and idx._label.kind == ROWS and _leading(tensors, rows) \
                and tensors[0].shape[0] == idx.shape[0]:
            return Label(ROWS, rows)
        return Label(ONE, rows)
    if first._label.kind != ROWS:  # the rows of the tensor reshaped are not one example each, nor are the result's,
        return Label(ONE, rows)      # whatever the other operands (``y[:1].expand_as(y)``: red team round 12)
    if name in ("expand", "expand_as", "broadcast_to") and any(t.dim() > first.dim() for t in tensors):
        return Label(ONE, rows)  # new leading dimensions: each row of the result holds every example's values
    if name in ("transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "permute", "t", "T", "mT", "H", "mH"):
        keeps = _keeps_first(name, args, kwargs, first)
        return Label(ROWS if keeps and _leading(tensors, rows) else ONE, rows)
    if name in ("select", "narrow", "split", "chunk", "unbind", "tensor_split", "flip", "roll", "unfold"):
        dims = _dims(args, kwargs, first, name)
        if name in ("split", "chunk", "tensor_split") and dims is None:
            dims = {0}
        if name == "unbind" and dims is None:
            dims = {0}
        if dims is not None and 0 not in dims and _leading(tensors, rows):
            return Label(ROWS, rows)
        return Label(ONE, rows)
    if name in ("index_put", "index_put_"):  # (values added at indices: one element may sum every example)
        return mixed(f"`{name}` writes values of the batch at positions the labels cannot follow")
    if name == "__getitem__":
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        for k, part in enumerate(parts):  # a private index reads other examples' values, but a mask of the rows
            if isinstance(part, Traced) and not (k == 0 and part.dtype == torch.bool and part.dim() >= 1
                                                 and part._label.kind == ROWS and part._label.rows is rows
                                                 and part.shape[0] == first.shape[0]):
                return mixed("an index computed from the batch selects other examples' values")
        return Label(ROWS, rows) if name == "__getitem__" and _first_whole(index, first.dim()) \
            and _leading(tensors, rows) else Label(ONE, rows)
    # view, reshape, flatten, squeeze, unsqueeze, expand, repeat: row-major order, the first dimension first
    if name in ("unsqueeze", "unsqueeze_") and _dims(args, kwargs, first, name) == {0} and first.dim() > 0:
        return Label(ONE, rows)
    return Label(ROWS, rows) if _leading(tensors, rows) and (first.dim() > 0 and rows.size > 0) \
        and (name not in ("repeat", "tile") or _repeats_keep_first(args)) else Label(ONE, rows)


def _keeps_first(name: str, args, kwargs, t: Tensor) -> bool:
    if name in ("t", "T", "mT", "H", "mH"):
        return t.dim() <= 1 or name in ("mT", "mH") and t.dim() > 2
    rest = list(args[1:])
    if name == "permute":
        order = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest or kwargs.get("dims")
        return bool(order) and int(order[0]) % max(t.dim(), 1) == 0
    a = rest + [kwargs[k] for k in ("dim0", "dim1", "source", "destination") if k in kwargs]
    try:
        moved = {int(d) % max(t.dim(), 1) for d in a if not isinstance(d, (tuple, list))}
    except (TypeError, ValueError):
        return False
    return 0 not in moved


def _first_whole(idx, ndim: int) -> bool:
    """An index that keeps the first dimension whole: ``x[:, k]``, ``x[..., :-1]``, ``x[:, None]``."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if not idx:
        return True
    head = idx[0]
    if head is Ellipsis:  # x[..., k]: the first dimension whole while the ellipsis covers it
        return ndim > sum(1 for i in idx[1:] if i is not None and i is not Ellipsis)
    return isinstance(head, slice) and head == slice(None)


def _repeats_keep_first(args) -> bool:
    reps = args[1:] if len(args) > 2 or not (len(args) == 2 and isinstance(args[1], (tuple, list))) else args[1]
    return bool(reps) and int(reps[0]) == 1


def _loss_label(name: str, args, kwargs, rows: Rows, one: bool) -> Label:
    """A loss of ``torch.nn.functional``: per example with ``reduction="none"``; a sum of per-example terms with
    ``"sum"``, and with ``"mean"`` where its denominator is the batch's size times a public number."""
    ts = _traced(args, kwargs)
    if not one and (len({t.shape[0] for t in ts if t.dim() > 0}) > 1 or any(t._label.kind != ROWS for t in ts)
                    or any(t.dim() == 0 for t in ts)
                    or any(t.dim() > 0 and t.requires_grad for t in _plain_tensors(args, kwargs))):
        return mixed(f"`{name}` on an output and targets whose rows are not the same examples' (a selection of rows such "
                     f"as `out[mask]` loses their alignment: take reduction='none' and multiply by the mask instead)")
    reduction = kwargs.get("reduction", "mean")
    if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
        return mixed(f"`{name}` with the deprecated size_average/reduce arguments: use reduction=")
    if reduction == "none":
        return Label(ROWS, rows)
    if reduction == "sum":
        return Label(SUM, rows)
    if name in ("cross_entropy", "nll_loss") and reduction == "mean" and not one:
        target = args[1] if len(args) > 1 else kwargs.get("target")
        if kwargs.get("weight") is not None:
            return mixed(f"`{name}` with class weights and reduction='mean' divides by the total weight of the batch's "
                         f"labels, which depends on every example: use reduction='sum' and divide by the batch size")
        ignore = kwargs.get("ignore_index", -100)
        with torch._C.DisableTorchFunctionSubclass():
            dropped = isinstance(target, Tensor) and not target.is_floating_point() and bool((target == ignore).any())
        if dropped:
            return mixed(f"`{name}` with ignored targets (ignore_index={ignore}) and reduction='mean' divides by the "
                         f"number of targets kept, which depends on every example: use reduction='sum' and divide "
                         f"by the batch size")
    return Label(SUM, rows)


# ---------------------------------------------------------------------------------------------- backward
def _unproven(loss: Tensor, rows: Rows) -> str | None:
    """Why a backward of ``loss`` cannot be proved per example though its label says it is: a value of the
    batch read out of torch before it (the loss, or whether and which loss reaches the backward, may depend on
    it: ``loss.item()`` is read after ``optimizer.step()``, or the step given ``criterion``), an in-place change
    of the batch or of the outputs through an alias the labels do not see, a custom ``autograd.Function``."""
    if rows.escaped is not None:
        return rows.escaped + " before the backward"
    if rows.changed():
        return "a tensor of the batch or an output of the model changed in place through an alias (`.data`)"
    if rows.undeclared:
        return ("a public term combined with a computed tensor that requires grad and was not declared public (it may "
                "hold a value of the batch copied where the tracing cannot see: `torch.tensor(v) + 0 * p.sum()`)")
    if rows.tainted:  # (memory the graph saved may be among it: the backward would read the written values)
        return f"memory of the step's tensors written in place with values of several examples ({next(iter(rows.tainted.values()))[0]})"
    params = {id(p) for p in rows.params}
    with torch._C.DisableTorchFunctionSubclass():
        first = loss.grad_fn
    seen, todo = set(), [first]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return f"a custom autograd.Function ({type(node).__name__}) in the loss's graph"
        leaf = getattr(node, "variable", None)  # (AccumulateGrad: a leaf that requires grad)
        if leaf is not None and not isinstance(leaf, Traced) and id(leaf) not in params and id(leaf) not in rows.made:
            return ("a tensor that requires grad and is not a parameter of the model in the loss's graph (its value "
                    "may be one of the batch, copied where the tracing cannot see: `torch.add(..., alpha=x[0, 0])`)")
        todo.extend(n for n, _ in node.next_functions)
    return None


def _backward(func: Callable, args, kwargs, found: list[Label]):
    """``loss.backward()`` (``torch.autograd.backward``, ``torch.autograd.grad``) of a loss that is a sum of
    per-example terms (``SUM``, or ``ROWS`` with a gradient given per row); refused before it runs otherwise.
    Where a public output or a parameter term is in it, the parameters' gradients it adds are kept as the
    public part of the update (``Backward``)."""
    if func is Tensor.backward:
        outputs, grads = args[0], kwargs.get("gradient", args[1] if len(args) > 1 else None)
    else:
        outputs = kwargs.get("tensors", kwargs.get("outputs", args[0] if args else None))
        grads = kwargs.get("grad_tensors", kwargs.get("grad_outputs", args[1] if len(args) > 1 else None))
    outs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    gs = list(grads) if isinstance(grads, (tuple, list)) else [grads] * len(outs)
    for out, g in zip(outs, gs):
        lab = label_of(out)
        if lab is not None and lab.rows is not None and lab.rows.unproven is None:
            lab.rows.unproven = _unproven(out, lab.rows)
            if lab.rows.unproven is None and (kwargs.get("create_graph") or func is torch.autograd.grad):
                lab.rows.unproven = "a backward that builds a graph of the gradient (create_graph, autograd.grad)"
        if lab is None or lab.kind == PUBLIC:
            continue
        why = lab.why if lab.kind == MIXED else None
        if lab.kind in (ROWS, ONE) and why is None:
            gl = label_of(g)
            if g is None:
                why = f"backward of a tensor with one value per example ({lab.kind}) without a gradient"
            elif lab.kind == ONE or (gl is not None and gl.kind != PUBLIC and (gl.kind != ROWS or gl.rows is not lab.rows)) \
                    or g.shape != out.shape:
                why = "backward of per-example values with a gradient that is not one row per example"
        if why is not None:
            raise ConfigError(
                f"the loss your training loop computed is not a sum of per-example terms that clipbias can prove: "
                f"{why}. The private step takes each example's gradient of the loss your loop computes, and DP needs "
                f"each one to depend on that example alone. Write the loss so that each term depends on one example "
                f"(a loss with reduction='mean', 'sum' or 'none' on the outputs and targets), or pass the per-example "
                f"loss to make_private(..., criterion=...), which the step then differentiates instead")
        lab.rows.backwards += 1
        if func is torch.autograd.grad and lab.rows.escaped is None:  # gradients it returns leave the labels
            lab.rows.escaped = "torch.autograd.grad of a loss on the private batch"
    chunks = {id(lab.rows): lab.rows for lab in found if lab.rows is not None}.values()
    watch = [c for c in chunks if c.reaches_params or any(lab.kind == PUBLIC and lab.rows is c for lab in found)]
    hooked = [p for c in watch for p in c.params if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]
    if hooked:  # the public part is what this backward adds to the parameters' .grad, and a hook changes it
        raise ConfigError(
            f"a gradient hook is registered on a parameter of the model ({tuple(hooked[0].shape)}; "
            f"`register_hook`, `register_post_accumulate_grad_hook`): the backward of your loop's loss adds a public "
            f"term (a public forward or a parameter term) to the parameters' gradients, and a hook may add values of "
            f"the private batch to it, unclipped and without noise. Remove the hook, or compute what it does in the loss")
    before = [[p.grad.detach().clone() if p.grad is not None else None for p in c.params] for c in watch]
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
    for c, was in zip(watch, before):  # the public part: what this backward added to the parameters' gradients
        for i, p in enumerate(c.params):
            if p.grad is not None:
                added = p.grad.detach() - was[i] if was[i] is not None else p.grad.detach().clone()
                c.public[i] = added if c.public[i] is None else c.public[i] + added
    return result


# ---------------------------------------------------------------------------------------------- the doors
def yielded(chunk: Any, rows: Rows) -> Any:
    """The data loader's chunk as the loop gets it: every tensor ``ROWS`` of ``rows`` (fingerprinted)."""
    def traced(t: Tensor) -> Tensor:
        rows.watch(t)
        return wrap(t, Label(ROWS, rows))
    return batch.map_tensors(traced, chunk)


def forward_kind(args, kwargs, rows: Rows, drawn: Any) -> str:
    """``"private"``: the model is called on the chunk's rows (each tensor of the private batch aligned with it,
    or an untraced copy or alias of them: a row equal to a drawn row, shared storage); ``"public"``: on data the
    loader did not draw. A call is proved public only on tensors declared public (``public``) or computed from
    public outputs, and before any read of the batch's values out of torch; a call on other untraced tensors is
    public but leaves the step unproven (``Rows.unproven``: torch lets a copy of the batch escape the labels,
    through ``torch.tensor``, dlpack or ``_make_subclass``, where no read is seen). A call that mixes private
    rows with other data, rearranges them or reads a tensor that combines examples is refused, with the reason."""
    traced = [t for t in _traced(args, kwargs) if t._label.private or t._label.kind == MIXED]
    if traced:
        bad = next((t._label.why for t in traced if t._label.kind == MIXED), None)
        if any(t._label.rows is not None and t._label.rows.stepped for t in traced):  # (kept from an earlier step)
            bad = "a value of a batch already stepped on, or the model's outputs on it, in a later step"
        if bad is None and all(t._label.kind == ROWS and t._label.rows is rows and t.dim() > 0
                               and t.shape[0] == rows.size for t in traced):
            return "private"
        raise ConfigError(
            "the model was called on a tensor computed from the private batch that is not one row per example of the "
            "batch (" + (bad or "rows of the batch mixed with other rows or other data, rearranged, or from another "
                         "batch") + "): the private step needs each example's forward to see that example alone. "
            "Call the model on the batch (or chunk) as drawn, and on public data (generated images, a public batch) "
            "in a separate call: such a call is public, its gradient exact and unclipped")
    undeclared = [t for t in _plain_tensors(args, kwargs) if t.is_floating_point() or t.dim() > 0]
    declared = [t for t in _traced(args, kwargs) if t._label.kind == PUBLIC]
    if any(_shares_rows(t, drawn) for t in undeclared + [plain(t) for t in declared]):
        return "private"  # (an untraced copy or alias of the batch: ``torch.Tensor(x)``, a numpy round trip)
    if rows.unproven is None:
        if rows.escaped is not None:  # the data may be computed from what was read out
            rows.unproven = f"a forward on other data after {rows.escaped}"
        elif undeclared:
            rows.unproven = ("a forward on data not declared public (clipbias.public(tensor)); it is taken as public, "
                             "but a copy of the batch made out of clipbias's sight would be too")
        elif any(t._label.why == UNDECLARED for t in declared):
            rows.unproven = ("a forward on public data combined with a tensor not declared public (clipbias.public"
                             "(tensor)); a copy of the batch made out of clipbias's sight (torch.asarray(x, copy=True), "
                             "torch.tensor(x)) would be such a tensor")
    return "public"


def public(*tensors: Tensor) -> Any:
    """Declare tensors public (a GAN's generated batch, a public data set): a forward of the model on them in a
    private step is public, its gradient exact and unclipped, and the step stays certified. A tensor that shares
    rows or storage with the batch is still the batch (the private forward). Returns the tensor (or a tuple)."""
    for t in tensors:
        lab = label_of(t)
        if not isinstance(t, Tensor) or lab is not None and lab.kind != PUBLIC:
            raise ConfigError("clipbias.public: " + ("this tensor is computed from the private batch (or an output of "
                              "the model on it): it is not public" if isinstance(t, Tensor) else
                              f"expects tensors, got {type(t).__name__}"))
    out = tuple(wrap(plain(t), Label(PUBLIC, None)) for t in tensors)
    return out[0] if len(out) == 1 else out


def reads_rows(args, kwargs) -> bool:
    """Whether a call reads a tensor of the private batch (or one computed from it)."""
    return any(t._label.kind != PUBLIC for t in _traced(args, kwargs))


def _shares_rows(t: Tensor, drawn: Any) -> bool:
    """Whether ``t`` shares storage with one of the drawn batch's tensors (an alias: dlpack, ``_make_subclass``,
    ``.data``) or a row of it equals one of their rows (an untraced copy)."""
    if t.dim() == 0 or t.numel() == 0:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        ptr = t.untyped_storage().data_ptr()
        if any(d.untyped_storage().data_ptr() == ptr for d in batch.leaves(drawn) if d.numel()):
            return True
        a = t.detach().to("cpu", torch.float64).reshape(t.shape[0], -1)
        for d in batch.leaves(drawn):
            if d.dim() == 0 or d.numel() == 0 or d[0].numel() != a.shape[1]:
                continue
            b = d.detach().to("cpu", torch.float64).reshape(d.shape[0], -1)
            close = a.sum(1)[:, None] == b.sum(1)[None, :]  # candidates by row sum, then exact
            for i, j in close.nonzero().tolist():
                if torch.equal(a[i], b[j]):
                    return True
    return False


def private_leaf(out: Tensor, rows: Rows) -> Tensor:
    """A private forward's output handed to the loop: a leaf that requires grad, ``ROWS`` of the chunk."""
    leaf = out.detach().requires_grad_()
    rows.watch(leaf)
    rows.made.add(id(leaf))
    return leaf, wrap(leaf, Label(ROWS, rows))


def public_output(out: Any, rows: Rows) -> Any:
    return batch.map_tensors(lambda t: wrap(t, Label(PUBLIC, rows)), out)


def check_public(out: Any) -> Any:
    """``out`` of a public call, refused where a tensor in it was computed with values of the private batch (a
    forward hook or pre-hook reading the batch kept in a closure: 9,655 C through the exact public term, red team
    round 14)."""
    def check(t: Tensor) -> Tensor:
        if isinstance(t, Traced) and t._label.kind != PUBLIC:
            raise ConfigError("a call of the model on public data computed its output with values of the private "
                              "batch (a forward hook or pre-hook, or the model itself, reading it from outside its "
                              "arguments): the public term would carry them into the update unclipped. Keep the "
                              "private batch out of the public forward")
        return t
    batch.map_tensors(check, out)
    return out


def outputs_of(out: Any, args, kwargs) -> Any:
    """A model call's outputs outside the private step (no batch pending, or eval mode) labelled by the private
    tensors it read: rows of their chunk (a call on a batch already stepped on, ``h = model(xb)`` after
    ``optimizer.step()``, gives values of that batch, which the rules then keep out of later steps), combining
    examples where its inputs were not one chunk's rows as drawn; as they are where it read nothing private."""
    private = [t._label for t in _traced(args, kwargs) if t._label.kind != PUBLIC]
    if not private:
        return out
    rows = private[0].rows
    if rows is not None and all(lab.kind == ROWS and lab.rows is rows for lab in private):
        return rows_output(out, rows)
    return batch.map_tensors(lambda t: wrap(t, Label(MIXED, rows, "an output of the model on a tensor computed "
                                                     "from a private batch, not its rows as drawn")), out)


def rows_output(out: Any, rows: Rows) -> Any:
    """A private forward's non-gradient outputs (or a no-grad forward's) as rows of the chunk where they have one
    per example, else as combining examples (a loss on them is then refused)."""
    def label(t: Tensor) -> Tensor:
        if t.dim() > 0 and t.shape[0] == rows.size:
            return wrap(t, Label(ROWS, rows))
        return wrap(t, mixed("an output of the model on the private batch without one row per example"))
    return batch.map_tensors(label, out)
