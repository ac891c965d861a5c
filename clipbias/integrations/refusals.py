"""The framework settings the private step cannot run soundly, each refused with the reason and the fix: the
Opacus options clipbias does not offer (``check_opacus_options``), Lightning's ``Trainer`` settings and the
metrics it would let steer or release (``check_trainer``, ``check_monitors``, ``check_validation_data``),
Hugging Face's ``TrainingArguments`` (``check_training_args``, ``check_eval_data``), and the data every adapter
needs (``check_loader``, ``check_map_style``). The adapters call them from their hooks; nothing here imports a
framework (the objects are read by their attributes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..errors import ConfigError


def check_opacus_options(*, batch_first: bool, loss_reduction: str, poisson_sampling: bool, clipping: str,
                  noise_generator: Any, grad_sample_mode: str) -> None:
    """Refuse the Opacus options clipbias does not offer, each with the reason."""
    if not poisson_sampling:
        raise ConfigError("poisson_sampling=False: clipbias's accounting assumes secret Poisson sampling (the "
                          "subsampled-Gaussian bounds do not hold for shuffled fixed-size batches); leave it True")
    if clipping != "flat":
        raise ConfigError(f"clipping={clipping!r}: clipbias clips the whole per-example gradient ('flat'); for "
                          f"adaptive clipping pass algorithm='adaptive'")
    if noise_generator is not None:
        raise ConfigError("noise_generator: clipbias draws all noise from ChaCha20 under the run's secret 256-bit "
                          "key; a torch generator (seeded from at most 64 bits) would make the noise recoverable")
    if not batch_first:
        raise ConfigError("batch_first=False: every input tensor must hold one example per row of its first "
                          "dimension")
    if loss_reduction != "mean":
        raise ConfigError(f"loss_reduction={loss_reduction!r}: clipbias divides the noisy sum of clipped gradients "
                          f"by the expected batch size, as Opacus's 'mean'; with 'sum', multiply the learning rate "
                          f"by the batch size instead")
    if grad_sample_mode not in ("hooks", "ghost", "functorch", "ew"):
        raise ConfigError(f"grad_sample_mode must be hooks, ghost, functorch or ew (all run clipbias's own "
                          f"per-example gradients; grad_path= chooses them), got {grad_sample_mode!r}")


FLOAT_PRECISIONS = ("32-true", "64-true", "32", "64")


def check_trainer(trainer: Any, pl_module: Any) -> None:
    """Refuse, with the reason, what the private step cannot run soundly."""
    if str(trainer.precision) not in FLOAT_PRECISIONS:
        raise ConfigError(f"precision={trainer.precision!r} would put the sums of clipped per-example gradients in "
                          f"16 bits (16-bit sums: rounding can exceed the clip bound the accounting rests on); use "
                          f"Trainer(precision='32-true') and DPCallback(autocast='bfloat16') (or 'float16'): the "
                          f"engine then runs the forward and backward in 16 bits and keeps the norms and sums in float32")
    if trainer.world_size > 1 or trainer.num_devices > 1:
        raise ConfigError(f"DPCallback runs in one process on one device (devices={trainer.num_devices}, world size "
                          f"{trainer.world_size}): the engine draws one batch and one noise per step; use devices=1")
    if trainer.accumulate_grad_batches != 1:
        raise ConfigError("accumulate_grad_batches: each optimizer step is one Poisson batch of expected size "
                          "B = the DataLoader's batch_size; set batch_size to B and bound memory with "
                          "DPCallback(max_physical_batch=...)")
    if trainer.gradient_clip_val:
        raise ConfigError("gradient_clip_val clips the batch gradient; DP clips each example's gradient to "
                          "DPCallback(max_grad_norm=...). Leave gradient_clip_val unset")
    if trainer.overfit_batches:
        raise ConfigError("overfit_batches trains on a fixed subset; the guarantee needs secret Poisson batches of "
                          "the whole dataset")
    if not pl_module.automatic_optimization:
        raise ConfigError("DPCallback runs with automatic optimization (training_step returns the loss); manual "
                          "optimization (self.automatic_optimization = False) is not supported")


def check_monitors(trainer: Any) -> None:
    """Refuse a learning-rate scheduler (``ReduceLROnPlateau``'s ``monitor``) or a callback (``EarlyStopping``,
    ``ModelCheckpoint``) that watches a metric logged from the training steps: the metric is a statistic of the
    private batches with no noise, and the schedule, the stopping step or the checkpoint chosen by it shape the
    released model (a canary moved the learning rate from 0.5 to 0.05 at step 3, certified). Checked after each
    training batch, when the training loop's logged names are known (``name``, ``name_step``, ``name_epoch``)."""
    results = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_results", None)
    if results is None:
        return
    logged = {k.split(".", 1)[1] for k in list(results.keys()) if "." in k}
    logged |= {n + suffix for n in logged for suffix in ("_step", "_epoch")}
    logged -= {"epsilon", "epsilon_step", "epsilon_epoch"}  # (DPCallback's own: a function of the step count)
    watched = [(f"the learning-rate scheduler's ({type(c.scheduler).__name__}) monitor", c.monitor)
               for c in trainer.lr_scheduler_configs if getattr(c, "monitor", None)]
    watched += [(f"{type(cb).__name__}(monitor=...)", cb.monitor) for cb in trainer.callbacks
                if isinstance(getattr(cb, "monitor", None), str)]
    for who, name in watched:
        if name in logged:
            raise ConfigError(f"DPCallback: {who} watches '{name}', which training_step logs from the private "
                              f"batches: a statistic of the private data without noise would decide the learning "
                              f"rate, the stopping step or the kept checkpoint, and so the released model. Monitor a "
                              f"metric of validation_step on held-out data instead (or 'epsilon')")


