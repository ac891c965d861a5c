"""Per-example gradients behind one interface.

``RowSource`` is the seam between the sampler and the pipeline: ``iter_rows`` yields a logical
batch's rows micro-batch by micro-batch, with staged state (``commit``/``rollback``) and a
checkpointable ``state_dict``. ``PerExampleRows`` wraps any ``PerSampleGradients`` function; today
that is ``FuncGradients`` (``torch.func``: ``functional_call`` + ``vmap(grad)``); a ghost-norm /
book-keeping fast path (``clipbias.grads.fast``) computes the same sums without rows; under
torch.distributed each rank runs its source on its share of the batch (``clipbias.distributed``). Gradients come back *flattened*, one row per example, in the order of
``ParamLayout``: every later stage (clip, normalise, error feedback) is then plain tensor algebra on
a ``[b, d]`` matrix with the global L2 norm over all trainable parameters.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from ..data import batch
from ..data.batch import Batch
from ..errors import ConfigError, NonFiniteGradientError, PathRefusal, UnsupportedModelError
from ..randomness import PROBE_STEP, SecretKey, forward
from ..step.stage import StepContext
from . import precision
from .path import GradPath, StepBatch, Sums
from .precision import full_float32, last_norms, sq_norms

LossFn = Callable[..., Tensor]
"""``loss_fn(model output, targets) -> loss``: either the sum of the batch's per-example losses (a
scalar, like ``cross_entropy`` below) or the per-example losses themselves (shape ``[b]``, e.g. token
cross-entropy summed per sequence with a padding mask: ``clipbias.data.text.sequence_loss``). The rows
path calls it on one example at a time (a batch of one, inside ``vmap``); the fast path on the whole
batch. The output may be any object the model returns (a Hugging Face ``ModelOutput``); the targets
any ``Batch``."""

_CROSS_EXAMPLE = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


def check_model(model: nn.Module) -> None:
    """Refuse models that mix examples: per-example sensitivity would not hold.

    BatchNorm in train mode (or without running statistics, in any mode) normalises with batch
    statistics, so one example's gradient depends on every other example. A module can also declare ``mixes_examples = True``.
    """
    for name, m in model.named_modules():
        if (isinstance(m, _CROSS_EXAMPLE) and (m.training or not m.track_running_stats)) or \
                getattr(m, "mixes_examples", False):
            raise UnsupportedModelError(
                f"module '{name or type(model).__name__}' ({type(m).__name__}) mixes examples within a "
                f"batch, so per-example gradients and the DP guarantee are undefined. Replace it with "
                f"nn.GroupNorm (e.g. nn.GroupNorm(num_groups, num_channels)) or nn.LayerNorm; clipbias.fix(model) "
                    f"replaces every BatchNorm by a GroupNorm.")


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

    def __call__(self, x: Batch, y: Batch) -> tuple[Tensor, Tensor]: ...


def cross_entropy(out: Tensor, y: Tensor) -> Tensor:
    """Default per-example loss: cross-entropy of one example (a batch of one)."""
    return nn.functional.cross_entropy(out, y, reduction="sum")


def output_gradient(out: Any, g: Any) -> Tensor:
    """The per-example loss whose gradient is that of a loss the caller computed on the outputs: ``<f(x_i), g_i>``
    for each example, ``g`` the gradient of the caller's loss with respect to the model's (floating, per-example)
    outputs, one row per example (``clipbias.integrations.rowtrace`` proves that row ``i`` depends on example
    ``i`` alone). Example ``i``'s gradient of it is ``J_i^T g_i``: its gradient of the caller's loss. One example's
    loss by construction (no probe); the step's targets are ``g``, not the drawn batch (``compares_targets``)."""
    outs = [t for t in batch.leaves(out) if t.is_floating_point()]
    gs = batch.leaves(g)
    if len(outs) != len(gs):
        raise ConfigError(f"the model returned {len(outs)} floating tensors here and {len(gs)} in the training loop's "
                          f"forward: call it the same way")
    return sum((o * h.to(o.dtype)).reshape(o.shape[0], -1).sum(1) for o, h in zip(outs, gs))


output_gradient.per_example = True  # a sum of per-row terms: each example's loss is its own (no probe)
output_gradient.compares_targets = False  # its "targets" are output gradients (``engine.accounting.origin``)


