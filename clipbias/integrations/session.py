"""One private training as every adapter sees it: draw a batch, record the loop's calls on it, take the step,
report. The Opacus interface (``opacus``), ``DPCallback`` (``lightning``) and ``DPTrainer`` (``transformers``)
are framework glue around one ``Session``:

* ``Session.batches`` draws the secret Poisson batches of the user's dataset (``PoissonLoader``: the engine's
  sampler, the user's ``collate_fn`` and workers), splits each into the chunks the framework iterates
  (``BatchMemoryManager``'s physical batches, Hugging Face's gradient-accumulation micro-steps) and keeps the
  batch handed out and not yet stepped on: ``Pending``.
* ``Session.call`` is the model's forward on a chunk: recorded, run under the engine's state guard, its outputs
  handed to the loop as leaves, so that the loop's own ``loss.backward()`` leaves in them the gradient of the
  loss the loop computes. Without a ``criterion`` (``follows``) that gradient is what the step trains
  (``rowtrace`` proves it per example); with one, the step differentiates ``criterion`` and says so where the
  loop's loss differs (``check_loss``).
* ``Session.step`` takes the private step on the pending batch (``DPEngine.step``), at the optimizer's settings
  and state as the batch was drawn and as the last step left them (``OptimizerWatch``); ``DPOptimizer`` is the
  user's optimizer with that step; ``report``, ``epsilon`` (``EpsilonLog``), ``state_dict`` and
  ``load_state_dict`` are the run's. ``epoch_steps`` is every adapter's count of an epoch's steps.

Each adapter decides only where these are called from: its loader's ``__iter__``, its model's forward, its
optimizer's ``step``. Beside the session, shared by the adapters too: ``options`` (the settings, their checks
and the one way to the ``DPEngine``), ``losses`` (per-example losses), ``refusals`` (the framework settings the
step cannot run soundly), ``released`` (what each adapter releases outside the mechanism).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.optim.optimizer as torch_optimizer
import torch.utils._pytree as pytree
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset, default_collate

from ..data import batch
from ..engine import DPEngine, accounting, guard
from ..engine.checks import class_indices, padding_refusal
from ..errors import ClipbiasError, ConfigError
from ..grads.rows import cross_entropy, output_gradient
from ..privacy import PrivacyReport, check_delta
from ..randomness import forward
from ..sampling.loader import PoissonLoader, TensorData, split
from ..sampling.poisson import epoch_steps as sampling_epoch_steps
from . import rowtrace
from .public_rows import clipped_rows
from .released import SIZES_RELEASED


@dataclass
class Pending:
    """The logical batch the private loader handed out and the step has not been taken on yet."""

    indices: Tensor
    data: Any                      # the collated batch, as the loader yielded it
    chunks: int = 1                # chunks it is yielded in (physical batches, accumulation micro-steps)
    yielded: int = 0               # chunks yielded so far
    seen: int = 0                  # chunks the framework's training step has taken (Hugging Face's)
    inputs: list = field(default_factory=list)  # the model's recorded inputs, one per chunk
    stepped: bool = False          # the model's forward took the private step (``Session.call``)
    outputs: list = field(default_factory=list)  # the outputs the loop got, as leaves (None: not a tensor)
    chunk: "rowtrace.Rows | None" = None  # the chunk yielded last, traced (the loop's own loss: ``follows``)
    chunk_rows: list = field(default_factory=list)  # every chunk's ``Rows``, in order
    call_chunks: list = field(default_factory=list)  # the chunk (its number) of each recorded call (``follow``)
    public_calls: list = field(default_factory=list)  # ((args, kwargs), output leaves) of public calls (``public_clip``)


def _public_rows_call(session: "Session", fn: Callable, pending: Pending, args: tuple, kwargs: dict) -> Any:
    """A public call under ``public_clip``: run without a graph (under the state guard), its floating outputs
    handed as leaves labelled public; the step clips each row's gradient (``_with_clipped_rows``)."""
    with torch.no_grad():
        out = rowtrace.check_public(session.guarded(fn, *args, **kwargs))
    leaves: list = []

    def leaf(t: Tensor) -> Tensor:
        if not t.is_floating_point():
            return t
        leaves.append(t.detach().requires_grad_())
        return leaves[-1]
    handed = batch.map_tensors(leaf, out)
    pending.chunk.made.update(map(id, leaves))  # (leaves of the loss's graph that are clipbias's: rowtrace._unproven)
    # a copy of the inputs as the call saw them: the rows' gradients are computed from it at the step, and a
    # loop could write private rows into the public tensor in between (a red team moved the update 128x so)
    seen = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, (args, kwargs))
    pending.public_calls.append((seen, leaves))
    return rowtrace.public_output(handed, pending.chunk)


def _with_clipped_rows(session: "Session", pending: Pending, public: list) -> list:
    """``public`` plus, for each public call under ``public_clip``, the mean of its rows' gradients of the
    loop's loss, each clipped to ``public_clip`` (``public_rows.clipped_rows``)."""
    for rec, leaves in pending.public_calls:
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        if not leaves or not any(t.grad is not None for t in leaves):
            continue
        part = clipped_rows(session.engine.model, _as_batch(rec), grads[0] if len(grads) == 1 else tuple(grads),
                            session.public_clip)
        public = [q if p is None else p + q.to(p.dtype) for p, q in zip(public, part)]
    return public


def _sizes_named(session: "Session", args: tuple, kwargs: dict, sizes: tuple) -> None:
    """``SIZES_RELEASED`` added to ``session.released`` where a public call's first tensor argument has one of the
    private batch's ``sizes`` of rows (its chunk's, its own), or where the run's public calls have had more than one
    number of rows (``2 b`` or ``b + 1`` rows follow the batch's size too: red team round 11; public calls of two
    fixed sizes are named as well, conservatively)."""
    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, Tensor) and t.dim() > 0), None)
    if SIZES_RELEASED in session.released or first is None:
        return
    session.public_rows.add(first.shape[0])
    if first.shape[0] in sizes or len(session.public_rows) > 1:
        session.released = (*session.released, SIZES_RELEASED)


