"""Private training with the Hugging Face ``Trainer``: ``DPTrainer`` is a ``transformers.Trainer`` that
takes your ``TrainingArguments`` and a ``DPArguments``.

    from clipbias.integrations.transformers import DPArguments, DPTrainer
    trainer = DPTrainer(model=model, args=TrainingArguments("out", per_device_train_batch_size=16,
                                                            gradient_accumulation_steps=4, num_train_epochs=3),
                        train_dataset=train, eval_dataset=valid, data_collator=collator,
                        dp_args=DPArguments(target_epsilon=3.0, max_grad_norm=1.0))
    trainer.train()                      # logs "epsilon" beside "loss"
    print(trainer.privacy_report())

The mapping (docs/integrations.md): each optimizer step is one secret Poisson batch drawn by the engine,
of expected size B = ``per_device_train_batch_size * gradient_accumulation_steps``; the Trainer's
gradient-accumulation micro-steps are that batch split in ``gradient_accumulation_steps`` physical chunks,
and the engine computes the per-example gradients in micro-batches of ``per_device_train_batch_size``.
At the last chunk the engine clips each example's gradient, adds the secret noise and leaves the private
update in ``.grad``; the Trainer then steps your optimizer (created from ``TrainingArguments`` as usual,
scheduler and warmup included) on it. HF's own sampler never picks a private batch. The private loader checks
that fetch and collate are a function of the example alone (``clipbias.sampling.refetch``); Hugging Face's
``DataCollatorForLanguageModeling`` masks with keyed per-example draws (``keyed_collator``).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers
from torch import Tensor, nn

from ..data.text import IGNORE
from ..engine import DPEngine
from ..errors import ConfigError
from ..privacy import PrivacyReport
from ..randomness.example import example_generator
from ..sampling.loader import PoissonLoader
from ..sampling.poisson import epoch_steps as sampling_epoch_steps
from .options import DPOptions, EpsilonLog, check_trainable
from .session import N_RELEASED, TIMES_RELEASED, Deferred, Session, exact_chunks, is_mapping

__all__ = ["DPArguments", "DPTrainer", "PerExampleIds", "causal_lm_loss", "keyed_collator",
           "sequence_classification_loss"]

DP_STATE = "dp_engine.pt"
"""The private state in each checkpoint folder (secret key, sampler, steps): never release it."""


@dataclass
class DPArguments(DPOptions):
    """``DPTrainer``'s privacy settings: those of
    [`DPOptions`][clipbias.integrations.options.DPOptions] (``target_epsilon`` or ``noise_multiplier``,
    ``target_delta``, ``max_grad_norm``, ``algorithm``, ``grad_path``, ...: see there) and ``per_example_loss``.

    Args:
        per_example_loss: The loss the engine differentiates for each example: ``"auto"`` (default: from the
            model's class, ``*ForSequenceClassification`` or a causal LM, ``*ForCausalLM`` / ``*LMHeadModel``),
            ``"sequence_classification"`` (``sequence_classification_loss``), ``"causal_lm"``
            (``causal_lm_loss``), or a function ``(model output, labels) -> per-example losses [b]``.
    """

    per_example_loss: str | Callable = "auto"


def _logits(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping) or hasattr(out, "logits"):
        return out["logits"] if isinstance(out, Mapping) else out.logits
    return out[0]


def sequence_classification_loss(num_labels: int, label_smoothing: float = 0.0, config: Any = None) -> Callable:
    """Per-example loss of a ``*ForSequenceClassification`` model, as the model computes its batch loss
    (HF's ``problem_type`` rule): mean squared error for one label, cross-entropy for integer labels,
    binary cross-entropy with logits (mean over labels) for float multi-labels.

    Args:
        num_labels: The model's ``config.num_labels`` (1: regression).
        label_smoothing: Cross-entropy's label smoothing (``TrainingArguments.label_smoothing_factor``).
        config: The model's config: its ``problem_type``, where set, decides instead of the rule (read at
            each call, as the model reads it).

    Returns:
        A function ``(model output, labels) -> per-example losses [b]``. Labels the rule's loss cannot take
            are refused when it is called (``ConfigError``), with the rule that applied and what to pass.
    """
    def loss(out: Any, labels: Tensor) -> Tensor:
        logits = _logits(out)
        problem, rule = _problem_type(num_labels, labels, config)
        _check_labels(problem, rule, logits, labels)
        if problem == "regression":
            per = (logits.reshape(len(logits), -1) - labels.reshape(len(labels), -1).to(logits.dtype)) ** 2
            return per.mean(dim=-1)
        if problem == "single_label_classification":
            return nn.functional.cross_entropy(logits.reshape(len(logits), -1), labels.reshape(-1).long(),
                                               reduction="none", label_smoothing=label_smoothing)
        per = nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
        return per.reshape(len(per), -1).mean(dim=-1)
    return loss


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
"""Hugging Face's ``config.problem_type`` values for ``*ForSequenceClassification``."""


def _problem_type(num_labels: int, labels: Tensor, config: Any) -> tuple[str, str]:
    """(the problem type, the rule that chose it, in words): the model's ``config.problem_type`` where set, else
    Hugging Face's rule (regression for ``num_labels == 1``, single-label classification for integer labels,
    multi-label classification otherwise)."""
    given = getattr(config, "problem_type", None)
    if given is not None:
        if given not in PROBLEM_TYPES:
            raise ConfigError(f"the model's config.problem_type is {given!r}; Hugging Face's sequence classification "
                              f"takes one of {', '.join(map(repr, PROBLEM_TYPES))} (or None: chosen from num_labels "
                              f"and the labels' dtype)")
        return given, f"the model's config.problem_type is {given!r}"
    integer = not (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool)
    if num_labels == 1:
        return "regression", "config.problem_type is unset and num_labels == 1, so Hugging Face's rule makes it regression"
    kind = "single_label_classification" if integer else "multi_label_classification"
    return kind, (f"config.problem_type is unset, num_labels == {num_labels} and the labels are {labels.dtype}, so "
                  f"Hugging Face's rule makes it {kind}")


def _check_labels(problem: str, rule: str, logits: Tensor, labels: Tensor) -> None:
    """Refuse labels that ``problem``'s loss cannot take (a raw torch error otherwise, or a loss of another kind
    than meant), saying which rule applied and what to pass. Shapes are said per batch (``[batch, ...]``)."""
    def shape(t: Tensor) -> str:
        return "[" + ", ".join(["batch", *map(str, t.shape[1:])]) + "]"
    fix = ("Pass integer class ids (torch.long, one per example, shape [batch]) for single-label classification, "
           f"one float per class per example (shape {shape(logits)}) for multi-label classification, or set "
           f"model.config.problem_type to one of {', '.join(map(repr, PROBLEM_TYPES))} before training")
    n_out = math.prod(logits.shape[1:])
    if problem == "single_label_classification":
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ConfigError(f"DPTrainer: {rule}, which takes integer class ids (cross-entropy), but the labels are "
                              f"{labels.dtype}. {fix}")
        if math.prod(labels.shape[1:]) != 1:
            raise ConfigError(f"DPTrainer: {rule}, which takes one integer class id per example (shape [batch]), "
                              f"got labels of shape {shape(labels)}. {fix}")
    elif problem == "multi_label_classification":
        if tuple(labels.shape[1:]) != tuple(logits.shape[1:]):
            raise ConfigError(f"DPTrainer: {rule} (binary cross-entropy), which takes one float per class per "
                              f"example (labels of shape {shape(logits)}), got labels of shape {shape(labels)} "
                              f"({labels.dtype}). {fix}")
    elif math.prod(labels.shape[1:]) != n_out or labels.is_complex():
        raise ConfigError(f"DPTrainer: {rule} (squared error), which takes one float per output per example (labels "
                          f"of shape {shape(logits)}), got labels of shape {shape(labels)} ({labels.dtype}). {fix}")


def causal_lm_loss(out: Any, labels: Tensor) -> Tensor:
    """Per-example causal-LM loss: cross-entropy of ``logits[:, t]`` predicting ``labels[:, t + 1]``,
    averaged over each example's target tokens. The mean over a batch of one is the model's own loss.

    Args:
        out: The model's output (its ``logits``, or a logits tensor).
        labels: Token ids ``[b, T]``; -100 is ignored.

    Returns:
        The per-example losses ``[b]`` (0 for an example without any target token).
    """
    logits = _logits(out)
    tok = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=IGNORE,
                                      reduction="none")
    count = (labels[:, 1:] != IGNORE).sum(dim=1)
    return tok.sum(dim=1) / count.clamp(min=1).to(tok.dtype)


