"""The step's state guard: model state that a forward pass on private data wrote is refused.

Whatever a forward on the private batch writes into the model outside the gradient (a running
statistic, a frozen "scaler" parameter, ``nn.Embedding(max_norm=...)``'s in-place renormalisation, a
tensor or number kept on a module) is a statistic of the private batch with no noise, and it is
released with the model. The DP guarantee covers only the noisy update, so such a write is refused,
wherever it comes from: a registered parameter (trainable or frozen) or buffer, a tensor attribute of a
module (also in a list, tuple or dict attribute), or any other module attribute.

``with guard.watching() as watch: ...`` around the private computation; ``watch.error`` is then the
refusal (a ``ConfigError``) or None, and ``guard.run(fn, ...)`` raises it. Every door runs it:
``DPEngine.step`` around its per-example gradients (both gradient paths, and the other path of
``grad_path="auto"``), and the integrations around the forwards of the user's loop on a private batch
(``clipbias.integrations``: the Opacus interface's recorded forward, Lightning's ``training_step``).

What it compares, before and after:

* every parameter and buffer: the same object in the same slot, its storage address and offset, shape,
  dtype and strides, and its version counter, which every in-place operation bumps (also through
  ``.detach()``, under ``torch.no_grad()`` and in ``torch.func``'s functional calls, which share it);
* a parameter or buffer whose memory the forward reached around the version counter (``.data``,
  ``.numpy()``, ``__array__``, ``untyped_storage()``, ``data_ptr()``, seen by a ``TorchFunctionMode``
  while the guard watches): its values, copied at that access, bit for bit;
* a tensor attribute of a module (directly, or in a list, tuple or dict attribute): its values, copied at
  the snapshot (a tensor recomputed with the same values, as old-style ``weight_norm`` does, passes);
* any other module attribute: a number, string or tuple by value, anything else by identity.

Buffers are restored from a copy; other state the forward wrote cannot be (copying every parameter at
every step would double the model's memory): the error says which, and that the model now holds values of
the private batch and must not be released.

What it does not see (docs/privacy.md, "The state guard"): state kept outside the model's modules
(globals, closures, other objects), Python numbers appended to a container attribute in place, and a write
through an alias made before the step (a numpy view kept from construction time) or outside torch.
A model is code: one written to leak can also print or save what it sees. The guard is for models that
write state as stock layers and common code do, not a sandbox.
"""

from __future__ import annotations

import array
import collections
import contextlib
import functools
import weakref
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..errors import ConfigError

_INTERNAL = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks", "_backward_hooks",
    "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_compiled_call_impl", "training",
})
"""``nn.Module``'s own bookkeeping (hooks are the engine's: the fast path registers and removes them; ``training``
is the mode the loop sets, ``model.train()``, not in ``state_dict``)."""
_ESCAPES = frozenset({Tensor.data.__get__, Tensor.numpy, Tensor.__array__, Tensor.untyped_storage,
                      Tensor.storage, Tensor._typed_storage, Tensor.data_ptr})
"""The ways to a tensor's memory that bump no version counter."""