def epoch_steps(n: int, batch_size: int, drop_last: bool = False) -> int:
    """The steps of one epoch of ``n`` examples in (expected) batches of ``batch_size``, as Opacus, Lightning and
    Hugging Face count them, every adapter's one count: ``len()`` of the user's ``DataLoader(dataset,
    batch_size, drop_last=...)``, ceil(n / B), or n // B with ``drop_last`` (``clipbias.sampling.epoch_steps``)."""
    return sampling_epoch_steps(n, batch_size, drop_last)


def poisson_loader(engine: DPEngine, data_loader: DataLoader) -> PoissonLoader:
    """The engine's secret Poisson batches of ``data_loader``'s dataset, with its ``collate_fn``, workers and
    pinning; a ``TensorDataset`` of inputs and targets read with torch's default collate is fetched by one
    indexing operation a batch (``TensorData``: the same tensors the collate would stack)."""
    ds, workers = data_loader.dataset, data_loader.num_workers
    if type(ds) is TensorDataset and len(ds.tensors) == 2 and data_loader.collate_fn is default_collate:
        ds = TensorData(*ds.tensors)
    return PoissonLoader(engine, ds, collate_fn=data_loader.collate_fn, num_workers=workers,
                         pin_memory=data_loader.pin_memory,
                         prefetch_factor=data_loader.prefetch_factor if workers else None,
                         persistent_workers=data_loader.persistent_workers if workers else False,
                         multiprocessing_context=data_loader.multiprocessing_context if workers else None,
                         device="cpu")


def physical_chunks(size: int | None) -> Callable[[Any], list]:
    """Split a batch in chunks of at most ``size`` examples (None: whole)."""
    def chunks(data: Any) -> list:
        b = batch.size(split(data)[1])
        if size is None or b <= size:
            return [data]
        return [batch.tree_map(lambda t, s=s: t[s:s + size], data) for s in range(0, b, size)]
    return chunks


def exact_chunks(n: int) -> Callable[[Any], list]:
    """Split a batch in exactly ``n`` slices (some may be empty): one per gradient-accumulation micro-step."""
    def chunks(data: Any) -> list:
        b = batch.size(data)
        bounds = [round(i * b / n) for i in range(n + 1)]
        return [batch.tree_map(lambda t, lo=lo, hi=hi: t[lo:hi], data) for lo, hi in zip(bounds, bounds[1:])]
    return chunks


LOSS_CHECKS = 5
"""``Session.check_loss`` holds the loop's loss against ``criterion`` at the first this many steps."""

LOSS_WARNING = ("the loss your training loop computes is not `criterion`'s: its gradient with respect to the model's "
                "outputs differs from that of the mean of `criterion`'s per-example losses on the same outputs and "
                "targets. With `criterion` given, the private step differentiates `criterion` for each example, not "
                "the graph your loop built, so label smoothing, class weights, extra terms or another loss in the loop "
                "are not what is trained. Leave out `criterion` to train the loss your loop computes, "
                "or pass that loss as `criterion`: a loss module with `reduction` (evaluated per example), or a "
                "function of (outputs, targets) that returns one loss per example")

PARAMETERS_MOVED = (
    "the model's parameters changed between steps after the loop computed with a value of an earlier batch (a "
    "parameter written from it, `p.data = ...` or through a value read out of torch, reaches the released model "
    "unclipped); post-processing such as weight clipping is proved when it comes before any use of the batch's "
    "values after optimizer.step()")

UNPROVEN_WARNING = (
    "this step's loss could not be proved a sum of per-example terms: {}. The run is no longer certified "
    "(privacy_report() says why). To keep the guarantee, read values (loss.item(), accuracy) after "
    "optimizer.step() (Lightning: in on_train_batch_end), or pass criterion=... (to make_private or DPCallback): "
    "the step then differentiates criterion per example and does not depend on what your loop computes")


