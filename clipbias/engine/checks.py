"""The engine's refusals, each before anything changes: constructor arguments, a step's batch, a
process group's ranks, a resumed run's settings. Every message names the value and the fix."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .. import distributed
from ..config import AlgoConfig
from ..data import batch
from ..data.batch import Batch
from ..errors import ConfigError, ResumeMismatchError
from ..grads.precision import check_autocast
from ..grads.rows import RowSource, cross_entropy


def check_arguments(model: nn.Module, n: int, batch_size: float, config: AlgoConfig) -> int:
    """Refuse constructor arguments that would fail later with a raw error (or silently): returns n
    as an int (numpy integers are fine)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, AlgoConfig):
        raise ConfigError(f"config must be an AlgoConfig (clipbias.config.AlgoConfig(lr=..., clip=...)), got "
                          f"{type(config).__name__}")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ConfigError(f"dataset size n must be a positive integer, got {n!r}")
    n = int(n)
    if not (isinstance(batch_size, numbers.Real) and 1 <= batch_size <= n):
        raise ConfigError(f"`batch_size` (the expected Poisson batch size B) must lie in [1, N={n}], got "
                          f"{batch_size!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"the model ({type(model).__name__}) has no trainable parameters: nothing to train")
    return n


def check_step(engine, x: Batch, y: Batch, indices: Tensor | None) -> Batch:
    """Refuse a step that cannot be taken: budget spent, mismatched lengths, float labels. Returns the labels
    the step uses: ``y``, with integer class indices of another dtype than torch.long (int32, uint8, ...) as
    torch.long for the default cross-entropy loss (``class_indices``)."""
    if engine.steps_taken >= engine.total_steps and engine.algo.private:
        raise ConfigError(f"the privacy budget covers {engine.total_steps} steps and all were taken; "
                          f"start a new run with more `epochs` to train longer")
    if not (isinstance(x, Tensor) and isinstance(y, Tensor)) and not engine.rows.structured:
        raise ConfigError(f"`algorithm='{engine.algo.name}'` computes its rows from image tensors and takes tensor "
                          f"inputs and labels, got {type(x).__name__} and {type(y).__name__}; use an "
                          f"algorithm with per-example rows (dpsgd, dice, ...) for structured batches")
    check_precision(engine.params)
    check_batch(x, y, indices, engine.loss_fn is cross_entropy, engine.own_rows)
    y = class_indices(y) if engine.loss_fn is cross_entropy else y
    if indices is not None:
        check_indices(indices, engine.n)
    noise = getattr(engine.pipeline, "noise", None)
    if engine.algo.private and noise is not None and noise.draws != engine.steps_taken:
        raise ConfigError(f"the engine has counted {engine.steps_taken} steps but drawn {noise.draws} noise releases: "
                          f"a step was interrupted while it was being recorded. Resume from the last checkpoint "
                          f"(a new DPEngine and load_state_dict) instead of stepping this one")
    if engine.bands > 1:
        check_band_class(engine, indices)
    if engine.world_size > 1 and indices is None:
        raise ConfigError(f"in a process group of {engine.world_size} ranks, step needs the example indices of "
                          f"this rank's share (engine.local_share(engine.sampler.sample())): the keyed "
                          f"per-example draws and the shares are defined by them")
    return y


def class_indices(y: Batch) -> Batch:
    """Integer class indices ``y`` as torch.long, the dtype ``F.cross_entropy`` takes (torch 2.13 refuses int32,
    int16 and int8 targets): exact for every integer dtype, so labels that a numpy array or a dataset stored as
    int32 train as they are. Anything else (floats, bool, structured labels) is returned unchanged."""
    if isinstance(y, Tensor) and y.dtype != torch.long and not (y.is_floating_point() or y.is_complex()
                                                                 or y.dtype == torch.bool):
        return y.long()
    return y


def check_optimizer_resume(state: dict, optimizer: torch.optim.Optimizer) -> None:
    """Refuse (``ResumeMismatchError``) a state whose base optimizer is another kind than this engine's
    (its moments or momentum buffers and hyperparameters mean nothing to the other: torch would fail
    at load or at the first step, or keep the other's settings)."""
    mine = type(optimizer).__name__
    if state["optimizer_class"] != mine:
        raise optimizer_mismatch(state["optimizer_class"], mine)


def optimizer_mismatch(was: str, mine: str) -> ResumeMismatchError:
    """The refusal of a resume whose base optimizer was ``was`` into an engine whose is ``mine``."""
    return ResumeMismatchError(f"cannot resume: the checkpoint's base optimizer is {was}, this engine's is {mine}. "
                               f"Build the engine with the original optimizer (`AlgoConfig.optimizer` and "
                               f"`AlgoConfig.momentum`), or start a new run")


def padding_refusal(x: Batch) -> str | None:
    """The refusal of any dropout mask on a batch whose ``attention_mask`` pads an example anywhere but on the
    right (a 0 before a 1), or None. The keyed masks are laid out by token position (``randomness.forward``):
    with right padding an example's real tokens keep their positions whatever the batch's longest example; with
    left padding they shift with it, so one example joining the batch would move another's dropout masks. The
    keyed forward raises it at the step's first mask, whichever operator draws it (``nn.Dropout``,
    ``F.dropout`` called by the model's own code as BART, OPT and Marian do, SDPA's ``dropout_p``)."""
    mask = x.get("attention_mask") if isinstance(x, Mapping) else None
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return None
    m = mask.detach() != 0
    if not bool((m[:, 1:] & ~m[:, :-1]).any()):
        return None
    return ("`x['attention_mask']` pads an example on the left (a 0 before a 1) while the model draws dropout: its "
            "masks are keyed per example and laid out by token position, so left padding would shift an example's "
            "masks with the batch's longest example (one example joining the batch would move another's "
            "randomness). Pad on the right (Hugging Face: tokenizer.padding_side = 'right'), or switch the model's "
            "dropout off (model.eval(), or p = 0 and config.dropout = 0)")


def check_band_class(engine, indices: Tensor | None) -> None:
    """With b bands, step t may hold only examples of class t mod b: the accounting counts an example's
    participations at least b releases apart. A caller that skips a failed step and samples on would
    release the next class's batch at the failed step's position (its blocks would overlap: an audit
    measured epsilon 10.8 against a claim of 2.9); such a batch is refused here."""
    if indices is None:
        raise ConfigError(f"with `bands={engine.bands}`, step needs the batch's example indices "
                          f"(engine.sampler.sample()): each step may hold only the examples of its class")
    t = engine.steps_taken
    idx = indices.detach().cpu().numpy().astype("int64")
    wrong = idx[engine.sampler.labels[idx] != t % engine.bands] if len(idx) else idx
    if len(wrong):
        raise ConfigError(f"with `bands={engine.bands}`, step {t} takes only examples of class {t % engine.bands}, "
                          f"but example {int(wrong[0])} is of class {int(engine.sampler.labels[wrong[0]])}: this "
                          f"batch was drawn for another step. Pass the batches of engine.sampler.sample() to step "
                          f"in order: after a failed step sample() returns its batch again; a batch drawn and not "
                          f"stepped is lost, and the batches after it are refused until one of class "
                          f"{t % engine.bands} comes")


def check_indices(indices: Tensor, n: int) -> None:
    """Refuse indices that no Poisson batch of ``n`` examples holds: not integers, outside [0, n), or
    one example twice. The accounting bounds each example's contribution to a step by one clip
    norm; an example present k times would contribute k C, and the keyed per-example draws (noise
    of the perturbation, the band classes) are looked up by index."""
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool or indices.dim() != 1:
        raise ConfigError(f"step: indices must be a 1-D integer tensor of example indices, got dtype {indices.dtype} "
                          f"and shape {tuple(indices.shape)}; pass the batch of engine.sampler.sample()")
    if not len(indices):
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= n:
        raise ConfigError(f"step: example index {lo if lo < 0 else hi} is outside [0, {n}) (the engine was built with "
                          f"n={n}); pass the batch of engine.sampler.sample()")
    uniq, counts = torch.unique(indices, return_counts=True)
    if len(uniq) != len(indices):
        i = int(counts.argmax())
        raise ConfigError(f"step: example {int(uniq[i])} appears {int(counts[i])} times in the batch; a Poisson batch "
                          f"holds each example at most once (the accounting bounds one example's contribution by "
                          f"one clip norm, and {int(counts[i])} copies would contribute {int(counts[i])} times it). "
                          f"Pass the batch of engine.sampler.sample()")


def check_precision(params: list[Tensor]) -> None:
    """Refuse a step whose clipped sum would be computed in 16-bit floats: inside the caller's
    ``torch.autocast`` (it covers the clip factors and the sums as well as the forward) or with
    bfloat16/float16 parameters the weighted sum rounds at 2^-8 (bfloat16), and over a batch of
    aligned clipped gradients that rounding is a fraction of B C: removing one example moved the
    released sum by 1.2 C at B = 256 and 1.7 C at B = 512 (rows and fast path alike), where the
    sensitivity is C. ``DPEngine(autocast=...)`` runs only the forwards and backwards in 16 bits."""
    on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if on:
        raise ConfigError(f"step runs under torch.autocast ({on[0]}): the clipped sum would be rounded in 16-bit "
                          f"floats, so one example could move it by more than the clip (1.2 C measured at B = 256). "
                          f"Call engine.step outside autocast and build the engine with "
                          f"DPEngine(..., autocast=torch.bfloat16) (or torch.float16): it runs the forward and "
                          f"backward in 16 bits and keeps the norms and sums in float32")
    low = sorted({str(p.dtype) for p in params if p.dtype in (torch.float16, torch.bfloat16)})
    if low:
        raise ConfigError(f"the model's parameters are {', '.join(low)}: the clipped sum would be rounded in 16-bit "
                          f"floats, so one example could move it by more than the clip; convert the model with "
                          f"model.float() (or .double()), and pass autocast=torch.bfloat16 (or torch.float16) to "
                          f"DPEngine for 16-bit forwards and backwards")


def check_mixed(autocast, loss_scale, grads) -> tuple | None:
    """``DPEngine(autocast=..., loss_scale=...)`` as ``(dtype, loss scale)`` or None
    (``grads.precision.check_autocast``), refused with a given ``grads`` backend: autocast applies to the
    gradients the engine computes itself."""
    mixed = check_autocast(autocast, loss_scale)
    if mixed is not None and grads is not None:
        raise ConfigError("autocast applies to the per-example gradients the engine computes itself; a given "
                          "grads backend computes its own (enter torch.autocast inside it, around the model's "
                          "forward, and return float32 gradients): drop autocast= or grads=")
    return mixed


def check_batch(x: Batch, y: Batch, indices: Tensor | None, class_labels: bool, own_rows: bool) -> None:
    """Refuse a batch the step cannot take, before anything changes: tensors (or tuples, lists, dicts
    of tensors) with one row per example in every tensor and, for the default cross-entropy loss
    (``class_labels``), one integer class index per example, not negative where the engine computes
    the rows itself (``own_rows``; cross-entropy would silently ignore a label of -100)."""
    for name, t in (("x", x), ("y", y), ("indices", indices)):
        if t is not None and not isinstance(t, Tensor) and (name == "indices" or not isinstance(t, (tuple, list, Mapping))):
            raise ConfigError(f"step: {name} must be a torch.Tensor" + ("" if name == "indices" else
                              " (or a tuple, list or dict of tensors)") + f", got {type(t).__name__}; convert it "
                              f"with torch.as_tensor({name})")
    if isinstance(x, Tensor) and x.dim() == 0:
        raise ConfigError("step got a scalar as inputs: one row per example is needed")
    bx, by = batch.size(x), batch.size(y)
    if bx != by or (indices is not None and len(indices) != bx):
        raise ConfigError(f"step got {bx} inputs, {by} labels"
                          + (f" and {len(indices)} indices" if indices is not None else "")
                          + ": one label (and index) per input is needed")
    if class_labels and not isinstance(y, Tensor):
        raise ConfigError(f"the default cross-entropy loss takes a tensor of class indices, got "
                          f"{type(y).__name__} labels; pass your own loss_fn for structured targets")
    if class_labels and (y.is_floating_point() or y.is_complex() or y.dtype == torch.bool):
        raise ConfigError(f"labels must be integer class indices (torch.long; int32 and other integer dtypes are "
                          f"converted) for the default cross-entropy loss, got {y.dtype}; convert them with y.long()"
                          + (" (False and True as classes 0 and 1)" if y.dtype == torch.bool else "")
                          + " or pass your own loss_fn")
    if class_labels and own_rows and len(y) and bool((y < 0).any()):
        raise ConfigError(f"labels must be class indices >= 0 for the default cross-entropy loss, got "
                          f"{int(y.min())}; fix the labels (negative ones are not classes) or pass your own loss_fn")
    if class_labels and y.dim() != 1:
        raise ConfigError(f"labels must be one class index per example (shape ({len(y)},)) for the default "
                          f"cross-entropy loss, got shape {tuple(y.shape)}; flatten them with y.view(-1) or pass "
                          f"your own loss_fn")


def check_distributed(name: str, rows: RowSource, pipeline) -> int:
    """The world size of the process group (1 without one), after refusing what cannot be split:
    a row source or stage whose rows are not a sum over examples that each rank can compute alone
    declares why in ``distributed_refusal`` (none of the built-in methods does; a user's source may)."""
    world = distributed.context()[1]
    if world == 1:
        return 1
    why = getattr(rows, "distributed_refusal", None) or next(
        (s.distributed_refusal for _, s in pipeline.named_stages() if getattr(s, "distributed_refusal", None)), None)
    if why:
        raise ConfigError(f"`algorithm='{name}'` cannot run on {world} processes: {why}. Run it with one process "
                          f"(plain `clipbias train`)")
    return world


def _extendable(saved: dict, now: dict) -> bool:
    """More steps than the checkpoint's at a noise multiplier that was given, not calibrated to a
    target epsilon: the accounting covers the longer run (``privacy()`` reports its epsilon)."""
    return saved["target_epsilon"] is None and now["target_epsilon"] is None and now["steps"] > saved["steps"]


def canon(v) -> str:
    """A method setting in canonical form: 4 and 4.0 are the same setting."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return repr(float(v))
    return repr(v)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    return a == b


def check_resume(saved: dict, now: dict) -> None:
    """Refuse (``ResumeMismatchError``) a resumed run whose privacy-relevant settings changed; more steps
    at a given (not calibrated) noise multiplier are allowed (``_extendable``)."""
    diff = {k: (saved[k], v) for k, v in now.items() if not _same(saved[k], v)
            and not (k == "steps" and _extendable(saved, now))}
    if diff:
        lines = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise ResumeMismatchError(f"cannot resume: privacy-relevant settings changed ({lines}). "
                                  f"Resume with the original settings or start a new run directory.")
