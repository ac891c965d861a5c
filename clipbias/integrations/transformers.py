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
import dataclasses
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
from .losses import causal_lm_loss, resolve_loss, sequence_classification_loss
from .options import DPOptions
from .refusals import check_eval_data, check_map_style, check_training_args
from .released import TRAINER_RELEASED
from .session import Deferred, ReleasedUpdate, Session, chunk_taken, epoch_steps, exact_chunks, is_mapping

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

    def __init__(self, trainer: "DPTrainer", dataset: Any, collate_fn: Callable) -> None:
        self.trainer, self.dataset, self.collate_fn = trainer, dataset, collate_fn
        self.chunks, self.batch_size = trainer.args.gradient_accumulation_steps, trainer.expected_batch_size
        self.steps_per_epoch = trainer.steps_per_epoch

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
        check_map_style(kwargs.get("train_dataset", args[3] if len(args) > 3 else None))
        super().__init__(*args, **kwargs)
        check_training_args(self.args)
        self.dp_args, self.dp_engine, self.dp_session, self.dp_released = dp_args, None, None, None

    # ------------------------------------------------------------------ the private batches and step
    @property
    def expected_batch_size(self) -> int:
        """B = per_device_train_batch_size * gradient_accumulation_steps."""
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps

    @property
    def steps_per_epoch(self) -> int:
        """The optimizer steps of one epoch, as the Trainer's ``len(dataloader)`` counts them (``epoch_steps``)."""
        return epoch_steps(len(self.train_dataset), self.expected_batch_size, self.args.dataloader_drop_last)

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
        return PoissonChunks(self, dataset, collator)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Your optimizer (from ``TrainingArguments`` or ``optimizers=``), and the engine that feeds it."""
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if self.dp_engine is None:
            self.dp_engine = self._build_engine(optimizer)
            self.dp_session = Session(self.dp_engine, released=TRAINER_RELEASED)
            self.dp_released = ReleasedUpdate(optimizer)
        elif self.dp_engine.optimizer.original is not getattr(optimizer, "optimizer", optimizer):  # (accelerate's)
            raise ConfigError("DPTrainer: the optimizer changed after the private engine was built; one DPTrainer "
                              "trains one run")
        return optimizer

    def _build_engine(self, optimizer: torch.optim.Optimizer) -> DPEngine:
        args, n, B = self.args, len(self.train_dataset), self.expected_batch_size
        epochs = args.num_train_epochs
        steps = args.max_steps if args.max_steps > 0 else max(1, math.ceil(epochs * self.steps_per_epoch))
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
        if self.dp_session is None or self.dp_session.pending is None:
            raise ConfigError("DPTrainer.training_step got a batch that its private data loader did not draw: "
                              "train with trainer.train(), whose batches come from get_train_dataloader()")
        pending = chunk_taken(self.dp_session)  # (the Trainer fetches a step's chunks before its first training_step)
        if pending is None:  # an earlier chunk of the logical batch: the step comes at its last
            return torch.zeros((), device=self.args.device)
        model.train()
        x, y = self._split_labels(pending.data)
        x, y = self._prepare_input(x), self._prepare_input(y)
        self.dp_released.check_between()  # (the parameters as the last optimizer step left them)
        losses = self.dp_engine.step(x, y, pending.indices)  # chunks changed in place: uncertified (engine.drawn)
        self.dp_released.left_update()  # (optimizer.step() finds the update as left: session.ReleasedUpdate)
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
        out = super().train(*args, **kwargs)
        if self.dp_released is not None:  # (the last optimizer step's parameters, as training ends)
            self.dp_released.check_between()
        return out

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
        report = self.dp_session.report()
        written = getattr(self.dp_released, "written", None)
        return report if written is None else dataclasses.replace(report, certified=False,
                                                                   caveats=(*report.caveats, written))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.dp_engine is not None and ("loss" in logs or "train_loss" in logs):
            logs["epsilon"] = self.dp_session.epsilon()
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
