"""Which gradient path (``grads.path.GradPath``) computes a step's sums: the book-keeping fast path (no rows), the
rows summed per parameter, or the rows through the pipeline (stages that need rows); ``grad_path="rows" | "fast" |
"auto"`` (a fully_shard model's: ``engine_aggregate``; auto's fall-back: a ``grads.path.FallBack``,
``with_fall_back``); and the step's sums through it (``step_sums``: the path's ``sums``), under the keyed
forward, the gathered model and autocast, with ``grad_path="auto"``'s fall-back to the other path at the first
step (``attempt_sums``, ``fall_back``). The engine asks the path, never its class."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import torch
from torch import Tensor, nn

from ..data import batch
from ..data.batch import Batch
from .. import distributed
from ..errors import ClipbiasError, ConfigError, PathRefusal
from ..grads import fast, precision, separable
from ..grads.fast import BookKeeping, why_unsupported
from ..grads.path import FallBack, GradPath, StepBatch, refusal_name
from ..grads.rows import FuncGradients, LossFn, ParamSums, PerExampleRows, RowSource, RowsPath, cross_entropy
from ..randomness import forward
from ..step import Pipeline, scales_by_norm
from ..grads.two_point import TwoPoint, TwoPointRows
from ..sampling import refetch
from .checks import padding_refusal
from .plan import PathChoice

AUTO_ROWS_BYTES = 2**30
"""``grad_path="auto"`` takes the fast path when one micro-batch of float32 rows would exceed this. Measured on
2 Intel AVX-512 cores (benchmarks/opacus_side_by_side.py, benchmarks/speed.py): a ResNet-18 at B = 32 (1.4 GB
of rows) took 1.74 s a step on the rows path and 0.73 s on the fast path (ghost norms on its wide layers);
resnet20-gn at B = 512 (0.55 GB) 1.29 s and 1.32 s."""


def choose_aggregate(grad_path: str, own_rows: bool, model: nn.Module, loss_fn: LossFn, algo, pipeline: Pipeline,
                     rows: RowSource, max_physical_batch: int, expected_batch_size: float, per_example: bool = False):
    """(the ``GradPath``, the ``PathChoice``: which path and why): the book-keeping fast path
    (``grads.fast.BookKeeping``: no rows), the rows summed per parameter (``grads.ParamSums``),
    or the rows through the pipeline (``grads.rows.RowsPath``: stages that need rows). ``grad_path`` rows | fast | auto:
    auto takes the fast path where it applies and either one micro-batch of rows would exceed
    ``AUTO_ROWS_BYTES`` or ``fast_wins``; elsewhere the rows path (the faster of the two for
    convolutional models on the CPU where the fast path would take the ghost norm: docs/results.md)."""
    if grad_path not in ("rows", "fast", "auto"):
        raise ConfigError(f"`grad_path` must be rows, fast or auto, got {grad_path!r}")
    p = pipeline
    two = isinstance(rows, TwoPointRows) and isinstance(rows.base, PerExampleRows) and \
        isinstance(rows.base.grads, FuncGradients)  # DiSK on per-example gradients: both points, then as usual
    if two:
        agg, choice = choose_aggregate(grad_path, own_rows, model, loss_fn, algo, pipeline, rows.base,
                                       max_physical_batch, expected_batch_size, per_example=True)
        if agg.kind == "rows":
            return agg, choice
        if agg.kind == "fast" and agg.book_keeping().ties:  # no bound on the tied uses' cross terms between the points
            why = "DiSK's two points with tied weights (an Embedding sharing its weight with a Linear)"
            if grad_path == "fast":
                raise ConfigError(f"`grad_path='fast'` is not available: {why}; use `grad_path='auto'` or "
                                  f"`grad_path='rows'`")
            agg, choice = ParamSums(rows.base.grads), PathChoice("sums", grad_path, why_not_fast=why)
        return TwoPoint(agg, rows), dataclasses.replace(choice, two_point=True)
    why = ("a gradient backend was given" if not own_rows else
           f"--algo {algo.name} computes its own rows" if algo.source is not None and not per_example else
           "--grad-bound clips the rows first" if p.reference else
           f"--algo {algo.name} transforms rows beyond a norm scaling" if len(p.per_sample) != 1
           or not scales_by_norm(p.per_sample[0]) else None)
    if why is None:  # a norm-scaling step: the fast path if the model allows it, else summed rows
        why = why_unsupported(model)
        rows_bytes = min(max_physical_batch, math.ceil(1.2 * expected_batch_size)) * \
            rows.layout.dim * 4
        if why is None and (grad_path == "fast" or grad_path == "auto" and (rows_bytes > AUTO_ROWS_BYTES
                                                                           or fast_wins(model, loss_fn, rows_bytes))):
            return BookKeeping(model, loss_fn), PathChoice(
                "fast", grad_path, checked="structure" if separable.why_not(model) is None else "runtime")
        if grad_path != "fast" and isinstance(rows, PerExampleRows) and \
                isinstance(rows.grads, FuncGradients):
            return ParamSums(rows.grads), PathChoice("sums", grad_path,
                                                     why_not_fast=why if grad_path == "auto" and why else None)
    if grad_path == "fast":
        err = ConfigError(f"`grad_path='fast'` is not available: {why}; use `grad_path='auto'` or `grad_path='rows'`")
        err.why = why  # the reason alone (a model sharded with fully_shard has no other path to suggest)
        raise err
    return RowsPath(), PathChoice("rows", grad_path, why_not_fast=why if grad_path == "auto" and why else None)


def other_path(grad_path: str, own_rows: bool, model: nn.Module, loss_fn: LossFn, algo, pipeline: Pipeline,
               rows: RowSource, max_physical_batch: int, expected_batch_size: float, chosen):
    """Under ``grad_path="auto"``, the path not ``chosen`` as ``choose_aggregate`` builds it, ``(GradPath,
    PathChoice)``, or None where it does not apply: the rows path (per-parameter rows) for the fast path,
    the fast path for a norm-scaling step on the rows path whose model it takes."""
    if grad_path != "auto":
        return None
    if chosen.kind == "fast":
        other = "rows"
    elif chosen.kind == "sums" and why_unsupported(model) is None:
        other = "fast"
    else:
        return None
    try:
        return choose_aggregate(other, own_rows, model, loss_fn, algo, pipeline, rows, max_physical_batch,
                                expected_batch_size)
    except (ConfigError, ValueError):
        return None


def fast_wins(model: nn.Module, loss_fn: LossFn = cross_entropy, rows_bytes: float = math.inf) -> bool:
    """Whether ``auto`` takes the fast path: the model is per-example by construction
    (``grads.separable``: no probe), and either its trainable layers are Linear, Embedding and norm
    layers, whose per-layer norms and sums cost about a non-private step (measured 1.7-25x faster than
    the rows path: MLP, ScatterNet + linear), or it has convolutions and runs on CUDA, or on the CPU
    while a micro-batch's rows (``rows_bytes``) fit ``FORMED_BYTES``. Measured (docs/results.md): on
    the CPU, with every convolution's per-example gradients formed, the fast path was 1.1-1.3x faster
    than the rows path (cnn B = 128-2048, resnet20-gn B = 32-256, scatter-cnn B = 512-2048) and slower
    once layers go to the ghost norm; on an H200 it was faster at every batch measured, ghost norm
    included (cnn B = 256 and 1024, resnet20-gn B = 64 and 256: 1.1-1.4x)."""
    if loss_fn is not cross_entropy and not getattr(loss_fn, "per_example", False) or \
            separable.why_not(model) is not None:
        return False
    conv = any(isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and any(p.requires_grad for p in m.parameters(recurse=False))
               for m in model.modules())
    device = {p.device.type for p in model.parameters()}
    return not conv or device == {"cuda"} or device == {"cpu"} and rows_bytes <= fast.FORMED_BYTES


def step_sums(engine, x: Batch, y: Batch, indices: Tensor | None):
    """(reference sum, processed sum, losses) of ``engine``'s step per physical micro-batch, through its gradient
    path (``GradPath.sums``); the finiteness of every example's gradient is checked on its norm either way. With
    ``engine._outputs`` a list, the batch's outputs are appended to it."""
    return engine.path.sums(StepBatch(x, y, indices, engine.steps_taken, engine.max_physical_batch, engine.rows,
                                      engine.pipeline, engine._outputs, getattr(engine, "_sharded", None)))