class Session:
    """One private training: the engine, the batch handed out and not stepped on (``pending``), the loop's
    calls on it, the step and the report.

    Args:
        engine: The run's ``DPEngine``; its ``loss_fn`` is ``output_gradient`` where the step trains the loss
            the loop computes (``follows``).
        unstepped: The error's text when the loop ran the model on a batch and asked for the next one without
            a step (None: no such check, the framework steps by itself).
        released: What the framework releases beside the model outside the mechanism (``PrivacyReport.released``).
        eager: False where the forward may never take the step (a framework whose training step runs under the
            state guard: the step's own update would read as a write).
        public_clip: Where given, a public forward's gradient is each of its rows' clipped to this norm and
            averaged (``public_rows``), instead of its exact gradient.
    """

    def __init__(self, engine: DPEngine, unstepped: str | None = None, released: tuple[str, ...] = (),
                 eager: bool | None = None, public_clip: float | None = None) -> None:
        self.engine, self.unstepped, self.released, self.public_clip = engine, unstepped, released, public_clip
        self.pending: Pending | None = None
        self.public_rows: set[int] = set()  # the row counts of the run's public calls (``_sizes_named``)
        self.run = rowtrace.Run(engine.state_guard.model)  # reads of a batch after its step (``follows``)
        self.anchor = torch.zeros((), requires_grad=True)
        self.eager = eager  # whether the forward may take the step (criterion; None: its first forward decides)
        self.loss_checks = 0  # steps whose loop's loss was held against criterion's (``check_loss``)
        self.stepping = False  # inside ``DPEngine.step`` (``engine_step``)
        self.watch = OptimizerWatch(engine.optimizer)  # its settings and state as drawn and stepped
        self.epsilon = EpsilonLog(engine)  # ``epsilon()``: the run's epsilon so far, as the adapters log it

    @property
    def follows(self) -> bool:
        """Whether the step trains the loss the loop computes (no ``criterion``)."""
        return self.engine.loss_fn is output_gradient

    # ------------------------------------------------------------------ the batches
    def batches(self, loader: PoissonLoader, steps: int, chunks: Callable[[Any], list],
                check: Callable[[Any], None] | None = None) -> Iterator:
        """The chunks of ``steps`` secret Poisson batches (``loader``; fewer where the engine's plan ends), each
        batch split by ``chunks`` and kept as ``pending`` while its chunks are handed out (``check`` refuses a
        collated batch the adapter cannot use); traced where the step follows the loop (``rowtrace``). A batch
        the loop leaves without a step (a ``break``, a peek) stays pending (a peeked batch may be stepped on) and
        is never handed out again; until a step uses it, it counts as passed over (``PoissonSampler.abandon``:
        the run is uncertified), since whether a loop stops may depend on what it saw."""
        for idx, data in loader.batches(steps):
            if check is not None:
                check(data)
            parts = chunks(data)
            self.pending = pending = Pending(idx, data, len(parts))
            self.watch.drawn()  # (the step is taken at these settings and this state: ``engine_step``)
            for chunk in parts:
                pending.yielded += 1
                if self.follows:  # traced rows (``rowtrace``), a ``Rows`` per chunk; a value read out of an
                    # earlier chunk of the batch may feed this one's loss: the read carries over
                    earlier = pending.chunk
                    pending.chunk = rowtrace.Rows(_rows_in(chunk), self.engine.params, self.run)
                    pending.chunk.escaped = earlier.escaped if earlier is not None else None
                    pending.chunk_rows.append(pending.chunk)
                    chunk = rowtrace.yielded(chunk, pending.chunk)
                yield chunk
            if self.unstepped is not None and self.pending is pending and pending.inputs:
                self.pending = None  # the loop never stepped on it
                raise ConfigError(self.unstepped)

    # ------------------------------------------------------------------ the model's forward
    def call(self, fn: Callable, training: bool, args: tuple, kwargs: dict) -> Any:
        """The model's forward ``fn(*args, **kwargs)`` as the loop's call on the pending batch: in training, on
        its rows, recorded for the step and run without a graph (under the state guard), the outputs handed as
        leaves; elsewhere ``fn`` as it is."""
        pending = self.pending
        if self.stepping:  # the engine's own forward, inside its step (a model whose forward is this call)
            return fn(*args, **kwargs)
        if self.follows:  # the loop's own loss (``rowtrace``): the tensors the loop gets are traced
            args, kwargs, traced = rowtrace.plain(args), rowtrace.plain(kwargs), (args, kwargs)
        if self.follows and pending is not None and not training and rowtrace.reads_rows(*traced):
            with torch.no_grad():  # (eval mode on the private rows: values for metrics, no gradient to hide)
                return rowtrace.outputs_of(self.guarded(fn, *args, **kwargs), *traced)
        if pending is None or not training:  # (on a batch already stepped on: its rows, a read of them is one)
            return rowtrace.outputs_of(fn(*args, **kwargs), *traced) if self.follows else fn(*args, **kwargs)
        if self.follows:
            return self._follow(fn, pending, args, kwargs, traced)
        record = torch.is_grad_enabled()  # a no_grad pass (a "teacher" forward) is not the step's, but guarded
        if record:
            pending.inputs.append((args, kwargs))
            if self.eager and pending.chunks == 1 and len(pending.inputs) == 1 and len(pending.indices):
                return self._step_here(pending)
        with torch.no_grad():
            out = self.guarded(fn, *args, **kwargs)
        if record and self.eager is None:
            self.eager = self.engine.outputs_kept and "labels" not in kwargs and _per_example(out, len(pending.indices))
        return self._handed(out, pending) if record else out

    def _follow(self, fn: Callable, pending: Pending, args: tuple, kwargs: dict, traced: tuple) -> Any:
        """A call in a step that trains the loop's own loss: on the chunk's rows (``rowtrace.forward_kind``), the
        step's forward, without a graph, its outputs handed as traced leaves; on other data, public: the model
        with its graph, whose gradient the loop's backward adds to the update exactly (``rowtrace._backward``)."""
        chunk = pending.chunk
        if rowtrace.forward_kind(*traced, chunk, pending.data) == "public":
            _sizes_named(self, args, kwargs, (chunk.size, len(pending.indices)))
            if self.public_clip is not None and torch.is_grad_enabled():
                return _public_rows_call(self, fn, pending, args, kwargs)
            return rowtrace.public_output(rowtrace.check_public(self.guarded(fn, *args, **kwargs)), chunk)
        record = torch.is_grad_enabled()  # a no_grad pass (a "teacher" forward) is not the step's, but guarded
        with torch.no_grad(), keyed_rows(self.engine, pending, (args, kwargs)):  # (the step's own dropout masks)
            out = self.guarded(fn, *args, **kwargs)
        if not record:
            return rowtrace.rows_output(out, chunk)
        pending.inputs.append((args, kwargs))
        pending.call_chunks.append(len(pending.chunk_rows) - 1)
        leaves: list = []
        handed = batch.map_tensors(lambda t: _private_leaf(t, chunk, leaves), out)
        pending.outputs.append(leaves)
        return handed

    def _step_here(self, pending: Pending) -> Any:
        """The private step now, on the recorded call; its outputs, as the loop gets them (``_handed``)."""
        self.take(pending, keep_outputs=True)  # (the engine's step guards its own forward)
        pending.stepped = True
        return self._handed(self.engine.last_outputs, pending)

    def _handed(self, out: Any, pending: Pending) -> Any:
        """``out`` as the loop gets it: a floating tensor as a leaf that requires grad, so that the loop's
        ``loss.backward()`` leaves in it the gradient of the loop's own loss, which the step holds against
        ``criterion``'s (``check_loss``); anything else tied to a zero-valued anchor."""
        if isinstance(out, Tensor) and out.is_floating_point():
            leaf = out.detach().requires_grad_()
            pending.outputs.append(leaf)
            return leaf
        pending.outputs.append(None)
        return _tie(out, self.anchor)

    def guarded(self, fn: Callable, *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` under the engine's state guard: refused (the buffers restored) if it wrote the
        model's state (``clipbias.engine.guard``)."""
        return self.engine.state_guard.run(fn, *args, **kwargs)

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        """The private step at the end of each logical batch (earlier chunks only record their inputs)."""
        pending = self.pending
        if pending is None:
            raise ConfigError("an optimizer step without a batch of the private data loader: iterate over the "
                              "private data loader and call the model on each batch")
        if pending.yielded < pending.chunks:  # a chunk of a larger logical batch (virtual step)
            return
        self.pending = None
        if self.follows:
            self.follow(pending)
            return
        self.check_loss(pending)
        if pending.stepped and len(pending.inputs) == 1:  # the model's forward took the step (``call``)
            return
        if len(pending.inputs) != pending.chunks:
            raise ConfigError(f"the model ran {len(pending.inputs)} time(s) on this batch of the private data loader, "
                              f"in {pending.chunks} chunk(s): call it exactly once per (chunk of a) batch, in training "
                              f"mode with gradients enabled")
        self.take(pending)

    def take(self, pending: Pending, keep_outputs: bool = False) -> None:
        """``DPEngine.step`` on the logical batch (``keep_outputs``: its outputs in ``engine.last_outputs``)."""
        x, y = self.recorded(pending)
        # the engine compares the inputs and targets with the batch as the loader fetched it (``engine.drawn``:
        # an in-place transform of the yielded tensors changed ``pending.data`` too; ``labels=`` may be the targets)
        self.engine_step(x, y, pending.indices, keep_outputs=keep_outputs)

    def engine_step(self, *args, **kwargs) -> Any:
        """``DPEngine.step``, at the optimizer's settings and state of the moment the batch was drawn, and at the
        state the last step left (``OptimizerWatch``: refused otherwise); the model's forward inside it is the
        engine's own (``call`` passes it through)."""
        self.watch.check()
        self.stepping, taken = True, self.engine.steps_taken
        try:
            return self.engine.step(*args, **kwargs)
        finally:
            self.stepping = False
            if self.engine.steps_taken != taken:  # (the optimizer's own step on the update wrote its state)
                self.watch.stepped()

    def recorded(self, pending: Pending) -> tuple:
        """The logical batch's model inputs (as recorded) and targets (the loader's, or a ``labels`` keyword)."""
        x = batch.cat([_as_batch(rec) for rec in pending.inputs])
        if isinstance(x, dict) and "labels" in x:
            x = dict(x)
            y = x.pop("labels")
        else:
            y = split(pending.data)[1]
        y = batch.to(y, next(iter(self.engine.params)).device)
        if batch.size(x) != len(pending.indices) or batch.size(y) != len(pending.indices):
            raise ConfigError(f"the model was called on {batch.size(x)} examples, but the private data loader's batch "
                              f"holds {len(pending.indices)}: call the model on the batch (or chunk) as drawn, one "
                              f"example per row")
        return x, y

    def check_loss(self, pending: Pending) -> None:
        """Say so (a warning, once) where the loss the loop computed is not ``criterion``'s: the gradient the loop's
        ``loss.backward()`` left in the outputs against that of the mean of ``criterion``'s per-example losses on
        the same outputs and targets (checked at the first ``LOSS_CHECKS`` steps whose batch was one call of the
        model returning one tensor; a loss that ignored the outputs has none). The step differentiates
        ``criterion``, never the loop's graph: a loss the loop changed (label smoothing, class weights, an extra
        term, a sum) would otherwise be replaced in silence."""
        if self.loss_checks >= LOSS_CHECKS or len(pending.outputs) != 1 or pending.outputs[0] is None \
                or not len(pending.indices):
            return
        self.loss_checks += 1
        out = pending.outputs[0]
        try:
            _, y = self.recorded(pending)
            ours = _criterion_gradient(self.engine.loss_fn, out, y)
        except Exception:  # (criterion cannot run on the whole batch: the engine's step will say why)
            return
        theirs = out.grad if out.grad is not None else torch.zeros_like(out)
        scale = float(theirs.abs().max())
        if torch.allclose(theirs, ours, rtol=1e-3, atol=1e-6 * max(scale, float(ours.abs().max()), 1e-30)):
            return
        self.loss_checks = LOSS_CHECKS
        b = len(out)
        summed = b > 1 and torch.allclose(theirs, ours * b, rtol=1e-3, atol=1e-6 * max(scale, 1e-30))
        warnings.warn(LOSS_WARNING + (f" (here the loop's loss is the sum over the batch, {b} times criterion's mean: "
                                      f"divide it by the batch size, or scale the learning rate)" if summed else ""),
                      stacklevel=4)

    def follow(self, pending: Pending) -> None:
        """The private step on the loss the loop computed: each chunk's forward on its rows, with the gradient the
        loop's backward left in its outputs (times the chunk's size: ``loss_reduction="mean"``, Opacus's
        convention, each example's gradient of its own loss) as the targets of ``output_gradient``; and the
        public part the loop's backward passes left in the parameters (``rowtrace``)."""
        per_chunk = [[k for k, c in enumerate(pending.call_chunks) if c == i] for i in range(len(pending.chunk_rows))]
        views = len(per_chunk[0]) if per_chunk else 0
        if views == 0 or len(pending.inputs) != pending.chunks * views or any(len(calls) != views for calls in per_chunk):
            raise ConfigError(f"the model ran {len(pending.inputs)} time(s) on the rows of this batch of the private "
                              f"data loader, in {pending.chunks} chunk(s) ({[len(c) for c in per_chunk]} a chunk): "
                              f"call it the same number of times on the rows of each (chunk of a) batch, in "
                              f"training mode with gradients enabled: once, or K times for K views of each example "
                              f"(augmentations; their gradients are summed per example before clipping). A call on "
                              f"other data, generated images or a public batch, is public and may come in any number")
        gs, xs, public = [], [], [None] * len(self.engine.params)
        for chunk, calls in zip(pending.chunk_rows, per_chunk):
            g_views = []
            for k in calls:
                leaves = pending.outputs[k]
                if chunk.backwards == 0 and any(leaf.grad is not None for leaf in leaves):
                    raise ConfigError("the gradient in the model's outputs did not come from a loss.backward() on "
                                      "them that clipbias followed (rowtrace): compute the loss from the outputs the "
                                      "model returned and call loss.backward()")
                g = [leaf.grad * chunk.size if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
                g_views.append(g[0] if len(g) == 1 else tuple(g))
            if views == 1:
                gs.append(g_views[0])
                xs.append(_as_batch(pending.inputs[calls[0]]))
            else:  # each example's K views, [rows, K, ...], in the order of the calls
                gs.append(_stacked(g_views, "outputs"))
                xs.append(_stacked([_as_batch(pending.inputs[k]) for k in calls], "inputs"))
            public = [p if q is None else q if p is None else p + q for p, q in zip(public, chunk.public)]
        public = _with_clipped_rows(self, pending, public)
        x = batch.cat(xs)
        if batch.size(x) != len(pending.indices):
            raise ConfigError(f"the model was called on {batch.size(x)} examples, but the private data loader's batch "
                              f"holds {len(pending.indices)}: call the model on the batch (or chunk) as drawn, one "
                              f"example per row")
        for chunk in pending.chunk_rows:  # a read after the backward, before this step, may steer the step
            if chunk.unproven is None and chunk.escaped is not None:
                chunk.unproven = chunk.escaped + " before optimizer.step()"
        if self.run.moved():  # (parameters written after the loop computed with a value of an earlier batch)
            pending.chunk_rows[0].unproven = pending.chunk_rows[0].unproven or PARAMETERS_MOVED
        if self.run.read_after_step is not None and any(p is not None and bool(p.any()) for p in public):
            pending.chunk_rows[0].unproven = pending.chunk_rows[0].unproven or (
                f"a public term after {self.run.read_after_step} (it may carry that batch into the update unclipped)")
        if views == 1:
            self.engine_step(x, batch.cat(gs), pending.indices, public=public)
        else:
            self.engine_step(x, batch.cat(gs), pending.indices, public=public, views=True)
        for chunk in pending.chunk_rows:  # a read from now on is a read of an earlier batch
            chunk.stepped, chunk.watched = True, []
        why = next((c.unproven for c in pending.chunk_rows if c.unproven is not None), None)
        if why is not None:  # released, and counted: the report carries the caveat (``accounting.report``)
            self.engine.unproven_steps += 1
            if self.engine.unproven_steps == 1:
                warnings.warn(UNPROVEN_WARNING.format(why), stacklevel=4)

    # ------------------------------------------------------------------ the report and the state
    def report(self, delta: float | None = None) -> PrivacyReport:
        """The guarantee after the steps taken, at ``delta`` (default: the run's)."""
        if delta is not None:
            check_delta(delta)
        unstepped(self)  # (a batch handed out and not stepped on counts as passed over, closed or not)
        report = accounting.report(self.engine, self.engine.steps_taken, delta)  # (one accountant run, the caveats)
        return dataclasses.replace(report, released=(*report.released, *self.released))

    def state_dict(self) -> dict:
        """The engine's private state (secret key, sampler, counters, error feedback, the optimizer's state)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)
        self.watch.after = None  # (the optimizer's state loaded: the next draw takes it as it is)


class DPDataLoader:
    """Secret Poisson batches of your DataLoader's dataset, with its ``collate_fn``, workers and pinning:
    each example joins each step independently with probability B / n (B: your ``batch_size``); an empty
    batch (zero rows, your collate's structure) is a noise-only step. ``len()`` is the steps of one epoch as
    Opacus, Lightning and Hugging Face count them, ``len()`` of your DataLoader: ceil(n / B), n // B with
    ``drop_last=True`` (``epoch_steps``); an epoch yields that many batches (fewer at the end of a planned run:
    ``make_private_with_epsilon``'s ``epochs * len()`` steps). Yields what your ``collate_fn`` returns, as your
    DataLoader did, split in chunks of at most ``physical_batch_size`` rows (``BatchMemoryManager``). The
    Opacus interface returns it from ``make_private``; Lightning's ``DPCallback`` hands it to the Trainer as the
    train loader (its session read at each pass: ``session_of``); ``marked`` is one with no session yet."""

    def __init__(self, session: Session | None, data_loader: DataLoader,
                 session_of: Callable[[], Session | None] | None = None) -> None:
        self._session, self._session_of, self.original = session, session_of, data_loader
        self.dataset, self.batch_size = data_loader.dataset, data_loader.batch_size
        self.physical_batch_size: int | None = None
        self.steps_per_epoch = epoch_steps(len(self.dataset), self.batch_size, data_loader.drop_last)
        self._loader: tuple | None = None  # (engine, its PoissonLoader of the dataset)

    @classmethod
    def marked(cls, data_loader: DataLoader) -> "DPDataLoader":
        """Your DataLoader marked for private training, its batches to be drawn by the step that takes it
        (``DPLightningDataModule``'s train loader: the ``DPCallback`` that ``make_private`` adds draws them);
        iterated on its own it refuses."""
        return cls(None, data_loader)

    @property
    def session(self) -> Session | None:
        return self._session_of() if self._session_of is not None else self._session

    @property
    def engine(self) -> DPEngine | None:
        return self.session.engine if self.session is not None else None

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def batch_sampler(self):
        """The engine's secret Poisson sampler (Opacus's ``DPDataLoader.batch_sampler`` is its Poisson sampler;
        scripts print it): ``PoissonSampler``."""
        return self.engine.sampler if self.engine is not None else None

    def __iter__(self):
        if self._session_of is not None:  # (Lightning's: the session is read at the first batch)
            return self._at_first_batch()
        return self._batches(self._session)

    def _at_first_batch(self) -> Iterator:
        yield from self._batches(self.session)

    def _batches(self, session: Session | None) -> Iterator:
        if session is None:  # (refused at the first batch: Lightning checks that a loader is iterable)
            return _no_session()
        engine = session.engine
        if engine.steps_taken >= engine.total_steps:  # a pass would yield no batch: say why
            raise ConfigError(
                f"the {engine.total_steps} steps make_private_with_epsilon planned (epochs x len(data_loader)) are "
                f"all taken, and target_epsilon covers no more (the noise was calibrated for them): this pass over "
                f"the data loader would yield no batch. To train longer, plan it from the start: a new PrivacyEngine "
                f"and make_private_with_epsilon(..., epochs=more) (the noise is then calibrated for the longer run), "
                f"or make_private(noise_multiplier=...), which has no planned end (get_epsilon accounts the steps "
                f"taken). A new training that starts from these trained weights adds its epsilon to this one's")
        if self._loader is None or self._loader[0] is not engine:
            self._loader = (engine, poisson_loader(engine, self.original))
        return session.batches(self._loader[1], len(self), physical_chunks(self.physical_batch_size))


def _no_session() -> Iterator:
    raise ConfigError("this data loader is marked for private training, and no private training has started with "
                      "it: DPLightningDataModule's train loader is drawn by the DPCallback that make_private adds to "
                      "the Trainer (pass the data module to trainer.fit)")
    yield  # (a generator: the error comes at the first batch)


class DPOptimizer(torch.optim.Optimizer):
    """Your optimizer, made private: ``step()`` runs ``closure`` (if given) and then the private step on the
    batch the private loader drew (``Session.step``), which ends in your optimizer's own ``step`` on the private
    update. Its ``param_groups``, ``state`` and ``defaults`` are your optimizer's (schedulers act on them);
    ``state_dict`` is your optimizer's. ``original_optimizer`` is your optimizer.

    Args:
        optimizer: Your optimizer.
        session: The run's ``Session``.
        guard_closure: Run ``closure`` under the engine's state guard (a framework's training step, which may
            write the model's state on the private batch: Lightning's ``training_step``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, session: Session, guard_closure: bool = False) -> None:
        self.original_optimizer, self.session, self.engine = optimizer, session, session.engine
        self.guard_closure = guard_closure  # (no super().__init__: the state is the original's)
        self.noise_multiplier, self.max_grad_norm = self.engine.noise_multiplier, self.engine.config.clip
        self.expected_batch_size = self.engine.expected_batch_size
        self._step_supports_amp_scaling = False

    @property
    def transformed_steps(self) -> int:
        """Steps whose model inputs or targets were not the drawn batch: the engine's count (``engine.drawn``)."""
        return self.engine.transformed_steps

    @property
    def param_groups(self) -> list[dict]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self):
        return self.original_optimizer.state

    @property
    def defaults(self) -> dict:
        return self.original_optimizer.defaults

    def __getattr__(self, name: str):
        if name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks", "_zero_grad_profile_name", "_opt_called"):
            return getattr(self.original_optimizer, name)
        raise AttributeError(name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.original_optimizer.load_state_dict(state_dict)
        self.session.watch.after = None  # (loaded, not written from a batch: the next draw takes it as it is)

    def add_param_group(self, param_group: dict) -> None:
        raise ConfigError("add_param_group after the training was made private: the private update covers the "
                          "parameters the engine was built with; add the group before")

    def step(self, closure: Callable | None = None):
        """The private step, at the end of each logical batch (earlier chunks only record their inputs).
        Returns ``closure()``'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = self.session.guarded(closure) if self.guard_closure else closure()
        self.session.step()
        return loss


class ReleasedUpdate:
    """Where the framework steps your optimizer after the private step (Hugging Face's ``Trainer``): the private
    update the engine left in ``.grad`` must reach ``optimizer.step()`` as it was left, at the settings of the
    step, and the parameters the step wrote must reach the next private step as they were (a red team's callback
    added a value of the batch to ``.grad`` or the learning rate in ``on_pre_optimizer_step``, 8,611-10,915 C, or to
    the parameters in ``on_step_end``, 86 C, certified, before). Checked by a step pre-hook and post-hook of
    clipbias's own on your optimizer, by version counters (every in-place write bumps them)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # (accelerate's wrapper: the torch optimizer)
        self.left: tuple | None = None  # the update as the engine left it: (gradients' prints, settings)
        self.after: list | None = None  # the parameters as the optimizer's step left them

        def before(opt, args, kwargs):
            self._before()

        def after(opt, args, kwargs):
            self.after = self._params()
        for hook in (before, after):
            hook._clipbias_own = True
        self.optimizer.register_step_pre_hook(before)
        self.optimizer.register_step_post_hook(after)

    def _tensors(self) -> list:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _params(self) -> list:
        return [(id(p), p._version) for p in self._tensors()]

    def _grads(self) -> list:
        return [(id(p), p._version, None if p.grad is None else (id(p.grad), p.grad._version)) for p in self._tensors()]

    def left_update(self) -> None:
        """The engine's step left the private update in ``.grad``."""
        self.left = (self._grads(), _settings(self.optimizer))

    def _before(self) -> None:
        left, self.left = self.left, None
        if left is None:
            raise ConfigError("the optimizer stepped without a private step before it: its .grad is not the private "
                              "update (step it only through the DPTrainer's training loop)")
        if self._grads() != left[0] or not _same(_settings(self.optimizer), left[1]):
            raise ConfigError("the private update (.grad), the parameters or the optimizer's settings changed between "
                              "the private step and optimizer.step() (a callback's on_pre_optimizer_step, or a "
                              "training_step override after the private step): a value of the batch written there "
                              "reaches the weights unclipped and without noise. Leave them to the private step")

    def check_between(self) -> None:
        """Before a private step, and when training ends: the parameters as the last optimizer step left them
        (``written`` keeps the refusal: the report is then uncertified)."""
        if self.after is not None and self._params() != self.after:
            self.written = ("the model's parameters changed after an optimizer step, before the next private step or "
                            "the end of training (a callback's on_optimizer_step or on_step_end): a value of the batch "
                            "written there is released with the model without noise. Leave the parameters to the "
                            "optimizer")
            raise ConfigError(self.written)

    written: str | None = None


class Deferred(torch.optim.Optimizer):
    """The engine's view of your optimizer where the framework steps it (Hugging Face's ``Trainer``): the engine
    leaves the private update in ``.grad`` and the framework steps your optimizer on it (after its logging and
    callbacks); ``state_dict`` is yours."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # the state is the original's
        self.original = optimizer

    @property
    def param_groups(self) -> list:
        return self.original.param_groups

    @property
    def state(self):
        return self.original.state

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        return self.original.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.original.load_state_dict(state_dict)


def _private_leaf(t: Tensor, chunk: Any, leaves: list) -> Any:
    """An output of the step's forward as the loop gets it: a floating tensor of one row per example of the
    chunk as a traced leaf (kept in ``leaves``: its gradient is what the step trains), other tensors traced as
    values of the rows; a floating tensor of another row count is refused."""
    if t.is_floating_point() and t.dim() > 0 and t.shape[0] == chunk.size:
        leaf, handed = rowtrace.private_leaf(t, chunk)
        leaves.append(leaf)
        return handed
    if t.is_floating_point():
        raise ConfigError(f"the model returned a floating tensor of shape {tuple(t.shape)}, not one row per "
                          f"example of the batch's {chunk.size}: the step trains the loss your loop computes "
                          f"from each example's outputs; return per-example outputs, or pass `criterion=` "
                          f"to train that loss instead")
    return rowtrace.rows_output(t, chunk)


def _settings(optimizer: Any) -> list[dict]:
    """The optimizer's settings: every ``param_groups`` entry as plain values, the parameters by identity (a
    parameter moved into a group of learning rate 0 is a change), any other value a deep copy (a list such as
    Rprop's ``step_sizes`` edited in place is a change)."""
    def plain(v: Any) -> Any:
        if isinstance(v, list) and v and all(isinstance(p, Tensor) for p in v):
            return [id(p) for p in v]
        if isinstance(v, Tensor):
            return v.detach().cpu().tolist()
        try:
            return copy.deepcopy(v)
        except Exception:  # (an object that cannot be copied: by identity, as before)
            return v
    return [{k: plain(v) for k, v in g.items()} for g in optimizer.param_groups]


def _state_print(optimizer: Any) -> dict:
    """The optimizer's state (``optimizer.state``: momentum buffers, Adam's moments and step counts) as a
    fingerprint: per parameter (by identity) and entry, a tensor's object, version counter, storage and layout
    (every in-place write bumps the counter: ``buf.mul_``, ``copy_``, ``fill_``), any other value a deep copy."""
    out, state = {}, getattr(optimizer, "state", None)
    for p, entries in list(state.items() if isinstance(state, Mapping) else ()):
        items = entries.items() if isinstance(entries, Mapping) else [(None, entries)]
        for k, v in list(items):
            out[(id(p), repr(k))] = _value_print(v)
    return out


def _value_print(v: Any) -> Any:
    if isinstance(v, Tensor):
        return guard.fingerprint(v)
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value_print(e) for e in v))
    if isinstance(v, Mapping):
        return (type(v), tuple((repr(k), _value_print(e)) for k, e in v.items()))
    try:
        return (type(v), copy.deepcopy(v))
    except Exception:
        return (type(v), id(v))


class OptimizerWatch:
    """The optimizer's settings (``param_groups``) and state (``optimizer.state``) as the private loader drew the
    pending batch (``drawn``), and its state as the last private step left it (``stepped``: the optimizer's own
    step on the noisy update is the only writer of its state). ``check``, before each step, refuses a step taken
    at other settings or another state: a learning rate, or a momentum buffer or Adam moment, written from a
    value of a batch, between its draw and its step or between steps, reaches the next updates unclipped and
    without noise (a red team moved the released weights by 2.3e4 to 2.4e6 times the bound so, certified)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.step_code = _step_code(optimizer)  # its step as wrapped: a step replaced later runs after the checks
        self.settings: list | None = None  # the settings when the pending batch was drawn
        self.state: dict | None = None  # the state when the pending batch was drawn
        self.after: dict | None = None  # the state when the last step ended (None: none yet, or loaded since)

    def drawn(self) -> None:
        self.settings, self.state = _settings(self.optimizer), _state_print(self.optimizer)

    def stepped(self) -> None:
        self.after = _state_print(self.optimizer)

    def check(self) -> None:
        """Refuse a step at settings or a state other than those of the draw (and of the last step's end)."""
        now = _settings(self.optimizer)
        if self.settings is not None and not _same(now, self.settings):
            changed = sorted({k for a, b in zip(now, self.settings) for k in a if not _same(a.get(k), b.get(k))})
            raise ConfigError(f"the optimizer's {', '.join(changed) or 'param_groups'} changed after the private data "
                              f"loader drew this batch and before its step: a setting chosen after the batch was seen "
                              f"may depend on its values (a learning rate of 0 when the loss spikes releases which "
                              f"batches held an outlier). Set it before the batch is drawn (at the top of the epoch), "
                              f"or with a learning-rate scheduler stepped after optimizer.step()")
        hooks = [h for d in (getattr(self.optimizer, "_optimizer_step_pre_hooks", {}),
                             getattr(self.optimizer, "_optimizer_step_post_hooks", {}),
                             torch_optimizer._global_optimizer_pre_hooks,
                             torch_optimizer._global_optimizer_post_hooks) for h in d.values()
                 if not getattr(h, "_clipbias_own", False)]  # (``ReleasedUpdate``'s are clipbias's)
        if _step_code(self.optimizer) != self.step_code:  # (an instance's or its class's step patched since)
            raise ConfigError("the optimizer's step was replaced after make_private (on the optimizer or its class): "
                              "the new step runs inside optimizer.step(), after its checks, where it may change the "
                              "private update or the weights with values of the batch. Wrap the optimizer you train "
                              "with as it is; patch its step before make_private, if at all")
        if hooks:  # they run inside the step, after this check: a red team set the lr or .grad from the batch there
            raise ConfigError(f"the optimizer has a step hook ({getattr(hooks[0], '__qualname__', hooks[0])}; "
                              f"`register_step_pre_hook`, `register_step_post_hook` or a global optimizer hook): it runs "
                              f"inside optimizer.step(), where it may change the private update, the learning rate or "
                              f"the weights with values of the batch, unclipped and without noise. Remove it; do what it "
                              f"does before the batch is drawn or after optimizer.step() returns")
        state = _state_print(self.optimizer)
        windows = (("after the last private step and before this batch was drawn", self.after, self.state),
                   ("after the private data loader drew this batch and before its step", self.state, state))
        for when, before, later in windows:
            if before is None or later is None or _same(before, later):
                continue
            names = sorted({k for _, k in before.keys() ^ later.keys()} | {k for (i, k), v in later.items()
                                                                             if not _same(before.get((i, k), v), v)})
            raise ConfigError(
                f"the optimizer's state ({', '.join(n.strip(chr(39)) for n in names[:4]) or 'its entries'}) changed "
                f"{when}: only the optimizer's own step on the private update may write it. A momentum buffer or an "
                f"Adam moment written from the batch (or chosen on it) reaches every later update unclipped and "
                f"without noise. Leave optimizer.state to optimizer.step(); to reset it, do so before training, or "
                f"load a saved state with optimizer.load_state_dict. This run's optimizer now holds the written state: "
                f"its later steps are refused until such a state is loaded")


def _step_code(optimizer: Any) -> tuple:
    """Which ``step`` the optimizer runs: its instance's own (a patch; a learning-rate scheduler's counting wrapper,
    which calls the function it wraps, as that function) and its class's, by identity."""
    own = vars(optimizer).get("step")
    while getattr(own, "_wrapped_by_lr_sched", False) and hasattr(own, "__wrapped__") and \
            getattr(getattr(own, "__code__", None), "co_filename", "") == torch.optim.lr_scheduler.__file__:
        own = own.__wrapped__
    cls = type(optimizer).step
    own = getattr(own, "__func__", own)
    return (None if own is cls else own, cls)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # (values whose == is not a truth value: compared by their text)
        return repr(a) == repr(b)


@contextlib.contextmanager
def keyed_rows(engine: DPEngine, pending: Pending, call: tuple) -> Iterator[None]:
    """The loop's forward on the rows of the pending batch's last chunk under the step's keyed randomness
    (``randomness.forward``: the engine's key and step, the chunk's example indices): its dropout masks are the
    ones the step's own forward draws for those examples, per example, and any other draw (or a public
    generator moved) is refused. The gradient the loop leaves in these outputs is what the step trains: drawn
    from torch's global generator by batch position, example i's term would depend on which others were drawn
    (2.7 to 11 times the add/remove bound, certified, before)."""
    start = sum(c.size for c in pending.chunk_rows[:-1])
    ids = pending.indices[start:start + pending.chunk.size]
    try:
        x = _as_batch(call)
    except ConfigError:  # (refused at the step, with the reason)
        x = None
    device = engine.params[0].device
    with forward.keyed(engine.key, engine.steps_taken, device, engine._dropout_layouts, padding_refusal(x)), \
            forward.examples(ids), forward.one_pass():
        yield


class EpsilonLog:
    """Epsilon after the steps taken so far at the run's delta (``Session.epsilon()``, what the adapters log),
    computed once per step count (an accountant call costs ~0.2 s)."""

    def __init__(self, engine: DPEngine) -> None:
        self.engine, self._at = engine, None

    def __call__(self) -> float:
        if self._at is None or self._at[0] != self.engine.steps_taken:
            self._at = (self.engine.steps_taken, self.engine.privacy().epsilon)
        return self._at[1]


def chunk_taken(session: Session) -> Pending | None:
    """A framework's training step took the next chunk of the session's pending batch (Hugging Face's
    accumulation micro-steps, whose chunks the Trainer fetches ahead of them): None before the batch's last
    chunk; at it, the batch, no longer pending, for the step, the optimizer's settings and state checked as drawn
    (``OptimizerWatch``). The caller refuses a step without a pending batch."""
    pending = session.pending
    pending.seen += 1
    if pending.seen < pending.chunks:  # an earlier chunk of the logical batch: the step comes at its last
        return None
    session.pending = None
    session.watch.check()
    return pending


def unstepped(session: Session) -> None:
    """A batch the private loader handed out and no step used, at the time of a report, counts as passed over
    (``PoissonSampler.abandon``), as it does once the loader is closed: a loop that keeps its iterator alive
    (``it = iter(loader); xb = next(it); ... break``) has looked at it, and whether it stopped may depend on
    it. A step that uses it later settles it (not passed over)."""
    pending, sampler = session.pending, getattr(session.engine, "sampler", None)
    if pending is not None and not pending.stepped and sampler is not None and sampler.last is not None:
        sampler.abandon()


def _criterion_gradient(loss_fn: Callable, out: Tensor, y: Any) -> Tensor:
    """The gradient, with respect to ``out``, of the mean over the batch of ``loss_fn``'s per-example losses (the
    engine's convention: ``cross_entropy`` and the loss modules take the batch; any other callable, one example
    at a time)."""
    o, y = out.detach().requires_grad_(), class_indices(y) if loss_fn is cross_entropy else y  # (as the step)
    with torch.enable_grad():
        if loss_fn is cross_entropy or getattr(loss_fn, "batched", False):
            total = loss_fn(o, y).sum()
        else:
            total = sum(loss_fn(o[i:i + 1], batch.take(y, slice(i, i + 1))).sum() for i in range(len(o)))
        return torch.autograd.grad(total / len(o), o, allow_unused=True)[0] if total.requires_grad \
            else torch.zeros_like(o)


def _stacked(parts: list, what: str) -> Any:
    """The K views' ``parts`` (inputs or output gradients, one batch each) as one ``[rows, K, ...]`` batch."""
    try:
        return batch.stack(parts, 1)
    except ClipbiasError as e:
        raise ConfigError(f"the model ran {len(parts)} times on the rows of a chunk (views of each example, summed "
                          f"per example before clipping), but their {what} do not stack: {e}. Call it on views of "
                          f"the same shapes and structure, one row per example each") from None


def _per_example(out: Any, b: int) -> bool:
    """Whether ``out`` is tensors only (in tuples or mappings), each with one row per example."""
    try:
        leaves = batch.leaves(out)
    except ClipbiasError:
        return False
    return bool(leaves) and all(t.dim() > 0 and t.shape[0] == b for t in leaves)


def _tie(out: Any, anchor: Tensor) -> Any:
    """``out`` with every floating tensor ``t`` replaced by ``t + 0 * anchor`` (a graph of one node)."""
    return batch.map_tensors(lambda t: t + anchor.to(t.device, t.dtype) * 0 if t.is_floating_point() else t, out)


def _rows_in(chunk: Any) -> int:
    """The examples in a yielded chunk (its inputs' rows where other entries have none)."""
    try:
        return batch.size(chunk)
    except ClipbiasError:
        return batch.size(split(chunk)[0])


def _as_batch(rec: tuple) -> Any:
    """One recorded call ``(args, kwargs)`` as the engine's input: a tensor, a tuple or a dict."""
    args, kwargs = rec
    if kwargs and args:
        raise ConfigError("the model was called with both positional and keyword tensors; clipbias replays a call "
                          "model(x), model(*xs) or model(**inputs)")
    if kwargs:
        return {k: v for k, v in kwargs.items() if v is not None}
    return args[0] if len(args) == 1 else tuple(args)


def is_mapping(data: Any) -> None:
    """Refuse a collated batch that is not a dict of tensors (Hugging Face's collators)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"the data collator must return a dict of tensors (input_ids, labels, ...), got "
                          f"{type(data).__name__}")