def check_validation_data(train: DataLoader | None, trainer: Any) -> None:
    """Refuse validation on the training data (the train DataLoader itself, or a DataLoader of its dataset):
    its metrics are statistics of the private training data computed without noise, and Lightning logs
    them: they would be released outside the guarantee."""
    if train is None:
        return
    val = getattr(getattr(trainer.fit_loop.epoch_loop.val_loop, "_data_source", None), "instance", None)
    for loader in _loaders([trainer.val_dataloaders, val]):
        if loader is train or _shares_examples(getattr(loader, "dataset", None), train.dataset):
            raise ConfigError(_on_training_data(
                "DPCallback: the validation dataloader is the train DataLoader (or a DataLoader of its dataset): "
                "validation metrics (val loss, accuracy, ...)", "Lightning", "Validate on a held-out split "
                "(val_dataloaders= or val_dataloader() over another dataset, e.g. from torch.utils.data.random_split), "
                "or pass limit_val_batches=0"))


def _shares_examples(val: Any, train: Any) -> bool:
    """Whether the dataset ``val`` may hold examples of ``train``: the same dataset, Subsets of one dataset whose
    indices meet (``random_split``'s disjoint parts do not), or TensorDatasets over overlapping memory (a new
    ``TensorDataset(X[:n])`` over the training tensors)."""
    if val is None:
        return False
    (vb, vi), (tb, ti) = _base(val), _base(train)
    if vb is tb:
        return vi is None or ti is None or not vi.isdisjoint(ti)
    vt, tt = getattr(vb, "tensors", None), getattr(tb, "tensors", None)
    if not vt or not tt:
        return False
    (a0, a1), (b0, b1) = _span(vt[0]), _span(tt[0])
    return a0 < b1 and b0 < a1


def _base(ds: Any) -> tuple:
    """``ds`` unwrapped from ``Subset``s: (the dataset below, the set of its indices ``ds`` holds, None: all)."""
    idx = None
    while type(ds).__name__ == "Subset" and hasattr(ds, "indices") and hasattr(ds, "dataset"):
        here = [int(i) for i in ds.indices]
        idx = set(here) if idx is None else {here[i] for i in idx}
        ds = ds.dataset
    return ds, idx


def _span(t: Any) -> tuple:
    """The bytes of memory a tensor's elements lie in: (first, one past the last)."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
    return start, start + (last + 1) * t.element_size()


def _loaders(x: Any) -> list:
    """The DataLoaders in ``x`` (one, or lists, tuples and dicts of them)."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [loader for v in x for loader in _loaders(v)]
    return [x] if isinstance(x, DataLoader) else []