def output_source(engine):
    """What computes ``engine``'s forward where it can keep its output: the fast path, or the per-example
    gradients under the per-parameter rows (``ParamSums``); None elsewhere."""
    path = getattr(engine, "path", None)
    return path.output_source() if path is not None else None


def engine_aggregate(engine, grad_path: str, own_rows: bool, model: nn.Module, loss_fn: LossFn,
                     max_physical_batch: int):
    """``choose_aggregate``'s (GradPath, PathChoice) for ``engine``; a model sharded with fully_shard takes the fast
    path (``auto`` means ``fast``) or is refused (``distributed.refuse_sharded_path``)."""
    if not engine.sharded:
        return choose_aggregate(grad_path, own_rows, model, loss_fn, engine.algo, engine.pipeline, engine.rows,
                                max_physical_batch, engine.expected_batch_size)
    if grad_path == "rows":
        distributed.refuse_sharded_path("`grad_path='rows'` was asked for")
    try:
        agg, choice = choose_aggregate("fast" if grad_path == "auto" else grad_path, own_rows, model, loss_fn,
                                     engine.algo, engine.pipeline, engine.rows, max_physical_batch,
                                     engine.expected_batch_size)
    except ConfigError as e:
        if not hasattr(e, "why"):
            raise
        distributed.refuse_sharded_path(e.why)
    if agg.kind != "fast" or agg.two_point:
        distributed.refuse_sharded_path(f"{engine.algo.name} evaluates gradients at points other than the "
                                        f"current parameters")
    # --- fully_shard: sums, noise and update sharded where the release is coordinate-wise (engine/sharded.py)
    from . import sharded
    agg: BookKeeping = agg.book_keeping()
    why = sharded.applies(engine, agg)
    if why is None:
        engine._sharded = sharded.ShardedSums(engine, agg)
        if engine.pipeline.noise is not None:
            engine.pipeline.noise.prefetch = False  # each rank draws its own coordinates' normals (ShardedSums.finish)
        return agg, dataclasses.replace(choice, sharded=(
            "the parameters gathered whole for the sums, which are all-reduced layer by layer into each rank's "
            "slice; each rank adds its coordinates' noise and updates its shards"))
    # ---
    return agg, dataclasses.replace(choice, sharded=f"the parameters gathered whole for the step, the update "
                                                    f"applied per shard (sums and update whole on every rank: {why})")