class StateGuard:
    """Refuses a forward that wrote the state of ``model`` (see the module's docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @contextlib.contextmanager
    def watching(self, intercept: bool = True, since: tuple | None = None) -> Iterator["_Watch"]:
        """Snapshot, watch the block for alias escapes, compare: ``error`` of the yielded watch is the refusal
        (the buffers restored) or None. Exceptions of the block pass through (the buffers restored).
        ``intercept``: watch every call of the block with a ``TorchFunctionMode`` (a forward of the user's
        loop); False: the caller passes ``watch.listen`` to the forwards' own mode instead (the engine's
        keyed forward, ``randomness.forward.keyed``: a mode around the whole step would also intercept the
        engine's own arithmetic, 1.4-10x slower measured). ``since``: a ``snapshot`` taken earlier (when the
        private loader yielded the batch), held instead of one taken now: what the loop, its hooks and callbacks
        wrote into the model on the private batch before the step is refused too."""
        watch = _Watch(self, since)
        try:
            with watch if intercept else contextlib.nullcontext():
                yield watch
        except BaseException:
            watch.compare()  # the block's error stands; the buffers go back
            raise
        watch.error = watch.compare()

    def stepped(self) -> None:
        """A step ended (its update applied): what the model holds now is what the next step must find."""
        self.after_step = self.snapshot()

    def check_between_steps(self) -> None:
        """Refuse a step when a buffer or an attribute of the model changed since the last step ended (a running
        statistic written from the private batch in Lightning's ``on_train_batch_end`` or after
        ``optimizer.step()`` in the loop: released with the model, and read by the next step's forward, it moved
        the other examples' clipped sum by 4.8 C, certified). Parameters are not compared here: rewriting them
        from the parameters alone after a step (renormalising an embedding) is post-processing."""
        before = getattr(self, "after_step", None)
        if before is None:
            return
        prints, buffers = before
        changed = {k for k in _differ(prints, self.snapshot(copies=False)[0]) if k[1] != "parameter"}
        changed |= _buffers_rewritten(buffers)
        if not changed:
            return
        names = _named(changed)
        self.after_step = None  # (said once; the next step compares from its own end)
        raise ConfigError(
            f"the model's state changed after the last private step, before this one ({', '.join(names[:6])}"
            f"{' and more' if len(names) > 6 else ''}): state written between steps (after optimizer.step(), in "
            f"Lightning's on_train_batch_end or another hook) from the private batch is released with the model "
            f"without noise, and the next step's forward reads it. Keep such state out of the model, or compute it "
            f"from public data; the model now holds it: do not release it, reload it from before")

    def changed_since(self, before: tuple | None, now: tuple) -> list[str]:
        """The parameters, buffers and attributes whose fingerprints differ between two snapshots, named."""
        return [] if before is None else _named(_differ(before[0], now[0]))

    def run(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` (a forward of the user's loop on a private batch), refused if it wrote the
        model's state (buffers restored, also when ``fn`` raised)."""
        with self.watching() as watch:
            out = fn(*args, **kwargs)
        if watch.error is not None:
            raise watch.error
        return out

    # ------------------------------------------------------------------ fingerprints
    def snapshot(self, copies: bool = True) -> tuple[dict, list]:
        """``({(module name, slot, name): fingerprint}, [(module name, module, name, buffer, copy)])``; without
        ``copies`` (the comparison's side) the buffers are not copied and the list is empty. Every module of the
        tree as it is now (``_modules``), parameters and buffers first (their storages, ``own``, decide how a
        tensor attribute is printed), then attributes."""
        prints, buffers, own = {}, [], set()
        modules = [(mname, m, _derived(m)) for mname, m in _walk(self.model) if not _metric_type(type(m))]
        with torch.no_grad():
            for mname, m, skip in modules:
                for name, p in m._parameters.items():
                    prints[(mname, "parameter", name)] = got = _print(p)
                    own.add(got[2] if got is not None else None)
                for name, b in m._buffers.items():
                    got = _print(b)
                    own.add(got[2] if got is not None else None)
                    if ("buffer", name) not in skip:
                        prints[(mname, "buffer", name)] = got
                        if b is not None and copies:
                            buffers.append((mname, m, name, b, b.detach().clone()))
            own.discard(None)
            for mname, m, skip in modules:
                for name, v in vars(m).items():
                    if name not in _INTERNAL and ("attribute", name) not in skip:
                        prints[(mname, "attribute", name)] = _print_value(v, own)
        return prints, buffers

    def storages(self) -> dict[int, list[tuple[str, str, str]]]:
        """``{storage address: [(module name, slot, name)]}`` of every parameter and buffer."""
        out: dict[int, list] = {}
        for mname, m in self.model.named_modules():
            for kind, slots in (("parameter", m._parameters), ("buffer", m._buffers)):
                for name, t in slots.items():
                    where = _storage(t) if t is not None else None
                    if where is not None:
                        out.setdefault(where, []).append((mname, kind, name, t))
        return out


class _Watch(TorchFunctionMode):
    """One watched block: the snapshot, the copies taken at alias escapes, and the comparison."""

    def __init__(self, guard: StateGuard, since: tuple | None = None) -> None:
        super().__init__()
        self.guard, self.error = guard, None
        self.prints, self.buffers = since if since is not None else guard.snapshot()
        self.by_storage: dict | None = None  # built at the first escape
        self.copies: dict[tuple, tuple[Tensor, Tensor]] = {}  # state reached around its counter: (tensor, copy)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _ESCAPES:
            self.seen(func, args)
        return func(*args, **(kwargs or {}))

    @property
    def listen(self) -> tuple:
        """``(functions, callback)`` for another mode that sees the forward's calls."""
        return _ESCAPES, self.seen

    def seen(self, func, args) -> None:
        if args and isinstance(args[0], Tensor):
            self._escape(args[0])

    def _escape(self, t: Tensor) -> None:
        """Copy the state that ``t`` shares memory with, before anything can write through the alias."""
        where = _storage(t)
        if where is None:  # a functorch wrapper: torch refuses writes through .data and pointers there
            return
        if self.by_storage is None:
            with torch._C.DisableTorchFunction():
                self.by_storage = self.guard.storages()
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for mname, kind, name, state in self.by_storage.get(where, ()):
                if (mname, kind, name) not in self.copies:
                    self.copies[(mname, kind, name)] = (state, state.detach().clone())

    def compare(self) -> ConfigError | None:
        changed = _differ(self.prints, self.guard.snapshot(copies=False)[0])
        changed |= {k for k, (t, copy) in self.copies.items() if not same_bits(t, copy)}
        # a buffer's values too (it is copied anyway, to be restored): a write through an alias outside the watched
        # forwards (``.data`` in a backward hook) bumps no counter
        changed |= _buffers_rewritten(self.buffers)
        if not changed:
            return None
        changed = sorted(changed)
        restored = _restore_buffers(self.buffers, {(m, n) for m, kind, n in changed if kind == "buffer"},
                                    dict(self.guard.model.named_modules()))
        names = _named(changed)
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        others = [k for k in changed if k[1] != "buffer"]
        return ConfigError(
            f"the model's state changed on the private batch, in its forward pass, a hook or the training loop "
            f"({shown}): a statistic of the "
            f"private data would be released with the model, without noise (the DP guarantee covers only the "
            f"noisy update). " + (f"Restored the {restored} buffer(s). " if restored else "")
            + ("The other state was not restored: the model now holds values computed from the private batch; do "
               "not release it, reload it from before this step. " if others else "")
            + "Make such state a constant or compute it outside the private step (BatchNorm: clipbias.fix(model) "
              "replaces it by GroupNorm; nn.Embedding(max_norm=...): renormalise the weights after each step "
              "instead, outside the forward; running statistics: keep them out of the module)")


def _differ(before: dict, after: dict) -> set:
    """The keys of two snapshots' fingerprints that differ (or are in one only)."""
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def _buffers_rewritten(buffers: list) -> set:
    """The buffers, still in their slots, whose values differ from the copies a snapshot took, bit for bit."""
    return {(mname, "buffer", name) for mname, m, name, b, copy in buffers
            if m._buffers.get(name) is b and not same_bits(b, copy)}


def _named(changed) -> list[str]:
    return [f"{kind} {(mname + '.' if mname else '') + name}" for mname, kind, name in sorted(changed)]


def _storage(t: Tensor) -> int | None:
    try:
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (a functorch wrapper, a fake tensor)
        return None


def _walk(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` (each module once, under its first name, in the same order), without its
    recursive generators: a stack of ``_modules`` dicts (the guard walks the tree four times a step)."""
    out, seen, stack = [], set(), [("", model)]
    while stack:
        name, m = stack.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        out.append((name, m))
        prefix = name + "." if name else ""
        stack.extend((prefix + k, c) for k, c in reversed(list(m._modules.items())))
    return out


def _print(t: Tensor | None) -> tuple | None:
    """A parameter's or buffer's fingerprint: object, storage, layout and version counter."""
    if t is None:
        return None
    try:
        local = t.to_local() if hasattr(t, "to_local") else t
        return (id(t), t._version, _storage(local), local.storage_offset(), tuple(local.shape), local.dtype,
                tuple(local.stride()))
    except RuntimeError:  # a tensor that escaped a torch.func transform: only its object can be named
        return ("unreadable", id(t), type(t))


def fingerprint(t: Tensor) -> tuple | None:
    """A tensor's fingerprint as the guard takes a parameter's: object, version counter (every in-place write bumps
    it), storage, offset, shape, dtype and strides (the integrations' optimizer-state check,
    ``clipbias.integrations.session.OptimizerWatch``)."""
    return _print(t)


class _Values:
    """A tensor attribute's fingerprint: its shape, dtype and values (a copy), compared bit for bit."""

    __slots__ = ("copy",)

    def __init__(self, t: Tensor) -> None:
        try:
            self.copy = t.detach().clone()
        except RuntimeError:  # escaped a torch.func transform
            self.copy = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Values) and self.copy is not None and other.copy is not None \
            and same_bits(self.copy, other.copy)

    __hash__ = None


_SCALARS = (bool, int, float, complex, str, bytes)


def _print_value(v: Any, own: set[int]) -> Any:
    """A module attribute's fingerprint: a tensor's values (a view of a parameter's or buffer's memory, ``own``
    storages, by where it points: its values are the slot's, compared there); a number, string, tuple or list by
    value, a weak reference by its referent; a dict by identity and the tensors in it; anything else by
    identity. (``nn.RNN`` keeps ``_flat_weights``, a list of its parameters, and weak references to them, which
    ``torch.func.functional_call`` leaves pointing at the detached tensors it was given: the same memory.)"""
    if isinstance(v, Tensor):
        where = _storage(v)
        if where in own:
            return ("view", where, v.storage_offset(), tuple(v.shape), v.dtype, tuple(v.stride()))
        return _Values(v)
    if isinstance(v, weakref.ref):
        return ("ref", _print_value(v(), own))
    if v is None or type(v) in (bool, int, str, bytes):  # (equal by value: the value itself)
        return (type(v), v)
    if isinstance(v, (bool, int, float, complex, str, bytes)):  # a NaN equals only its repr; a subclass's value by
        base = next(b for b in _SCALARS if isinstance(v, b))    # its base class's repr (its own may hide it), and
        return (type(v), base.__repr__(v), _print_value(dict(vars(v)), own) if hasattr(v, "__dict__") else None)
    if isinstance(v, np.generic):  # (its attributes too)
        return (type(v), repr(v))
    if isinstance(v, (bytearray, array.array, memoryview)):  # mutable bytes, by value
        return (type(v), bytes(v), getattr(v, "typecode", None) or getattr(v, "format", None))
    if isinstance(v, np.ndarray):
        return _Values(torch.from_numpy(v.copy())) if v.dtype != object else (id(v), type(v))
    if isinstance(v, (tuple, list, collections.deque)):
        return (type(v), tuple(_print_value(e, own) for e in v))
    if isinstance(v, (set, frozenset)):  # tensors by their values (a repr shows a large one's ends alone)
        return (type(v), frozenset(repr(e) for e in v if not isinstance(e, Tensor)),
                tuple(_print_value(e, own) for e in sorted((e for e in v if isinstance(e, Tensor)), key=id)))
    if isinstance(v, Mapping):
        return (type(v), tuple((repr(k), _print_value(e, own)) for k, e in list(v.items())))
    return (id(v), type(v))


@functools.lru_cache(maxsize=None)
def _metric_type(cls: type) -> bool:
    """A ``torchmetrics.Metric`` class: its state is the running statistic it exists to keep, logged (released
    outside the guarantee, as the loss is: docs/privacy.md) and not in ``state_dict``."""
    return any(c.__module__.startswith("torchmetrics.") and c.__name__ == "Metric" for c in cls.__mro__)


@functools.lru_cache(maxsize=None)
def _lightning_type(cls: type) -> type | None:
    """The ``LightningModule`` class among ``cls``'s bases, or None."""
    return next((c for c in cls.__mro__ if c.__name__ == "LightningModule"), None)


def _derived(m: nn.Module) -> set[tuple[str, str]]:
    """The state of ``m`` that torch recomputes from its parameters alone, never from data, which the guard
    does not compare: ``nn.RNN``'s list of its weights (``torch.func.functional_call`` leaves it holding the
    tensors it was given), old-style ``weight_norm``'s and ``spectral_norm``'s recomputed weight attribute and
    the power iteration's vectors (old style and ``parametrizations.spectral_norm``), and Lightning's and Hugging
    Face's bookkeeping on the LightningModule or model (``_lightning_own``; ``warnings_issued``)."""
    skip: set[tuple[str, str]] = set()
    if isinstance(m, nn.RNNBase):
        skip |= {("attribute", "_flat_weights"), ("attribute", "_flat_weight_refs")}
    for hook in m._forward_pre_hooks.values():
        kind = type(hook).__name__
        if kind in ("WeightNorm", "SpectralNorm") and isinstance(getattr(hook, "name", None), str):
            skip.add(("attribute", hook.name))
            if kind == "SpectralNorm":
                skip |= {("buffer", hook.name + "_u"), ("buffer", hook.name + "_v")}
    if type(m).__name__ == "_SpectralNorm":
        skip |= {("buffer", "_u"), ("buffer", "_v")}
    if "warnings_issued" in vars(m):
        skip.add(("attribute", "warnings_issued"))
    lightning = _lightning_type(type(m))
    if lightning is not None:
        skip |= {("attribute", k) for k in _lightning_own(lightning)}
    return skip


_LIGHTNING_SETS = frozenset({"_hparams_name", "_current_fx_name", "_device_mesh",
                             "_metric_attributes", "_gpus_arg_default", "_compiler_ctx", "_device",
                             "training_step_outputs", "validation_step_outputs"})
"""Attributes Lightning sets on a LightningModule after construction (read off its source:
``pl_module._current_fx_name =``, ...), and the lists its documentation has ``training_step`` append the step's
outputs to for ``on_train_epoch_end`` (logged, a release outside the guarantee like any log; not in
``state_dict``)."""

_LIGHTNING_COMPARED = frozenset({"_hparams", "_hparams_initial"})
"""Lightning's attributes that are compared all the same: ``save_hyperparameters`` writes them at construction,
never during training, and ``self.hparams`` is the module's to read (a batch statistic written into it in
``training_step`` and read by ``forward`` moved the other examples' clipped sum by 12 C, certified)."""


@functools.lru_cache(maxsize=None)
def _lightning_own(cls: type) -> frozenset:
    """Lightning's own attributes of a LightningModule: those of a fresh one and ``_LIGHTNING_SETS``. A user's
    attribute, whatever its name (``self._running_mean``), is compared."""
    return (frozenset(vars(cls())) | _LIGHTNING_SETS) - _LIGHTNING_COMPARED


def same_bits(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` hold the same shape, dtype, device and bits (a NaN equals itself, -0.0 differs from 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.dtype.is_complex:
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    a, b = a.detach(), b.detach()
    return torch.equal(a.contiguous().view(words), b.contiguous().view(words)) if words else torch.equal(a, b)


def _restore_buffers(copies: list, changed: set, modules: dict) -> int:
    """Put back the ``changed`` buffers ``{(module name, buffer name)}`` (values, object and slot) from
    ``copies``; returns how many."""
    restored = 0
    with torch.no_grad():
        for mname, m, name, b, old in copies:
            if (mname, name) not in changed:
                continue
            if b.shape == old.shape and b.dtype == old.dtype:
                b.copy_(old)
            else:
                b.data = old
            m._buffers[name] = b
            restored += 1
    return restored