def resolve_loss(choice: str | Callable, model: nn.Module, label_smoothing: float) -> Callable:
    """The engine's per-example loss for ``DPArguments.per_example_loss``."""
    if callable(choice):
        return choice
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    if choice == "auto":
        choice = ("sequence_classification" if name.endswith("ForSequenceClassification") else
                  "causal_lm" if name.endswith(("ForCausalLM", "LMHeadModel")) else None)
        if choice is None:
            raise ConfigError(f"DPArguments(per_example_loss='auto') knows *ForSequenceClassification and causal "
                              f"LMs (*ForCausalLM, *LMHeadModel), not {name}: pass per_example_loss=f with "
                              f"f(model output, labels) -> the per-example losses, shape [batch]")
    if choice == "sequence_classification":
        return sequence_classification_loss(int(getattr(base.config, "num_labels", 2)), label_smoothing,
                                            base.config)
    if choice == "causal_lm":
        if label_smoothing:
            raise ConfigError("label_smoothing_factor with per_example_loss='causal_lm' is not supported; set it to 0")
        return causal_lm_loss
    raise ConfigError(f"per_example_loss must be 'auto', 'sequence_classification', 'causal_lm' or a function, "
                      f"got {choice!r}")


class PerExampleIds:
    """A ``data_collator`` wrapper that adds explicit ``position_ids`` (0 .. T-1 in every row) and
    ``token_type_ids`` (zeros) where the batch has none, so that every input has one row per example.
    For models whose default position ids count from 0 (BERT, GPT-2 with right padding), not for
    RoBERTa-style ones that derive them from the padding.

    Args:
        collator: The ``data_collator`` to wrap; its batches must have ``input_ids``.
        token_type_ids: Whether to add ``token_type_ids`` too (default True).
    """

    def __init__(self, collator: Callable, token_type_ids: bool = True) -> None:
        self.collator, self.token_type_ids = collator, token_type_ids

    def __call__(self, items: list) -> dict:
        out = dict(self.collator(items))
        ids = out["input_ids"]
        out.setdefault("position_ids", torch.arange(ids.shape[1]).expand(ids.shape[0], -1).clone())
        if self.token_type_ids:
            out.setdefault("token_type_ids", torch.zeros_like(ids))
        return out