def attempt_sums(engine, x: Batch, y: Batch, indices: Tensor | None, keep_outputs: bool, views: bool = False) -> tuple:
    """``engine``'s step's (processed sum, reference sum or None, per-example losses, failure or None) on this
    rank, under the keyed forward (and a fully_shard model gathered whole); computed once more on the
    other path where ``grad_path="auto"`` takes it (``fall_back``). A forward that wrote the model's state
    fails the step (``engine.guard``: the buffers restored, the refusal names what was written), unless the step
    failed already (its own error stands)."""
    fetched = getattr(engine.sampler, "fetched", None)  # the model as it was when the loader yielded this batch
    since = fetched[2] if fetched is not None and indices is not None and \
        torch.equal(fetched[0], indices.detach().cpu()) else None
    with engine.state_guard.watching(intercept=False, since=since) as watch:  # the keyed forward reports aliases
        sums = _attempt_sums(engine, x, y, indices, keep_outputs, watch.listen)
    if sums[3] is None and watch.error is None:  # the padding the loader's check took to be ignored, held
        refetch.probe(engine, engine.model, batch.tree_map(lambda t: t[:, 0], x) if views else x, indices,
                      engine.state_guard.run)  # (views: the first view of each example)
    return sums if watch.error is None or sums[3] is not None else (*sums[:3], watch.error)


