"""torch.distributed: one logical DP step over N processes, with the guarantee of one process.

The seam (docs/architecture.md, "Distributed training"):

* every rank runs the SAME Poisson sampler (rank 0's secret key is broadcast when the engine is
  built), so every rank draws the identical global index set each step;
* each rank processes its share of it, the examples with ``index % world == rank`` (``local_share``):
  an example always lands on the same rank, so per-example state keyed by the index would stay on
  one rank;
* each rank computes its partial processed sum, reference sum (error feedback) and loss sum through
  its row source or the fast path, and ONE ``all_reduce(SUM)`` of the concatenated
  ``[processed, reference, loss sum, count, failure flag]`` (``reduce_step``) gives every rank the
  global sums of the single-process step;
* every rank then runs the identical ``Pipeline.finish``: the noise is drawn under the same key at the
  same address, so the same Gaussian vector is added once to the global sum (never N draws), and
  the error-feedback buffer, outer momentum, optimizer state and weights stay identical without any
  broadcast.

The accounting sees one Poisson-subsampled Gaussian release per step, exactly as with one process.
Outside an initialised process group (or with one process) every function here is the identity.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Callable, TypeVar

import torch
from torch import Tensor

from . import errors
from .errors import ClipbiasError, ConfigError

if TYPE_CHECKING:
    from .randomness import SecretKey

T = TypeVar("T")


def context() -> tuple[int, int]:
    """(rank, world size) of the initialised default process group, (0, 1) without one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def env_world_size() -> int:
    """The world size torchrun announces in ``WORLD_SIZE`` (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def init_from_env(device: str) -> bool:
    """Initialise the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``PORT``): gloo on the CPU, nccl on CUDA (one GPU per process, ``LOCAL_RANK``).
    Returns True when it initialised one (the caller destroys it), False for a single process."""
    import torch.distributed as dist
    if env_world_size() <= 1 or dist.is_initialized():
        return False
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("`device='cuda'`: CUDA is not available on this machine; use `device='cpu'` (gloo)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it is
    # first imported (torch._dynamo imports it, e.g. when the optimizer is built). Imported after the
    # group exists, it keeps the group alive past destroy_process_group, which then does not join
    # gloo's worker threads: a worker that drops its last finished work late (a barrier's work holds
    # the earlier collectives' tensors) needs the GIL to free their Python objects, and once the
    # interpreter is shutting down Python ends that thread inside a C++ destructor: SIGABRT,
    # "terminate called without an active exception". Imported first, its defaults hold None.
    import torch.distributed.nn.functional as _bound_now  # noqa: F401  (a bare `import torch.x` shadows torch)
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return True


def broadcast_key(key: SecretKey) -> SecretKey:
    """Rank 0's secret key on every rank: identical batches and one noise draw everywhere. The key
    travels over the process group's own transport (a trusted network between the ranks)."""
    rank, world = context()
    if world == 1:
        return key
    import torch.distributed as dist
    from .randomness import SecretKey
    box = [(key.bytes, key.reproducible) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return SecretKey(*box[0])


def sum_over_ranks(value: float, device: torch.device | str = "cpu") -> float:
    """The sum of every rank's ``value`` (the value itself with one process); a collective: every rank
    calls it (e.g. a step's count of unclipped rows, each rank counting its share)."""
    if context()[1] == 1:
        return float(value)
    import torch.distributed as dist
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t)


def local_share(indices: Tensor, owners: Tensor | None = None) -> Tensor:
    """This rank's share of a global batch: the indices whose owner is this rank (all of them for
    one process). ``owners`` defaults to ``index % world``: every example has one owner across all
    steps, whatever the batch (``RowSource.owners`` may group examples otherwise: p-avg)."""
    rank, world = context()
    if world == 1:
        return indices
    return indices[(indices % world if owners is None else owners) == rank]