class _KeyedMLM(transformers.DataCollatorForLanguageModeling):
    """Hugging Face's MLM collator with its masks drawn per example from ``clipbias.example_generator``
    (``keyed_collator``): the same rule, token by token."""

    def torch_mask_tokens(self, inputs: Tensor, special_tokens_mask: Any = None, offset_mapping: Any = None):
        labels = inputs.clone()
        if special_tokens_mask is None:
            special_tokens_mask = [self.tokenizer.get_special_tokens_mask(v, already_has_special_tokens=True)
                                   for v in labels.tolist()]
        special = torch.as_tensor(special_tokens_mask).bool()
        b, length = labels.shape
        # row r: example r's own draws (its stream read from the start, row-major over [token, 3]), so its
        # tokens' draws do not depend on the batch's padded length nor on the other rows
        u = torch.stack([example_generator(r).uniform(length, 3, dtype=torch.float64) for r in range(b)]) \
            if b else torch.zeros(0, length, 3, dtype=torch.float64)
        words = torch.stack([example_generator(r).integers(len(self.tokenizer), size=(length,)) for r in range(b)]) \
            if b else torch.zeros(0, length, dtype=torch.long)
        masked = (u[..., 0] < self.mlm_probability) & ~special
        labels[~masked] = IGNORE
        replaced = (u[..., 1] < self.mask_replace_prob) & masked
        inputs[replaced] = self.tokenizer.convert_tokens_to_ids(self.tokenizer.mask_token)
        if self.mask_replace_prob == 1 or self.random_replace_prob == 0:
            return inputs, labels
        random_words = (u[..., 2] < self.random_replace_prob / (1 - self.mask_replace_prob)) & masked & ~replaced
        inputs[random_words] = words[random_words].to(inputs.dtype)
        return inputs, labels