def _attempt_sums(engine, x: Batch, y: Batch, indices: Tensor | None, keep_outputs: bool, listen: tuple) -> tuple:
    d = engine.rows.layout.dim
    dev, dt = engine.params[0].device, engine.params[0].dtype  # a float64 model sums in float64
    while True:  # once more only where grad_path="auto" takes its other path (fall_back)
        ref_sum = torch.zeros(d, device=dev, dtype=dt) if engine.pipeline.error_feedback is not None else None
        proc_sum = torch.zeros(d, device=dev, dtype=dt) if getattr(engine, "_sharded", None) is None \
            else engine._sharded.zeros(dt, dev)  # (fully_shard: this rank's slice, engine/sharded.py)
        losses, failure = [], None
        # vmap refusing the model: auto's other path, while it has one (else one example at a time)
        set_unvectorizable(engine, "refuse" if engine.path.may_fall_back else "loop")
        try:
            # dropout masks from the key, per example index; a fully_shard model gathered whole for the sums;
            # under autocast=, the model's forwards in 16 bits
            with forward.keyed(engine.key, engine.steps_taken, dev, engine._dropout_layouts, padding_refusal(x),
                               listen), \
                    _gathered(engine, x), \
                    precision.mixed(_mixed(engine, dev)):
                for r, p, loss in step_sums(engine, x, y, indices):
                    if ref_sum is not None:
                        ref_sum += r
                    proc_sum += p
                    losses.append(loss)
        except ClipbiasError as err:  # a micro-batch failed (NaN, bad shape, a public random draw)
            failure = err
        except BaseException:  # out of memory, an interrupt: nothing staged may reach the next step
            set_unvectorizable(engine, "loop")
            drop_staged(engine)  # (adaptive clipping's count would hold these examples twice)
            raise
        if not (isinstance(failure, PathRefusal) and fall_back(engine, failure)):
            break
        engine._outputs = [] if keep_outputs else None
    set_unvectorizable(engine, "loop")
    return proc_sum, ref_sum, losses, failure


def fall_back(engine, err: PathRefusal) -> bool:
    """``grad_path="auto"``, before its first step that ran the model completed: the path it chose
    refused the model (``err``, a structural refusal raised while the step's sums were computed: nothing
    released, no noise drawn, the sampler's batch still in hand). Drop what the attempt staged, take the
    other path (kept for the rest of the run) and say so; the caller computes the step again on the same
    batch (the same dropout masks: functions of the key, the step and the indices). False where there
    is no other path (then the refusal stands)."""
    before = path_name(engine)
    choice = engine.path.fall_back(err.path)  # auto's FallBack takes its other path; any other path: None
    if choice is None:
        return False
    engine.rows.rollback()  # not drop_staged: the batch stays this step's (with bands too)
    engine.pipeline.rollback()
    reason, now = str(err).split(". ")[0], path_name(engine)
    engine.grad_path_fallback = (f"{engine.grad_path_fallback}; then " if engine.grad_path_fallback else "") + \
        f"{before} -> {now}: {reason}"
    engine.plan = engine.plan.with_path(dataclasses.replace(
        choice, fallback=f"{before} path refused the model ({reason})", sum_precision=engine.sum_precision))
    warnings.warn(f"grad_path='auto': the {before} path refused the model at the first step ({reason}); "
                  f"nothing had changed, and the step runs on the {now} path, which the run "
                  f"keeps (engine.grad_path_fallback). Pass grad_path='{now}' to choose it "
                  f"yourself", stacklevel=3)
    return True