def merge_owned(buf: Tensor | None, seen: Tensor | None, n: int) -> tuple[Tensor | None, Tensor | None]:
    """Per-example state ``buf [n, d]`` (with its ``seen [n]`` flags) of which each rank holds the
    rows of the examples it owns (``i % world == rank``): the whole state, on every rank (a collective:
    every rank calls it; a checkpoint holds all rows). Rows a rank does not own are ignored."""
    rank, world = context()
    if world == 1:
        return buf, seen
    import torch.distributed as dist
    shapes = gather_objects(None if buf is None else (tuple(buf.shape), str(buf.device)))
    first = next((s for s in shapes if s is not None), None)
    if first is None:
        return None, None
    dev = buf.device if buf is not None else torch.device(first[1] if "cuda" not in first[1] else "cuda")
    own = (torch.arange(n, device=dev) % world == rank)
    whole = torch.zeros(first[0], device=dev) if buf is None else buf * own.unsqueeze(1).to(buf)
    flags = torch.zeros(n, device=dev) if seen is None else (seen.to(dev) & own).to(whole)
    dist.all_reduce(whole, op=dist.ReduceOp.SUM)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    return whole, flags > 0


def reduce_step(proc: Tensor, ref: Tensor | None, losses: Tensor, failure: ClipbiasError | None,
                reduced: bool = False) -> tuple[Tensor, Tensor | None, float, int, ClipbiasError | None]:
    """ONE all-reduce of ``[processed sum, reference sum, loss sum, count, failed]``: every rank gets
    the global sums and learns whether any rank failed; then (only on failure) the first failing
    rank's error is shared, so every rank raises the same error and rolls back. ``reduced``: the sums
    are already this rank's slice of the global sums (a fully_shard model's, ``engine.sharded``):
    only ``[loss sum, count, failed]`` is all-reduced and the sums are returned as they are."""
    import torch.distributed as dist
    d = 0 if reduced else proc.numel()
    tail = torch.cat([losses.sum().reshape(1).to(proc),  # on the sums' device: nccl reduces CUDA tensors
                      proc.new_tensor([float(len(losses)), 1.0 if failure is not None else 0.0])])
    buf = tail if reduced else torch.cat([proc, ref if ref is not None else proc.new_zeros(0), tail])
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    if not reduced:
        proc, ref = buf[:d], (buf[d:2 * d] if ref is not None else None)
    loss_sum, count, failed = float(buf[-3]), int(round(float(buf[-2]))), float(buf[-1]) > 0
    if failed:
        failure = _shared_failure(failure)
    return proc, ref, loss_sum, count, failure


def _shared_failure(local: ClipbiasError | None) -> ClipbiasError:
    """The error of the lowest failing rank, rebuilt identically on every rank."""
    import torch.distributed as dist
    rank, world = context()
    mine = None if local is None else (type(local).__name__, str(local))
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    r, (name, msg) = next((r, e) for r, e in enumerate(every) if e is not None)
    cls = getattr(errors, name, ClipbiasError)
    return cls(f"{msg} [rank {r} of {world}; every rank stopped this step and nothing was updated]")


