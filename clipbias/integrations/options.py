"""The differential-privacy settings of every integration (``DPOptions``: ``DPArguments``, ``DPCallback``, and
``make_private``'s arguments and clipbias keywords, ``opacus_settings``), their checks, and the one way all three
turn them into a ``DPEngine`` over the user's model and optimizer (``DPOptions.build``).

Every integration hands the engine the user's own optimizer (``DPEngine(optimizer=...)``), so learning-rate
schedulers, weight-decay groups and the optimizer's checkpoint stay the framework's; the engine draws the
batches (its secret Poisson sampler), computes and clips the per-example gradients, adds the noise and
accounts every step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch
from torch import nn

from .. import algorithms, privacy
from ..config import AlgoConfig
from ..engine import DPEngine
from ..errors import ConfigError
from ..grads.precision import check_autocast


class AccountantNames(Mapping):
    """The names the integrations' ``accountant=`` takes -> the registered accountant that serves each:
    Opacus's ``prv`` (Gopi et al.'s numerical composition of privacy-loss distributions) is clipbias's
    ``pld``, the same object computed by dp-accounting, and every accountant of the registry
    (``privacy.ACCOUNTANTS``: ``pld``, ``rdp`` and any registered later) by its own name. Read from the
    registry at each use, so an accountant registered after this module was imported is taken by
    ``PrivacyEngine``, ``DPOptions`` (``DPArguments``, ``DPCallback``) alike. Opacus's ``gdp`` (a
    central-limit approximation, not an upper bound) is none of them: refused."""

    OPACUS = {"prv": "pld"}  # Opacus's names for a registered accountant

    def _names(self) -> dict[str, str]:
        registry = privacy.ACCOUNTANTS
        return {**{k: v for k, v in self.OPACUS.items() if v in registry}, **{n: n for n in registry}}

    def __getitem__(self, name: str) -> str:
        return self._names()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return f"AccountantNames({self._names()!r})"


ACCOUNTANTS = AccountantNames()
"""``prv``, ``pld``, ``rdp`` and every accountant registered later -> the registered accountant that serves it."""


def engine_config(optimizer: torch.optim.Optimizer, clip: float, ef_clip: float | None,
                  settings: dict | None) -> AlgoConfig:
    """The engine's settings over the user's optimizer: the clip, the algorithm's settings, and what the
    engine reads of the optimizer (its family and SGD's momentum shape banded noise; lr is unused)."""
    group = optimizer.param_groups[0]
    return AlgoConfig(lr=float(group.get("lr", 0.1)) or 0.1, clip=float(clip), ef_clip=ef_clip,
                      optimizer=_base_kind(optimizer), momentum=float(group.get("momentum", 0.0) or 0.0),
                      extra=dict(settings or {}))


def _base_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """The engine's name for the optimizer's family where it has one (banded noise shapes its coefficients for
    SGD's momentum); any other optimizer is used as it is."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer (SGD, Adam, ...), got {type(optimizer).__name__}")
    return {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}.get(type(optimizer), "adam")


def default_delta(n: int) -> float:
    """Every integration's delta where none is given: ``min(1e-5, 1 / (10 n))`` for ``n`` training examples
    (a delta well below 1 / n: a mechanism that released one example in the clear would have delta 1 / n)."""
    return min(1e-5, 1.0 / (10 * n))


@dataclass
class DPOptions:
    """How private the training is: the settings ``DPArguments`` (Hugging Face) and ``DPCallback`` (Lightning)
    share. Give exactly one of ``target_epsilon`` and ``noise_multiplier``.

    Args:
        target_epsilon: The epsilon the run ends at: the noise multiplier is calibrated so that the planned
            steps end at it or just below (the steps must be known in advance: epochs or max_steps).
        noise_multiplier: The noise multiplier z, fixed; epsilon is accounted as the steps are taken (the
            run is open-ended).
        target_delta: Delta of the guarantee; default ``min(1e-5, 1 / (10 n))`` for ``n`` training examples.
        max_grad_norm: The per-example clipping norm C.
        algorithm: ``"dpsgd"`` (default), ``"dice"``, ``"adaptive"``, ...: clipbias's algorithms with
            per-example rows (not the non-private ones, nor those that need public features).
        grad_path: How the per-example gradients are computed: ``"auto"`` (default), ``"rows"``
            (``torch.func``) or ``"fast"`` (book-keeping, no per-example rows).
        accountant: ``"pld"`` (default; ``"prv"`` is the same), ``"rdp"`` or any accountant registered in
            ``clipbias.privacy.accountants`` (``ACCOUNTANTS``), by its name.
        dice_accounting: The bound error feedback (``algorithm="dice"``, ...) is accounted by: ``"sound"``
            (default, proven), ``"conservative"``, or ``"paper"`` / ``"authors"`` (kept to reproduce the
            paper, reported uncertified).
        bands: Banded correlated noise: the number of bands (default 1, independent noise), or with
            ``bands_strategy="blt"`` the number of BLT participation classes (``DPEngine``'s).
        bands_strategy: The banded noise's coefficients, ``"taylor"`` (default) or ``"optimized"``, or
            ``"blt"``: BLT noise (``DPEngine``'s).
        settings: The algorithm's own settings (``AlgoConfig.extra``).
        ef_clip: The error-feedback clip C2 of the DiceSGD family (``AlgoConfig.ef_clip``; default
            C2 = 0.01 C1 / B, feedback ratio r = 0.01).
        noise_seed: Reproducible batches and noise, for tests; the run is then reported uncertified.
        autocast: ``"bfloat16"`` / ``"float16"`` (or the torch dtypes): runs each step's forward and backward
            under ``torch.autocast`` with norms, clip factors and sums in float32 (``DPEngine(autocast=...)``).
        loss_scale: The float16 loss scale of ``autocast``, a power of two (default 256).
    """

    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    target_delta: float | None = None
    max_grad_norm: float = 1.0
    algorithm: str = "dpsgd"
    grad_path: str = "auto"
    accountant: str = "pld"
    dice_accounting: str = privacy.DEFAULT_DICE_ACCOUNTING
    bands: int = 1
    bands_strategy: str = "taylor"
    settings: dict = field(default_factory=dict)
    ef_clip: float | None = None
    noise_seed: int | None = None
    autocast: str | torch.dtype | None = None
    loss_scale: float | None = None

    def check(self) -> None:
        """Refuse settings that cannot make a private run, before anything is built.

        Raises:
            ConfigError: both or neither of ``target_epsilon`` and ``noise_multiplier``; a non-positive or
                non-finite number; ``target_delta`` outside (0, 1); an unknown accountant, algorithm or
                ``grad_path``; a non-private algorithm or one that needs public features; an ``autocast`` /
                ``loss_scale`` the engine does not take.
        """
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ConfigError("give exactly one of target_epsilon (the noise is calibrated to it) and "
                              f"noise_multiplier; got target_epsilon={self.target_epsilon!r}, "
                              f"noise_multiplier={self.noise_multiplier!r}")
        check_positive((name, getattr(self, name)) for name in ("target_epsilon", "noise_multiplier", "max_grad_norm"))
        if self.target_delta is not None:
            privacy.check_delta(self.target_delta, "target_delta")
        check_accountant(self.accountant)
        if self.algorithm not in algorithms.ALGORITHMS:
            raise ConfigError(f"algorithm {self.algorithm!r} is not a clipbias algorithm; choose one of "
                              f"{', '.join(algorithms.ALGORITHMS)}")
        algo = algorithms.get(self.algorithm)
        if not algo.private:
            raise ConfigError(f"algorithm {self.algorithm!r} is not private (no noise): use dpsgd, dice, ...")
        if algo.needs_public:
            raise ConfigError(f"algorithm {self.algorithm!r} needs public features beside the private data; it "
                              f"runs from `TrainConfig` (`public_size`) or the clipbias CLI")
        if self.grad_path not in ("auto", "rows", "fast"):
            raise ConfigError(f"grad_path must be auto, rows or fast, got {self.grad_path!r}")
        check_autocast(self.autocast, self.loss_scale)

    def delta(self, n: int) -> float:
        """The run's delta.

        Args:
            n: The number of training examples.

        Returns:
            ``target_delta``, or where it is None ``min(1e-5, 1 / (10 n))``.
        """
        return self.target_delta if self.target_delta is not None else default_delta(n)

    def engine(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, n: int, batch_size: float,
               steps: int | None, loss_fn: Callable, max_physical_batch: int,
               stepped: torch.optim.Optimizer | None = None) -> DPEngine:
        """A ``DPEngine`` over ``model`` stepping ``optimizer``, with these settings.

        Args:
            model: The model; its trainable parameters are the ones trained.
            optimizer: A ``torch.optim.Optimizer`` holding exactly the trainable parameters.
            n: The number of training examples.
            batch_size: The expected (Poisson) batch size B.
            steps: The steps planned: needed with ``target_epsilon``; with ``noise_multiplier`` the run is
                open-ended.
            loss_fn: The per-example loss the engine differentiates.
            max_physical_batch: Examples per per-example gradient computation (memory only).
            stepped: What the engine steps in place of ``optimizer`` (a view of it that leaves the update for
                the framework to apply); default ``optimizer``.

        Returns:
            The ``DPEngine``, its noise calibrated where ``target_epsilon`` was given.

        Raises:
            ConfigError: a model without a trainable parameter; what ``check`` refuses; ``target_epsilon``
                without ``steps``; an optimizer that is not a ``torch.optim.Optimizer``.
        """
        check_trainable(model)
        self.check()
        if self.target_epsilon is not None and not steps:
            raise ConfigError("target_epsilon needs the number of steps in advance (epochs or max_steps)")
        _base_kind(optimizer)  # refuses anything but a torch optimizer, naming it
        return self.build(model, optimizer, n=n, batch_size=batch_size, steps=steps, loss_fn=loss_fn,
                          max_physical_batch=max_physical_batch, stepped=stepped)

    def build(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, n: int, batch_size: float,
              steps: int | None, loss_fn: Callable, max_physical_batch: int,
              stepped: torch.optim.Optimizer | None = None, engine_class: type = DPEngine) -> DPEngine:
        """The ``DPEngine`` of these settings, with the arguments of ``engine``, as they are: ``engine`` checks
        them first; the Opacus interface checks ``make_private``'s arguments in its own words and builds its
        engine (``engine_class``, whose errors speak Opacus's names) here.

        Returns:
            The ``engine_class`` over ``model``, its delta ``delta(n)`` and its planned ``steps`` only where the
            noise is calibrated to ``target_epsilon``.
        """
        config = engine_config(optimizer, self.max_grad_norm, self.ef_clip, self.settings)
        return engine_class(model, self.algorithm, n=n, batch_size=batch_size,
                            steps=steps if self.target_epsilon is not None else None,
                            epsilon=self.target_epsilon, noise_multiplier=self.noise_multiplier, delta=self.delta(n),
                            accountant=ACCOUNTANTS[self.accountant], dice_accounting=self.dice_accounting,
                            config=config, loss_fn=loss_fn, optimizer=stepped or optimizer, grad_path=self.grad_path,
                            bands=self.bands, bands_strategy=self.bands_strategy,
                            max_physical_batch=max_physical_batch, noise_seed=self.noise_seed,
                            autocast=self.autocast, loss_scale=self.loss_scale)


def check_trainable(model: nn.Module) -> None:
    """Refuse a model with no trainable parameter."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("the model has no trainable parameter (requires_grad=True): nothing to train")


def check_positive(named: Iterable[tuple[str, Any]], what: str = "a positive number") -> None:
    """Refuse a value (of ``(name, value)`` pairs; None: not given) that is not a positive finite number."""
    for name, value in named:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ConfigError(f"{name} must be {what}, got {value!r}")


def check_count(name: str, value: Any) -> None:
    """Refuse a count (``epochs``, ``max_physical_batch``, ...) that is not an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def check_accountant(name: str, why: bool = False) -> None:
    """Refuse an accountant ``ACCOUNTANTS`` does not name (``why``: saying why ``gdp`` is none of them)."""
    if name not in ACCOUNTANTS:
        raise ConfigError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {name!r}"
                          + ("; gdp is a central-limit approximation, not an upper bound on epsilon"
                             if why and name == "gdp" else ""))


# ---------------------------------------------------------------------- make_private's (the Opacus interface)
OPACUS_OWN = ("delta", "public_clip", "max_physical_batch")
"""``make_private``'s clipbias keywords that are not ``DPOptions`` settings: ``delta`` is ``target_delta``."""

OPACUS_KEYWORDS = frozenset(f.name for f in fields(DPOptions)) - {
    "target_epsilon", "noise_multiplier", "target_delta", "max_grad_norm", "accountant"} | set(OPACUS_OWN)
"""The clipbias keywords ``make_private`` takes (``**clipbias_options``)."""


def opacus_settings(extra: dict, *, noise_multiplier: float | None, epsilon: float | None, delta: float | None,
                    max_grad_norm: float, accountant: str) -> dict:
    """The ``DPOptions`` keywords of a ``make_private`` call: its arguments and its clipbias keywords (``extra``;
    ``delta`` where ``target_delta`` is not given), the accountant by the registered name that serves it."""
    return dict(noise_multiplier=noise_multiplier, target_epsilon=epsilon, max_grad_norm=max_grad_norm,
                target_delta=delta if delta is not None else extra.get("delta"), accountant=ACCOUNTANTS[accountant],
                **{k: v for k, v in extra.items() if k not in OPACUS_OWN})


def check_opacus_keywords(extra: dict) -> None:
    """Refuse a clipbias keyword ``make_private`` does not take, a non-private algorithm (its ``noise_multiplier``
    would be ignored; the other adapters refuse it too) and one that needs public features."""
    unknown = set(extra) - OPACUS_KEYWORDS
    if unknown:
        raise ConfigError(f"make_private got unexpected keyword(s) {sorted(unknown)}")
    algorithm = extra.get("algorithm", "dpsgd")
    algo = algorithms.get(algorithm)
    if not algo.private:
        raise ConfigError(f"algorithm={algorithm!r} is not private (no noise: noise_multiplier would be ignored); "
                          f"make_private trains privately: use dpsgd, dice, ...")
    if algo.needs_public:
        raise ConfigError(f"algorithm={algorithm!r} needs public features beside the private data; it runs from "
                          f"`TrainConfig` (`public_size`) or the clipbias CLI, not through make_private")


def resolve_public_clip(extra: dict, follow: bool) -> bool:
    """``make_private``'s ``public_clip``: by default True where the step follows the loop's loss (``follow``),
    as Opacus clips every row that passes through the wrapped module, generated rows included (False: the
    public term exact); refused where a ``criterion`` is differentiated instead."""
    clip = follow if extra.get("public_clip") is None else extra["public_clip"]
    if not isinstance(clip, bool) or (clip and not follow):
        raise ConfigError(f"public_clip must be True or False, got {clip!r}" if not isinstance(clip, bool) else
                          "public_clip clips the rows of your loop's public forwards; with criterion= the step "
                          "differentiates criterion on the private batch alone: leave one of them out")
    return clip