def keyed_collator(collator: Any) -> Any:
    """The collator with its MLM masks keyed per example (``DPTrainer`` applies it to its ``data_collator``).

    Hugging Face's ``DataCollatorForLanguageModeling`` draws its masks from its ``seed``'s generator or
    torch's: those hand out the masks in fetch order, so one example moves the others' masks (the private
    loader's check reports that). The copy draws them from the run's secret key per example and step
    (``clipbias.example_generator``), by the same rule: each non-special token is masked with
    ``mlm_probability``, then replaced by the mask token (``mask_replace_prob``), a random token
    (``random_replace_prob``) or kept.

    Args:
        collator: Any ``data_collator``.

    Returns:
        ``collator`` itself, or where it is a ``DataCollatorForLanguageModeling`` masking tokens for a masked
            LM (``mlm=True``, torch tensors, not whole words) a copy whose masks come from the run's secret key.
    """
    if (type(collator) is not transformers.DataCollatorForLanguageModeling or not collator.mlm
            or getattr(collator, "whole_word_mask", False) or collator.return_tensors != "pt"):
        return collator
    keyed = copy.copy(collator)
    keyed.__class__ = _KeyedMLM
    keyed.seed, keyed.generator = None, None
    return keyed


class PoissonChunks:
    """The Trainer's train "dataloader": each logical batch is a secret Poisson sample drawn by the engine,
    yielded as exactly ``chunks`` (= gradient_accumulation_steps) slices (``Session.batches``), so that the
    Trainer's accumulation loop takes one optimizer step per logical batch. ``len()`` counts chunks."""

    def __init__(self, trainer: "DPTrainer", dataset: Any, collate_fn: Callable, chunks: int,
                 batch_size: float) -> None:
        self.trainer, self.dataset, self.collate_fn, self.chunks = trainer, dataset, collate_fn, chunks
        self.batch_size = batch_size
        self.steps_per_epoch = sampling_epoch_steps(len(dataset), round(batch_size), trainer.args.dataloader_drop_last)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.chunks

    def __iter__(self):
        args, session = self.trainer.args, self.trainer.dp_session
        if session is None:
            raise ConfigError("DPTrainer's private loader draws its batches once training has started: call "
                              "trainer.train()")
        loader = PoissonLoader(session.engine, self.dataset, collate_fn=self.collate_fn,
                               num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
                               prefetch_factor=args.dataloader_prefetch_factor, device="cpu")
        yield from session.batches(loader, self.steps_per_epoch, exact_chunks(self.chunks), check=is_mapping)


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
    """Refuse an evaluation on the training set (the same dataset object, alone or in a dict of eval sets):
    its metrics are statistics of the private training data, computed outside the private step without
    noise, and the Trainer logs them (to every ``report_to``): they would be released outside the guarantee."""
    sets = evaluated.values() if isinstance(evaluated, Mapping) else [evaluated]
    if train is not None and any(d is train for d in sets):
        raise ConfigError("DPTrainer: eval_dataset is the train_dataset: its metrics (loss, accuracy, ...) are "
                          "statistics of the private training data computed without noise, and the Trainer logs "
                          "them, released outside the privacy guarantee. Evaluate on a held-out split (e.g. "
                          "train_test_split) or pass eval_dataset=None; metrics of the training data must stay as "
                          "private as the data")