class FuncGradients:
    """``torch.func`` backend: ``vmap(grad(loss of one example))`` over the batch, at the model's
    current parameters or at any given ones (inner momentum evaluates past iterates).

    Inputs and targets may be any ``clipbias.data.batch.Batch`` (tensors, tuples, dicts: ``model(**x)``
    for a dict). Only trainable parameters get per-example gradients: frozen ones
    (``requires_grad=False``: a frozen base under LoRA adapters) and buffers are passed as constants,
    so their gradients are never computed. Randomness
    inside the model (dropout) is drawn independently per example: in the engine's private step from
    the run's key and the example's index (``clipbias.randomness.forward``; ``at``: the example's
    position in the micro-batch, which the masks of the batch are looked up by), elsewhere from torch. ``grouped=True``: each "example"
    is a group ``x_i`` of shape ``[p, *input]`` run through the model together (BatchNorm sees the
    group) and the loss is that of the group's first row (BatchClipping); ``check=False`` then lets
    the cross-example BatchNorm through. ``views=True``: each example ``x_i`` is ``[K, *input]``, K
    forwards of the same example (augmented views), run through the model as a batch of K, with
    targets ``y_i`` of ``[K, *target]``; its loss is the sum of the K rows' losses, so its gradient is
    the sum of the views' gradients, clipped as one example's (``DPEngine.step(..., views=True)``).
    Dropout is refused in such a step (``VIEWS_DROPOUT``). Otherwise the model is checked at every call, so a
    BatchNorm switched to train mode after construction is refused too.

    A model that ``vmap`` cannot run (a forward that branches on tensor values, such as Hugging Face's
    attention-mask code testing ``attention_mask.all()``, or an operator without a batching rule) has
    its examples run one at a time instead, each a batch of one under ``torch.func.grad``: the same
    function of each example alone, b forwards and backwards in a loop (``vectorized`` turns False at
    the first such batch, with a warning). ``unvectorizable="refuse"`` raises ``PathRefusal`` instead
    (``grad_path="auto"`` then tries the fast path).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn = cross_entropy, *, grouped: bool = False,
                 check: bool = True, views: bool = False) -> None:
        if check:
            check_model(model)
        self.model, self.loss_fn, self.grouped, self.check, self.views = model, loss_fn, grouped, check, views
        self.layout = ParamLayout.of(model)

        def loss_one(params: dict[str, Tensor], consts: dict[str, Tensor], x: Batch, y: Batch, at: Tensor) -> Tensor:
            # in the engine's private step: dropout keyed by this example's index, and its autocast (if any)
            with forward.one_pass(at), precision.forward_autocast(norms32=True):
                out = functional_call(self.model, (params, consts),
                                      *batch.arguments(x if grouped or views else batch.unsqueeze(x)))
                # the loss of one example (a sum over a batch of one, or a [1] vector of per-example losses;
                # with views, over its K views)
                loss = self.loss_fn(out[:1] if grouped else out, y if views else batch.unsqueeze(y)).sum()
            return _scaled(loss)

        self._one = grad_and_value(loss_one)
        self._fn = vmap(self._one, in_dims=(None, None, 0, 0, 0), randomness="different")

        def loss_and_output(params, consts, x, y, at):
            with forward.one_pass(at), precision.forward_autocast(norms32=True):
                out = functional_call(self.model, (params, consts), *batch.arguments(batch.unsqueeze(x)))
                loss = self.loss_fn(out, batch.unsqueeze(y)).sum()
            return _scaled(loss), batch.tree_map(lambda t: t.detach()[0], out)

        self._one_out = grad_and_value(loss_and_output, has_aux=True)
        self._fn_out = vmap(self._one_out, in_dims=(None, None, 0, 0, 0), randomness="different")
        self.keep_output, self.last_out = False, None  # the step's own outputs (clipbias.PrivacyEngine)
        self.vectorized, self.unvectorizable = True, "loop"  # see the class docstring

    def params(self) -> dict[str, Tensor]:
        trainable = set(self.layout.names)
        return {n: p.detach() for n, p in self.model.named_parameters() if n in trainable}

    def consts(self) -> dict[str, Tensor]:
        trainable = set(self.layout.names)
        c = {n: p.detach() for n, p in self.model.named_parameters() if n not in trainable}
        c.update(dict(self.model.named_buffers()))
        return c

    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, x: Batch, y: Batch, params: dict[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        b = batch.size(x)
        if b == 0:
            return torch.zeros(0, self.layout.dim, device=self.device()), torch.zeros(0, device=self.device())
        grads, losses = self.per_param(x, y, params)
        return torch.cat([g.reshape(b, -1) for g in grads], dim=1), losses

    def per_param(self, x: Batch, y: Batch, params: dict[str, Tensor] | None = None) -> tuple[list[Tensor], Tensor]:
        """(per-example gradients ``[b, *shape]`` per parameter in layout order, losses): the rows
        before they are concatenated into ``[b, d]``. Under autocast each example's gradient comes back
        in its parameter's dtype (float32: autograd's cast back from the 16-bit copy), a function of that
        example alone; a loss scale (a power of two) is divided out."""
        grads, losses = self._per_param(x, y, params)
        s = precision.loss_scale()
        return (grads, losses) if s == 1.0 else ([g / s for g in grads], losses / s)

    def _per_param(self, x: Batch, y: Batch, params: dict[str, Tensor] | None) -> tuple[list[Tensor], Tensor]:
        if self.check:
            check_model(self.model)
        if self.views:  # (a keyed mask would be drawn for the K views as one input: refused, VIEWS_DROPOUT)
            with forward.refusing(VIEWS_DROPOUT):
                return self._per_param_of(x, y, params, False)
        return self._per_param_of(x, y, params, self.keep_output and not self.grouped)

    def _per_param_of(self, x: Batch, y: Batch, params: dict[str, Tensor] | None,
                      out: bool) -> tuple[list[Tensor], Tensor]:
        """``_per_param``; ``out``: the outputs too, from the same forward (one example each)."""
        at = torch.arange(batch.size(x), device=self.device())
        p = params if params is not None else self.params()
        if self.vectorized:
            try:
                if out:
                    grads, (losses, self.last_out) = self._fn_out(p, self.consts(), x, y, at)
                else:
                    grads, losses = self._fn(p, self.consts(), x, y, at)
                return [grads[n] for n in self.layout.names], losses.detach()
            except RuntimeError as e:
                vmap_said = unvectorizable(e)
                if not vmap_said and self.unvectorizable == "refuse":
                    raise
                why = ("torch.func.vmap cannot run the model's forward: it branches on tensor values (data-dependent "
                       "control flow or .item(), as in Hugging Face's attention-mask code)"
                       if "data-dependent control flow" in str(e) else
                       f"torch.func.vmap cannot run the model's forward ({str(e)[:120]})")
                if self.unvectorizable == "refuse":
                    raise PathRefusal("rows", why) from e
                if not vmap_said:  # an error under vmap that one example alone does not raise is vmap's (nn.GRU,
                    try:           # nn.RNN: a shape error in their batched rule); else it is the model's: raised
                        result = self._looped(p, x, y, out)
                    except Exception:
                        raise e from None
                self.vectorized = False
                warnings.warn(f"{why}: its per-example gradients are computed one example at a time (the same "
                              f"values, b forwards and backwards in a loop); grad_path='fast' computes them in one "
                              f"batched pass where it applies", stacklevel=3)
                if not vmap_said:
                    return result
        return self._looped(p, x, y, out)

    def _looped(self, p: dict[str, Tensor], x: Batch, y: Batch, out: bool) -> tuple[list[Tensor], Tensor]:
        """``per_param`` one example at a time: example r is a batch of one under ``torch.func.grad``
        (its dropout masks keyed by its own index, at position 0 of a batch of itself)."""
        consts, rows, losses, outs = self.consts(), [], [], []
        at = torch.zeros((), dtype=torch.long, device=self.device())
        for r in range(batch.size(x)):
            xr, yr = batch.take(x, r), batch.take(y, r)
            with forward.only(r):
                if out:
                    g, (loss, o) = self._one_out(p, consts, xr, yr, at)
                    outs.append(batch.unsqueeze(o))
                else:
                    g, loss = self._one(p, consts, xr, yr, at)
            rows.append(g)
            losses.append(loss.detach())
        if out:
            self.last_out = batch.cat(outs)
        return [torch.stack([g[n] for g in rows]) for n in self.layout.names], torch.stack(losses)


VIEWS_DROPOUT = ("the model draws dropout masks in a step where the model ran several times on each example (views, "
                 "summed per example before clipping): clipbias keys each example's masks by its index and would lay "
                 "the K views out as one input, whose shape differs from a single forward's; switch dropout off for "
                 "such a loop (model.eval() on the dropout modules, or p = 0), or call the model once per example")


def _scaled(loss: Tensor) -> Tensor:
    """One example's loss for its gradient: widened from 16 bits (autocast), times the step's loss scale."""
    s = precision.loss_scale()
    loss = precision.exact32(loss)
    return loss if s == 1.0 else loss * s


class RowsPath(GradPath):
    """The rows path through the pipeline (``grads.path.GradPath``): the row source's rows, micro-batch by
    micro-batch, each row's norm checked finite, through the pipeline's per-example stages (stages that need
    rows, a given gradient backend, an algorithm's own rows)."""

    kind = "rows"

    def sums(self, step: StepBatch) -> Iterator[Sums]:
        for g, loss, idx in step.rows.iter_rows(step.x, step.y, step.indices, step.step, step.max_physical_batch):
            norms = check_finite(g, idx)
            r, p = step.pipeline.rows(g, StepContext(idx, step.step, norms))
            yield r, p, loss


def micro_batch_sums(path: GradPath, step: StepBatch) -> Iterator[Sums]:
    """The sums of a norm-scaling aggregate (``ParamSums``, ``grads.fast.BookKeeping``, ``grads.two_point.TwoPoint``:
    called ``(x, y, scale, reference) -> (processed sum, reference sum or None, losses, norms)``), physical
    micro-batch by micro-batch, under the examples' keyed forward; each norm checked finite; with
    ``step.outputs`` a list, each micro-batch's outputs appended to it (``path.output_source()``)."""
    scale = step.pipeline.per_sample[0].scale
    need_ref = step.pipeline.error_feedback is not None
    source = path.output_source()
    if source is not None:
        source.keep_output = step.outputs is not None
    call = path if step.via is None else step.via
    x, y, indices, size = step.x, step.y, step.indices, step.max_physical_batch
    try:
        for start in range(0, batch.size(x), size):
            sl = slice(start, start + size)
            with forward.examples(indices[sl] if indices is not None else None):
                p, r, loss, norms = guarded(lambda xs, ys: call(xs, ys, scale, need_ref),
                                            batch.take(x, sl), batch.take(y, sl), step.rows.layout.dim)
            check_finite_norms(norms, indices[sl] if indices is not None else None)
            if step.outputs is not None and len(loss):
                step.outputs.append(source.last_out)
            yield r, p, loss
    finally:
        if source is not None:
            source.keep_output, source.last_out = False, None


class ParamSums(GradPath):
    """The rows path for a norm-scaling stage (clip, normalise) without the ``[b, d]`` matrix copy:
    per-example gradients by ``FuncGradients``, kept per parameter; norms, the weighted sum
    ``sum_i s_i g_i`` and the reference sum per parameter. Same numbers as concatenating first (up
    to float summation order); the concatenation was ~10 % of a cnn step. Called like
    ``fastclip.BookKeeping``: ``(x, y, scale, reference) -> (processed sum, reference sum or None,
    losses, norms)``; a ``grads.path.GradPath`` of kind ``"sums"``."""

    kind = "sums"

    def __init__(self, grads: FuncGradients) -> None:
        self.grads, self.layout = grads, grads.layout

    def sums(self, step: StepBatch) -> Iterator[Sums]:
        return micro_batch_sums(self, step)

    def func_grads(self, rows) -> FuncGradients:
        return self.grads

    def output_source(self) -> FuncGradients:
        return self.grads

    def __call__(self, x: Batch, y: Batch, scale: Callable[[Tensor], Tensor],
                 reference: bool, at: tuple[Callable, float] | None = None) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        b = batch.size(x)
        if b == 0:
            dev = self.grads.device()
            z = torch.zeros(self.layout.dim, device=dev)
            return z, (z.clone() if reference else None), torch.zeros(0, device=dev), torch.zeros(0, device=dev)
        if at is not None:
            return self._two_points(x, y, scale, reference, *at)
        grads, losses = guarded(self.grads.per_param, x, y, self.layout.dim)
        flat = [g.reshape(b, -1) for g in grads]
        norms = torch.stack([sq_norms(f) for f in flat]).sum(0).sqrt()  # upper bounds (precision.py)
        s = scale(norms).to(flat[0].dtype)
        with full_float32():  # TF32 would round the rows before their factors (grads/precision.py)
            if not reference:
                return torch.cat([s @ f for f in flat]), None, losses, norms
            both = [torch.stack([s, torch.ones_like(s)]) @ f for f in flat]  # one pass over the rows for both sums
        return torch.cat([t[0] for t in both]), torch.cat([t[1] for t in both]), losses, norms

    def _two_points(self, x: Batch, y: Batch, scale: Callable[[Tensor], Tensor], reference: bool,
                    enter: Callable, c: float) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """DiSK's rows ``r_i = c f_i + (1 - c) n_i`` (``f`` at the point ``enter()`` sets, ``n`` at x_t) without
        the ``[b, d]`` matrix: ``||r_i||`` from each parameter's ``[b, numel]`` piece of the combination, formed
        one parameter at a time (the expansion ``c^2 ||f_i||^2 + (1 - c)^2 ||n_i||^2 + 2 c (1 - c) <f_i, n_i>``
        cancels: for c > 1 it is a difference of terms c^2 times the result, which float32 rounding turns
        into a norm far below the row's, and a clipped row above C), and ``sum_i s_i r_i`` from the same pieces."""
        b = batch.size(x)
        with enter():
            far, losses = guarded(self.grads.per_param, x, y, self.layout.dim)
        far = [g.reshape(b, -1) for g in far]
        if c == 1.0:
            near = far
            sq = sum(sq_norms(f) for f in far)
        else:
            near, losses = guarded(self.grads.per_param, x, y, self.layout.dim)
            near = [g.reshape(b, -1) for g in near]
            sq = sum(sq_norms(torch.add(c * f, n, alpha=1 - c)) for f, n in zip(far, near))
        norms = sq.sqrt()
        s = scale(norms).to(far[0].dtype)
        S = torch.stack([s, torch.ones_like(s)]) if reference else s.unsqueeze(0)
        # the sums of the very pieces whose norms were taken (c (S f) + (1 - c) (S n) would round apart from
        # them by about c eps ||f_i||, not bounded by the clip when c is large)
        with full_float32():
            sums = [S @ (f if c == 1.0 else torch.add(c * f, n, alpha=1 - c)) for f, n in zip(far, near)]
        return (torch.cat([t[0] for t in sums]), torch.cat([t[1] for t in sums]) if reference else None,
                losses, norms)


Rows = tuple[Tensor, Tensor, "Tensor | None"]  # (rows [r, d], per-example losses, example ids or None)


class RowSource(abc.ABC):
    """Where one logical step's rows come from: the seam between sampling and the pipeline.

    ``iter_rows`` walks a logical batch in physical micro-batches and yields ``(rows, losses, ids)``;
    a row is usually one example's gradient, but may be a group mean (p-averaging), an average over
    augmentations or an inner momentum. A source that keeps state across steps stages it during
    ``iter_rows`` and applies it in ``commit()`` (after the whole step succeeded) or drops it in
    ``rollback()`` (a later micro-batch failed); ``state_dict`` is part of the engine's private
    checkpoint. ``key`` (a ``clipbias.randomness.SecretKey``) keys the source's secret per-example
    draws; the engine sets it to the run's key and restores it on resume. ``probe`` computes the rows of a
    probe batch without changing any state (diagnostics).
    """

    layout: ParamLayout
    key: SecretKey | None = None
    # why this source cannot be split over the ranks of a process group (None: its rows are per
    # example, so each rank computes the rows of its share and the sums add up; clipbias.distributed)
    distributed_refusal: str | None = None

    # whether ``iter_rows`` takes any ``clipbias.data.batch.Batch`` (tuples, dicts) or only tensors
    structured: bool = True

    @abc.abstractmethod
    def iter_rows(self, x: Batch, y: Batch, indices: Tensor | None, step: int,
                  max_physical_batch: int) -> Iterator[Rows]:
        """The rows of the logical batch ``(x, y)`` (example ids ``indices``) at ``step``."""

    def owners(self, indices: Tensor, step: int, world: int) -> Tensor:
        """The rank that processes each sampled example at ``step`` in a process group of ``world``
        ranks (``clipbias.distributed``): ``index % world`` by default, so an example's per-example
        state stays on one rank. A source whose rows combine several examples owns them together."""
        return indices % world

    def probe(self, x: Tensor, y: Tensor, max_physical_batch: int = 512) -> Tensor:
        """The rows this source would produce for ``(x, y)``, with probe randomness; pure."""
        parts = [g for g, _, _ in self.iter_rows(x, y, None, PROBE_STEP, max_physical_batch)]
        self.rollback()
        return torch.cat(parts) if parts else torch.zeros(0, self.layout.dim)

    def commit(self) -> None:
        """Apply the state staged by the last ``iter_rows`` (the step succeeded)."""

    def rollback(self) -> None:
        """Drop the state staged by the last ``iter_rows`` (the step failed)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class PerExampleRows(RowSource):
    """One row per example: the per-example gradients of ``grads``, micro-batched."""

    def __init__(self, grads: PerSampleGradients) -> None:
        self.grads, self.layout = grads, grads.layout

    def iter_rows(self, x: Batch, y: Batch, indices: Tensor | None, step: int,
                  max_physical_batch: int) -> Iterator[Rows]:
        for start in range(0, batch.size(x), max_physical_batch):
            sl = slice(start, start + max_physical_batch)
            with forward.examples(indices[sl] if indices is not None else None):
                g, loss = guarded(self.grads, batch.take(x, sl), batch.take(y, sl), self.layout.dim)
            yield g, loss, (indices[sl] if indices is not None else None)


def unvectorizable(e: BaseException) -> bool:
    """Whether ``e`` is ``torch.func.vmap`` refusing to run a function (data-dependent control flow,
    ``.item()``, an operator without a batching rule), not an error of the function itself."""
    msg = str(e)
    return isinstance(e, RuntimeError) and (msg.startswith("vmap") or "Batching rule not implemented" in msg)


def guarded(fn: Callable, x: Batch, y: Batch, dim: int):
    """``fn(x, y)`` with torch's errors on bad shapes, labels or memory turned into a
    ``ConfigError`` that says what to change."""
    try:
        return fn(x, y)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, IndexError) as e:  # shapes or labels the model/loss cannot take
        if "allocate memory" in str(e) or "out of memory" in str(e):
            raise ConfigError(
                f"out of memory computing {batch.size(x)} per-example gradients of {dim} parameters "
                f"({batch.size(x) * dim * 4 / 2**30:.1f} GB as float32): lower `max_physical_batch` (the math does "
                f"not change), or use `grad_path='fast'` (no per-example gradient matrix) where it applies") from e
        labels = (f"{int(y.min())}..{int(y.max())}" if isinstance(y, Tensor) and len(y) and y.dim() == 1
                  and not y.is_floating_point() else batch.describe(y))
        raise ConfigError(
            f"computing per-example gradients failed ({type(e).__name__}: {e}). Check that the inputs have the "
            f"shape and dtype the model expects (one example given: {batch.describe(x)}) and that the labels "
            f"are class indices the model can output (given: {labels}), or targets your loss_fn takes") from e


def as_row_source(grads: "RowSource | PerSampleGradients") -> RowSource:
    """A ``RowSource`` as is; a per-example gradient function (``PerSampleGradients``) wrapped."""
    return grads if isinstance(grads, RowSource) else PerExampleRows(grads)


def check_finite(g: Tensor, indices: Tensor | None = None) -> Tensor:
    """Raise ``NonFiniteGradientError`` naming the offending examples; callers do it before any update.
    Returns the row norms (the pipeline's clip reuses them)."""
    # a row holds NaN/Inf iff its norm does (one reduction, no [b, d] boolean matrix): NaN and +-Inf
    # propagate through the sum of squares; finite rows with a block of 256 whose squares overflow
    # float32 are refused too (grads/precision.py)
    return check_finite_norms(last_norms(g), indices)


def check_finite_norms(norms: Tensor, indices: Tensor | None = None) -> Tensor:
    """``check_finite`` given the row norms (the fast path has norms and no rows)."""
    bad = ~torch.isfinite(norms)
    if bad.any():
        rows = bad.nonzero().flatten()
        ids = (indices[rows] if indices is not None else rows).tolist()[:10]
        raise NonFiniteGradientError(
            f"non-finite (NaN/Inf, or a norm beyond the float range) per-example gradient for example(s) {ids}"
            f"{' ...' if int(bad.sum()) > 10 else ''}; nothing was updated. Check the input data for "
            f"NaN/Inf, lower the learning rate, or use a numerically stable loss.")
    return norms