def check_training_args(args: Any) -> None:
    """Refuse, with the reason, what ``DPTrainer`` cannot run soundly."""
    if args is None:
        return
    if getattr(args, "fp16", False) or getattr(args, "bf16", False):
        raise ConfigError("fp16/bf16 would run Hugging Face's autocast around the whole step, and with it 16-bit sums "
                          "of clipped per-example gradients (rounding can exceed the clip bound the accounting rests "
                          "on); set fp16=False and bf16=False and pass "
                          "DPArguments(autocast=\"bfloat16\") (or \"float16\"): the engine then runs the forward "
                          "and backward in 16 bits and keeps the norms and sums in float32")
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None) or getattr(args, "parallelism_config", None):
        raise ConfigError("DPTrainer runs in one process on one device: DeepSpeed, FSDP and parallelism_config "
                          "shard or reduce gradients outside the engine, which computes, clips and noises them")
    if args.world_size > 1 or args.n_gpu > 1:
        raise ConfigError(f"DPTrainer runs in one process on one device (world size {args.world_size}, "
                          f"{args.n_gpu} GPUs visible to DataParallel): restrict it to one device, e.g. "
                          f"CUDA_VISIBLE_DEVICES=0 without torchrun/accelerate launch")
    strategy = "group_by_length" if getattr(args, "group_by_length", False) else \
        getattr(args, "train_sampling_strategy", "random")
    if strategy != "random":
        raise ConfigError(f"train_sampling_strategy={strategy!r} would let Hugging Face's sampler "
                          f"choose the batches; the privacy guarantee needs the engine's secret Poisson batches: "
                          f"leave it at 'random' (which DPTrainer replaces by Poisson sampling)")
    tokens = getattr(args, "include_num_input_tokens_seen", "no")
    if tokens not in ("no", False, None):
        raise ConfigError(f"include_num_input_tokens_seen={tokens!r} logs the exact number of tokens in each private "
                          f"batch (a membership test: one long example shows in the count), outside the privacy "
                          f"guarantee; leave it at 'no'")
    if getattr(args, "auto_find_batch_size", False):
        raise ConfigError("auto_find_batch_size would change the expected batch size B during the run, and with it "
                          "the sampling rate the accounting assumes: set per_device_train_batch_size yourself")


def check_eval_data(train: Any, evaluated: Any) -> None:
    """Refuse an evaluation on the training set (alone or in a dict of eval sets: the same dataset, a Subset
    meeting the training indices, a TensorDataset over the training tensors' memory: ``_shares_examples``, as
    Lightning's validation): its metrics are statistics of the private training data, computed outside the
    private step without noise, and the Trainer logs them (to every ``report_to``): they would be released
    outside the guarantee."""
    sets = evaluated.values() if isinstance(evaluated, Mapping) else [evaluated]
    if train is not None and any(_shares_examples(d, train) for d in sets):
        raise ConfigError(_on_training_data(
            "DPTrainer: eval_dataset is the train_dataset or holds its examples (the same dataset, a Subset of its "
            "indices, its tensors): its metrics (loss, accuracy, ...)", "the Trainer",
            "Evaluate on a held-out split (e.g. train_test_split) or pass eval_dataset=None"))


def _on_training_data(what: str, logger: str, fix: str) -> str:
    """The refusal of metrics computed on the training data (``check_validation_data``, ``check_eval_data``):
    ``what`` they are, who logs them, the fix."""
    return (f"{what} are statistics of the private training data computed without noise, and {logger} logs them, "
            f"released outside the privacy guarantee. {fix}; metrics of the training data must stay as private as "
            f"the data")


def check_loader(data: Any, subject: str, not_a_loader: str) -> None:
    """Refuse a training loader the private batches cannot be drawn from: not a ``DataLoader``
    (``not_a_loader``, formatted with its type's name), or one without a ``batch_size`` (``subject`` names it)."""
    if not isinstance(data, DataLoader):
        raise ConfigError(not_a_loader.format(type(data).__name__))
    if data.batch_size is None:
        raise ConfigError(f"{subject} has no batch_size (a batch_sampler was given): the expected Poisson batch size "
                          f"is read from DataLoader(dataset, batch_size=B)")


def check_map_style(data: Any) -> None:
    """Refuse a training dataset without ``len`` and indexing (an ``IterableDataset``)."""
    if data is not None and (isinstance(data, torch.utils.data.IterableDataset) or not hasattr(data, "__len__")):
        raise ConfigError("train_dataset must be a map-style dataset (len and indexing): secret Poisson sampling "
                          "draws each of the n examples independently, which a stream cannot offer")


def check_given_loader(given: Any, data: DataLoader) -> None:
    """Opacus's Lightning pattern: refuse a ``make_private`` given another data loader (another ``n`` or
    ``B``) than the one the Trainer trains on (``data``)."""
    if given is not None and (len(given.dataset), given.batch_size) != (len(data.dataset), data.batch_size):
        raise ConfigError(f"make_private was given a data_loader of {len(given.dataset)} examples in batches of "
                          f"{given.batch_size}, the Trainer trains on {len(data.dataset)} in batches of "
                          f"{data.batch_size}: pass the Trainer's train dataloader to make_private")
