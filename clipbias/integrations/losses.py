"""The per-example losses the engine differentiates for the integrations: a ``criterion`` the user passes
(the Opacus interface, ``DPCallback``) as the engine's loss (``loss_function``), and the losses of Hugging Face
models (``DPArguments.per_example_loss``: ``sequence_classification_loss``, ``causal_lm_loss``,
``resolve_loss``), each a function ``(model output, targets) -> [batch]`` of one loss per example."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..data.text import IGNORE
from ..errors import ConfigError
from ..grads.rows import cross_entropy, output_gradient


def loss_function(criterion: Callable | None, follow: bool = False) -> Callable:
    """The engine's per-example loss: with ``follow`` (no ``criterion``), the loss the training loop computes,
    through the gradient its ``loss.backward()`` leaves in the outputs (``output_gradient``); for ``criterion``:
    Opacus's default ``nn.CrossEntropyLoss()`` is the
    engine's own cross-entropy; a loss module with ``reduction`` is evaluated with ``reduction="none"`` and
    each example's losses averaged over its other dimensions (tokens, pixels); an elementwise loss
    (``ELEMENTWISE``: BCE, MSE, L1, ...) takes the loader's targets in the output's shape and dtype where they
    hold one value per output element (``y.float().unsqueeze(1)``, what a loop writes for a ``[b, 1]`` logit:
    torch would refuse them, or broadcast ``[b]`` against ``[b, 1]`` to ``[b, b]`` in silence); any other
    callable is evaluated one example at a time."""
    if follow:
        return output_gradient
    if criterion is None or (type(criterion) is nn.CrossEntropyLoss and criterion.weight is None
                             and criterion.ignore_index == -100 and criterion.label_smoothing == 0):
        return cross_entropy
    if not callable(criterion):
        raise ConfigError(f"criterion must be callable (a loss module or function), got {type(criterion).__name__}")
    if isinstance(criterion, nn.Module) and hasattr(criterion, "reduction"):
        per_element = copy.copy(criterion)
        per_element.reduction = "none"

        elementwise = isinstance(criterion, ELEMENTWISE)

        def per_example(out: Tensor, y: Tensor) -> Tensor:
            if elementwise and isinstance(out, Tensor) and isinstance(y, Tensor) and y.shape != out.shape \
                    and y.numel() == out.numel():
                y = y.reshape(out.shape).to(out.dtype)
            loss = per_element(out, y)
            return loss.reshape(loss.shape[0], -1).mean(1) if loss.dim() > 1 else loss
        per_example.batched = True  # takes the whole batch (``_criterion_gradient``)
        return per_example
    return criterion


ELEMENTWISE = (nn.BCEWithLogitsLoss, nn.BCELoss, nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss)
"""Losses of one target per output element (``loss_function`` gives them the targets in the output's shape)."""


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