def show_on_bar(handler: Any, epsilon: float) -> None:
    """``epsilon=`` on the Trainer's progress bar (``ProgressCallback``'s tqdm postfix, as Lightning's bar
    shows it), updated at every training log (``logging_steps``); the log lines it writes carry it too."""
    for callback in getattr(handler, "callbacks", ()):
        bar = getattr(callback, "training_bar", None)
        if isinstance(callback, transformers.trainer_callback.ProgressCallback) and bar is not None:
            bar.set_postfix(epsilon=f"{epsilon:.4g}", refresh=False)


class DPTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains privately (see the module's docstring).

    ``privacy_report()`` states the guarantee; the ``epsilon`` entry of each training log is the epsilon after
    the steps taken so far, at ``dp_args.target_delta`` (the progress bar shows it too). Checkpoints hold the
    engine's private state (``dp_engine.pt``: secret key, sampler, step count) beside the optimizer's: release
    the model's weights, never a checkpoint folder.

    Args:
        *args (Any): ``transformers.Trainer``'s positional arguments (``model``, ``args``, ...).
        dp_args: How private the training is: a
            [`DPArguments`][clipbias.integrations.transformers.DPArguments] (required).
        **kwargs (Any): Every other argument of ``transformers.Trainer``: ``args`` (your ``TrainingArguments``:
            the expected batch is ``per_device_train_batch_size * gradient_accumulation_steps``),
            ``train_dataset`` (map-style: ``len`` and indexing), ``eval_dataset`` (held out, never the
            training set), ``data_collator``, ``optimizers``, ``callbacks``, ...

    Raises:
        ConfigError: transformers below 5; ``dp_args`` missing or refused by ``DPOptions.check``;
            ``TrainingArguments`` the private step cannot run soundly (``fp16``/``bf16``: use
            ``DPArguments(autocast=...)``; DeepSpeed, FSDP or more than one device; ``group_by_length`` or a
            ``train_sampling_strategy`` other than ``"random"``; ``auto_find_batch_size``); a
            ``compute_loss`` override or ``compute_loss_func`` (they give the
            batch's mean loss: pass ``DPArguments(per_example_loss=f)``); a ``train_dataset`` that is not
            map-style (an ``IterableDataset``).
    """

    def __init__(self, *args, dp_args: DPArguments | None = None, **kwargs) -> None:
        if int(transformers.__version__.split(".")[0]) < 5:
            raise ConfigError(f"DPTrainer needs transformers >= 5 (its training loop's hooks), found "
                              f"{transformers.__version__}: pip install -U 'transformers>=5'")
        if not isinstance(dp_args, DPOptions):
            raise ConfigError("DPTrainer needs dp_args=DPArguments(target_epsilon=... or noise_multiplier=..., "
                              f"max_grad_norm=...), got {type(dp_args).__name__}")
        dp_args.check()
        check_training_args(kwargs["args"] if "args" in kwargs else args[1] if len(args) > 1 else None)
        overridden = type(self).compute_loss is not transformers.Trainer.compute_loss
        if kwargs.get("compute_loss_func") is not None or overridden:
            raise ConfigError("compute_loss / compute_loss_func give the batch's mean loss; the engine needs each "
                              "example's loss: pass DPArguments(per_example_loss=f), f(outputs, labels) -> [batch]")
        data = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
        if data is not None and (isinstance(data, torch.utils.data.IterableDataset) or not hasattr(data, "__len__")):
            raise ConfigError("train_dataset must be a map-style dataset (len and indexing): secret Poisson sampling "
                              "draws each of the n examples independently, which a stream cannot offer")
        super().__init__(*args, **kwargs)
        check_training_args(self.args)
        self.dp_args, self.dp_engine, self.dp_session = dp_args, None, None
        self._dp_epsilon = EpsilonLog()

    # ------------------------------------------------------------------ the private batches and step
    @property
    def expected_batch_size(self) -> int:
        """B = per_device_train_batch_size * gradient_accumulation_steps."""
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps

    def get_train_dataloader(self) -> PoissonChunks:
        if self.train_dataset is None:
            raise ConfigError("DPTrainer: training requires a train_dataset")
        dataset, collator = self.train_dataset, keyed_collator(self.data_collator)  # MLM masks keyed per example
        if transformers.utils.is_datasets_available():
            import datasets
            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="Training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="Training")
        return PoissonChunks(self, dataset, collator, self.args.gradient_accumulation_steps, self.expected_batch_size)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Your optimizer (from ``TrainingArguments`` or ``optimizers=``), and the engine that feeds it."""
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if self.dp_engine is None:
            self.dp_engine = self._build_engine(optimizer)
            self.dp_session = Session(self.dp_engine, released=(
                "the training loss the Trainer logs (each private batch's mean example loss, no noise)",
                TIMES_RELEASED, N_RELEASED))
        elif self.dp_engine.optimizer.original is not getattr(optimizer, "optimizer", optimizer):  # (accelerate's)
            raise ConfigError("DPTrainer: the optimizer changed after the private engine was built; one DPTrainer "
                              "trains one run")
        return optimizer

    def _build_engine(self, optimizer: torch.optim.Optimizer) -> DPEngine:
        args, n, B = self.args, len(self.train_dataset), self.expected_batch_size
        check_trainable(self.model)
        steps_per_epoch = sampling_epoch_steps(n, round(B), args.dataloader_drop_last)  # the Trainer's len(dataloader)
        steps = args.max_steps if args.max_steps > 0 else max(1, math.ceil(args.num_train_epochs * steps_per_epoch))
        loss = resolve_loss(self.dp_args.per_example_loss, self.model, args.label_smoothing_factor)
        engine = self.dp_args.engine(self.model, optimizer, n=n, batch_size=B, steps=steps, loss_fn=loss,
                                     max_physical_batch=args.per_device_train_batch_size, stepped=Deferred(optimizer))
        _log.info(f"DPTrainer: {engine.algo.name}, noise multiplier {engine.noise_multiplier:.4g}, expected batch "
                  f"B = {B:g} of n = {n} (q = {engine.sample_rate:.4g}), clip {engine.config.clip:g}, delta "
                  f"{engine.delta:.3g}; per-example gradients: {engine.grad_path_note}")
        return engine

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None) -> Tensor:
        """One chunk of the logical Poisson batch; at its last chunk, the private step on the whole batch
        (the private update is left in ``.grad`` for the optimizer step).

        Args:
            model: The model being trained.
            inputs: The chunk (the Trainer's batch; the engine steps on the whole logical batch it belongs to).
            num_items_in_batch: Unused (the Trainer's token count).

        Returns:
            The batch's mean example loss at the last chunk, 0 before (the Trainer sums them per optimizer
                step).

        Raises:
            ConfigError: a batch that the private data loader did not draw (train with ``trainer.train()``).
        """
        session = self.dp_session
        pending = session.pending if session is not None else None
        if pending is None:
            raise ConfigError("DPTrainer.training_step got a batch that its private data loader did not draw: "
                              "train with trainer.train(), whose batches come from get_train_dataloader()")
        pending.seen += 1  # (the Trainer fetches a step's chunks before its first training_step: count the calls)
        if pending.seen < pending.chunks:  # an earlier chunk of the logical batch: the step comes at its last
            return torch.zeros((), device=self.args.device)
        session.pending = None
        session.watch.check()  # (the optimizer's settings and state as the batch was drawn: ``OptimizerWatch``)
        model.train()
        x, y = self._split_labels(pending.data)
        x, y = self._prepare_input(x), self._prepare_input(y)
        losses = self.dp_engine.step(x, y, pending.indices)  # chunks changed in place: uncertified (engine.drawn)
        return (losses.sum() / max(len(losses), 1)).detach().to(self.args.device)

    def _split_labels(self, data: Mapping) -> tuple[dict, Tensor]:
        names = [k for k in (self.label_names or ["labels"]) if k in data]
        if len(names) != 1:
            raise ConfigError(f"DPTrainer needs exactly one label entry in each batch (label_names "
                              f"{self.label_names}); the batch has keys {sorted(data)}")
        return {k: v for k, v in data.items() if k != names[0]}, data[names[0]]

    def train(self, *args, **kwargs):
        """``Trainer.train`` (same arguments, e.g. ``resume_from_checkpoint``).

        Raises:
            ConfigError: where it would do nothing or release statistics of the training data: a second call
                once the planned steps are all taken, and evaluation on the training set during it.
        """
        engine = self.dp_engine
        if engine is not None and engine.steps_taken >= engine.total_steps:
            raise ConfigError(
                f"DPTrainer: the {engine.total_steps} steps this run planned (max_steps or num_train_epochs of "
                f"TrainingArguments; target_epsilon calibrated the noise for them) are all taken, so train() would "
                f"run 0 steps. To train longer, plan it from the start: a new DPTrainer with a larger max_steps or "
                f"num_train_epochs (the noise is then calibrated for the longer run), or "
                f"DPArguments(noise_multiplier=...), a run without a planned end that each train() continues. A new "
                f"run that starts from these trained weights adds its epsilon to this run's")
        if str(getattr(self.args.eval_strategy, "value", self.args.eval_strategy)) != "no":
            check_eval_data(self.train_dataset, self.eval_dataset)
        return super().train(*args, **kwargs)

    def evaluate(self, eval_dataset: Any = None, *args, **kwargs) -> dict:
        """``Trainer.evaluate`` (same arguments).

        Raises:
            ConfigError: evaluation on the training set (``check_eval_data``).
        """
        check_eval_data(self.train_dataset, eval_dataset if eval_dataset is not None else self.eval_dataset)
        return super().evaluate(eval_dataset, *args, **kwargs)

    def floating_point_ops(self, inputs: dict) -> int:
        """0: the Trainer's count (``total_flos``, logged) is 6 x parameters x the tokens of each private batch,
        the sum of the batches' sizes and padded lengths, a statistic of the private data."""
        return 0

    def _clip_grad_norm(self, model):
        """No clipping of the batch gradient: each example's gradient was clipped to ``max_grad_norm`` of
        ``DPArguments`` before the noise; the logged ``grad_norm`` is the private update's norm."""
        return None

    # ------------------------------------------------------------------ privacy, logs, checkpoints
    def privacy_report(self) -> PrivacyReport:
        """The guarantee after the steps taken.

        Returns:
            The ``PrivacyReport``: epsilon, delta, accountant, basis, ``certified``, caveats.

        Raises:
            ConfigError: no private step yet (call ``train()`` first).
        """
        if self.dp_session is None:
            raise ConfigError("DPTrainer.privacy_report: no private step yet; call train() first")
        return self.dp_session.report()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.dp_engine is not None and ("loss" in logs or "train_loss" in logs):
            logs["epsilon"] = self._dp_epsilon(self.dp_engine)
            show_on_bar(self.callback_handler, logs["epsilon"])
        super().log(logs, start_time)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.dp_engine is not None and self.args.should_save:
            torch.save(self.dp_engine.state_dict(), os.path.join(output_dir, DP_STATE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.dp_engine is None:
            return
        path = os.path.join(checkpoint, DP_STATE)
        if not os.path.isfile(path):
            raise ConfigError(f"{checkpoint} holds no private state ({DP_STATE}): resuming would restart the "
                              f"accounting at step 0 and reuse no key; resume only from a DPTrainer checkpoint")
        self.dp_engine.load_state_dict(torch.load(path, weights_only=False))

    def _init_training_state(self, *args, **kwargs):
        """On resume nothing is fast-forwarded: the engine's sampler continues from its saved state."""
        epochs_trained, _ = super()._init_training_state(*args, **kwargs)
        return epochs_trained, 0


_log = transformers.utils.logging.get_logger(__name__)