def from_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` run by rank 0 only (file-system work: the run directory, its lock, the checkpoint),
    its result broadcast to every rank; an error on rank 0 is raised on every rank (no rank waits
    forever for a rank that gave up). With one process: just ``fn()``."""
    rank, world = context()
    if world == 1:
        return fn()
    import torch.distributed as dist
    box: list = [None]
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - every rank must learn that rank 0 failed
            dist.broadcast_object_list([("error", type(e).__name__, str(e))], src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        cls = getattr(errors, box[0][1], None)
        raise (cls or ClipbiasError)(box[0][2] if cls else f"rank 0 failed: {box[0][1]}: {box[0][2]}")
    return box[0][1]


def gather_objects(obj: object) -> list:
    """Every rank's ``obj`` on every rank (``[obj]`` for one process): the per-rank torch RNG states
    the checkpoint keeps."""
    rank, world = context()
    if world == 1:
        return [obj]
    import torch.distributed as dist
    every: list = [None] * world
    dist.all_gather_object(every, obj)
    return every


# ---------------------------------------------------------------- FSDP2 (torch.distributed.fsdp.fully_shard)
FSDP_HOW = ("Shard the model with torch.distributed.fsdp.fully_shard on its blocks and then on the model itself "
            "(the root), with the default policies, and train it on the fast path (grad_path='fast' or 'auto'); "
            "an unsharded model trains data-parallel on any path (every rank a full replica)")


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a ``fully_shard`` unit or a DTensor parameter (trainable or frozen: a frozen
    shard must be gathered for the forward too). Neither exists before its torch module is imported, so
    without those imported this imports nothing (FSDP's import costs about a second)."""
    fsdp, tensor = sys.modules.get("torch.distributed.fsdp"), sys.modules.get("torch.distributed.tensor")
    return (fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())) or \
        (tensor is not None and any(isinstance(p, tensor.DTensor) for p in model.parameters()))


_FSDP_INTERNALS = ("fsdp_params", "mp_policy", "offload_policy", "post_forward_mesh_info", "reshard_after_backward",
                   "reduce_grads", "all_reduce_grads", "reshard")
"""What ``unsharded`` reads and sets on each FSDP parameter group (torch 2.13's FSDP2); ``check_sharded`` refuses
a torch whose groups lack one, rather than fail inside a step."""


def _fsdp_groups(model: torch.nn.Module) -> list:
    """The FSDP parameter groups of every ``fully_shard`` unit in ``model`` (each once)."""
    from torch.distributed.fsdp import FSDPModule
    groups: dict[int, object] = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for g in m._get_fsdp_state()._fsdp_param_groups:
                groups.setdefault(id(g), g)
    return list(groups.values())


def _missing_internals(model: torch.nn.Module) -> list[str]:
    """The FSDP2 internals ``unsharded`` uses that this torch's ``fully_shard`` units lack (none on torch 2.13)."""
    state = getattr(model, "_get_fsdp_state", lambda: None)()
    if state is None or not hasattr(state, "_fsdp_param_groups") or not hasattr(state, "_lazy_init"):
        return ["FSDPModule._get_fsdp_state()._fsdp_param_groups / _lazy_init"]
    return sorted({a for g in _fsdp_groups(model) for a in _FSDP_INTERNALS if not hasattr(g, a)})


def check_sharded(model: torch.nn.Module, rule_kind: Callable[[torch.nn.Module], str | None]) -> None:
    """Refuses (ConfigError) a sharded model that ``unsharded`` cannot gather whole: every DTensor
    parameter must belong to a ``fully_shard`` unit inside ``model``, ``model`` itself
    must be one (the root, whose forward runs first), no unit may be a layer with a fast-path rule (Linear,
    Conv, Embedding, the norms: the fast path refuses hooks on them), the units must keep their parameters
    and gradients in the parameters' own dtype on their device (no MixedPrecisionPolicy casts, no CPU
    offload), and torch's FSDP2 must have the internals ``unsharded`` drives (``_FSDP_INTERNALS``). ``rule_kind``:
    the name of a module's fast-path layer class or None (``clipbias.grads.fast.rule_kind``, passed in by the engine)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor
    if not isinstance(model, FSDPModule):
        raise ConfigError(f"the model holds fully_shard units or DTensor parameters but is not itself a fully_shard "
                          f"module. {FSDP_HOW}")
    layer = next(((n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule) and rule_kind(m)),
                 None)
    if layer is not None:  # the fast path refuses hooks on its layers: FSDP's would be refused at the first step
        kind = rule_kind(layer[1])
        raise ConfigError(f"fully_shard was applied to the layer {repr(layer[0]) if layer[0] else 'the model'} "
                          f"({kind}) itself; apply it to the blocks that contain the layers (FSDP's hooks sit on the "
                          f"module it wraps, and the per-layer norms refuse hooks on their layers). {FSDP_HOW}")
    missing = _missing_internals(model)
    if missing:
        raise ConfigError(f"this torch ({torch.__version__}) has FSDP2 internals other than those the private step "
                          f"drives (tested with torch 2.13; missing: {', '.join(missing)}): train the model "
                          f"unsharded, data-parallel")
    groups = _fsdp_groups(model)
    managed = {id(fp.sharded_param) for g in groups for fp in g.fsdp_params}
    other = [n for n, p in model.named_parameters() if isinstance(p, DTensor) and id(p) not in managed]
    if other:
        raise ConfigError(f"parameters {other[:3]} are DTensors that fully_shard does not manage (tensor "
                          f"parallelism?): the private step gathers only fully_shard's shards. {FSDP_HOW}")
    for g in groups:
        mp = g.mp_policy
        if any(t is not None for t in (mp.param_dtype, mp.reduce_dtype, mp.output_dtype)) or \
                isinstance(g.offload_policy, CPUOffloadPolicy):
            raise ConfigError("fully_shard with a MixedPrecisionPolicy that casts, or with CPUOffloadPolicy: the "
                              "per-example norms and the clipped sum are computed on the gathered parameters in "
                              f"their own dtype and device. {FSDP_HOW}")


def refuse_sharded_path(why: str) -> None:
    """A fully_shard model whose step would not run on the fast path (``why``): refused (ConfigError)."""
    raise ConfigError(f"a model sharded with fully_shard trains on the fast path only (per-layer norms and "
                      f"book-keeping sums), which does not apply here: {why}. {FSDP_HOW}")


@contextlib.contextmanager
def unsharded(model: torch.nn.Module):
    """The whole of a ``fully_shard`` model gathered on every rank for one private step's sums, then sharded again.

    Inside, every unit's parameters are registered unsharded (plain tensors, all-gathered once on entry:
    a collective, every rank enters, one all-gather per unit in the same order), and every unit is a plain
    module again (``plain``: FSDP's class and forward hooks set aside), so the forward and backward run the
    unwrapped model and issue no collective: the ranks, which run different numbers of forward and backward
    passes on their shares, stay in step. The per-example norms and clipped sums are those of the unwrapped
    model, and the fast path's structural proof (``grads.separable``) sees the model it runs. On exit (also
    on an error) FSDP's class, hooks and settings are restored and the parameters are sharded again (the
    gathered copies freed). Identity for a model without ``fully_shard`` units."""
    groups = _fsdp_groups(model)
    if not groups:
        yield
        return
    model._get_fsdp_state()._lazy_init()  # the root decides its reshard-after-forward once, before we save it
    saved = [(g, g.post_forward_mesh_info, g.reshard_after_backward, g.reduce_grads, g.all_reduce_grads)
             for g in groups]
    try:
        for g in groups:
            g.post_forward_mesh_info, g.reshard_after_backward = None, False  # no reshard within the step
            g.reduce_grads = g.all_reduce_grads = False  # no reduce-scatter: nothing reaches .grad anyway
        from torch.distributed.fsdp import FSDPModule
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.unshard()
        with plain(model):
            yield
    except BaseException:
        model.reset_iter_state()  # a forward or backward cut short: FSDP's per-iteration state cleared
        raise
    finally:
        for g, *before in saved:
            g.post_forward_mesh_info, g.reshard_after_backward, g.reduce_grads, g.all_reduce_grads = before
        for g in groups:
            g.reshard()


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


@contextlib.contextmanager
def plain(model: torch.nn.Module):
    """Every ``fully_shard`` unit of ``model`` (its parameters gathered: ``unsharded``) as the module it wraps: its
    class the original one (``FSDPSequential`` -> ``nn.Sequential``) and the forward pre-hook and hook FSDP
    registered on it removed (other hooks stay); restored on exit. Inside, the units run their own forward on the
    gathered parameters and nothing of FSDP runs (no collective, no resharding, nothing written to ``.grad``)."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = []
    for m in units:
        state = m._get_fsdp_state()
        ours = {h.id for h in (getattr(state, "_pre_forward_hook_handle", None),
                               getattr(state, "_post_forward_hook_handle", None)) if h is not None}
        hooks = {k: dict(getattr(m, k)) for k in _HOOK_DICTS if hasattr(m, k)}
        base = next(c for c in type(m).__bases__ if not issubclass(c, FSDPModule))
        saved.append((m, type(m), hooks))
        for k in hooks:
            for i in ours:
                getattr(m, k).pop(i, None)
        m.__class__ = base
    try:
        yield
    finally:
        for m, cls, hooks in saved:
            m.__class__ = cls
            for k, before in hooks.items():
                getattr(m, k).clear()
                getattr(m, k).update(before)


def shard_like(param: Tensor, full: Tensor, local: bool = False) -> Tensor:
    """``full`` (the whole update of ``param``, identical on every rank) as ``param`` holds it: this rank's
    slice as a DTensor of ``param``'s mesh and placements (no communication), or ``full`` itself for a
    plain tensor. ``local``: ``full`` is already this rank's slice (``param.to_local()``'s shape), wrapped as is."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if not isinstance(param, DTensor):
        return full
    if local:
        return DTensor.from_local(full.view(param.to_local().shape), param.device_mesh, param.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())
    return distribute_tensor(full.contiguous(), param.device_mesh, param.placements, src_data_rank=None)