def path_name(engine) -> str:
    """``"fast"`` or ``"rows"``: the path ``engine``'s step's sums take."""
    return refusal_name(engine.path)


def set_unvectorizable(engine, what: str) -> None:
    """What the rows path's ``FuncGradients`` does with a model ``vmap`` cannot run: ``"loop"`` (one
    example at a time) or ``"refuse"`` (``PathRefusal``: auto's other path takes the step)."""
    grads = engine.path.func_grads(engine.rows)
    if isinstance(grads, FuncGradients):
        grads.unvectorizable = what


def _gathered(engine, x: Batch):
    """The step's sums over the whole model: a fully_shard model gathered on every rank
    (``distributed.unsharded``; with its sums sharded, ``ShardedSums.gathered``), any other as it is."""
    if getattr(engine, "_sharded", None) is not None:
        return engine._sharded.gathered(batch.size(x))
    return distributed.unsharded(engine.model) if engine.sharded else contextlib.nullcontext()


def _mixed(engine, dev: torch.device) -> precision.Mixed | None:
    """The step's autocast on the parameters' device (``autocast=``), or None."""
    if engine.autocast is None:
        return None
    return precision.Mixed(dev.type, *engine.autocast)


def with_fall_back(engine, grad_path: str) -> GradPath:
    """``engine``'s path; under ``grad_path="auto"`` with one process, where the path it did not choose
    (``other_path``) applies, a ``FallBack`` composite of both: the other taken once if the chosen one refuses the
    model at its first step (``fall_back``), and, where that is the fast path, the rows path after it."""
    if grad_path != "auto" or engine.world_size != 1:
        return engine.path

    def other_of(path: GradPath):
        return other_path(grad_path, engine.own_rows, engine.model, engine.loss_fn, engine.algo, engine.pipeline,
                          engine.rows, engine.max_physical_batch, engine.expected_batch_size, path)
    other = other_of(engine.path)
    if other is None:
        return engine.path
    # should the fast path refuse too: the rows path, one example at a time
    return FallBack(engine.path, other, lambda now: other_of(now) if refusal_name(now) == "fast" else None)


def drop_staged(engine) -> None:
    """Undo ``engine``'s step that did not complete: every stage's staged state dropped; the step's batch goes
    back to the sampler (the retry takes it again: with bands its class is the step's). The failure counts as a
    passed-over batch (``PoissonSampler.skipped``: uncertified): the error is itself a statement about the batch
    (a non-finite gradient of one corrupt example), and a loop that catches it and goes on, or stops, would
    otherwise run as many steps as that example lets it."""
    engine.rows.rollback()
    engine.pipeline.rollback()
    if engine.sampler.last is not None and engine.sampler.next_step == engine.steps_taken + 1:
        engine.sampler.skipped += 1
        engine.sampler.give_back()


def apply_update(engine, update: Tensor, public: list | None = None) -> None:
    """The released update (plus ``public``: a gradient of no private example, added as it is) as the parameters'
    gradients, then the base optimizer's step; the gradients are cleared whatever happens."""
    local = getattr(engine, "_sharded", None) is not None  # the update is this rank's slice (engine/sharded.py)
    try:
        if local:
            for param, u in zip(engine.params, engine._sharded.unflatten(update, public)):
                param.grad = distributed.shard_like(param, u.to(param.dtype), local=True)
            engine.optimizer.step()
            return
        for i, (param, u) in enumerate(zip(engine.params, engine.rows.layout.unflatten(update))):
            if public is not None and public[i] is not None:
                u = u + public[i].to(u.device, u.dtype).reshape(u.shape)
            param.grad = distributed.shard_like(param, u.to(param.dtype))  # a shard's slice of the one update
        engine.optimizer.step()
    finally:
        engine.optimizer.zero_grad(set_to_none=True)
