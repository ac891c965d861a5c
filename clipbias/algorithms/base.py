"""One ``Algorithm`` type and the registry: the bottom of ``clipbias.algorithms``.

An algorithm is data, not a subclass: its settings (``Setting``), a ``build`` that assembles the
pipeline's stages (``Parts``), optionally its own ``RowSource`` (rows that are not plain
per-example gradients), and its accounting (kind, sensitivity read off the last bounding stage,
DiceSGD units). Every method module registers its algorithms with ``register``; the catalog
(``clipbias.algorithms``) imports the modules. Nothing here imports the catalog.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from ..config import AlgoConfig, Setting, read_settings
from ..errors import ConfigError
from ..grads.rows import FuncGradients, LossFn, PerExampleRows, RowSource
from ..privacy import AccountingSpec, DiceParams
from ..privacy.dice import default_ef_clip
from ..randomness import SecretKey
from ..registry import Registry
from ..step import BLTNoise, Clip, ErrorFeedback, GaussianNoise, Normalize, PerSample, Pipeline, Stage
from .bands import banded_spec


@dataclass(frozen=True)
class Parts:
    """What ``Algorithm.build`` returns.

    Attributes:
        per_sample: The per-example stages, in order; the last one bounds the norm (a ``Clip`` or
            ``Normalize``).
        error_feedback: The error feedback, if any (DiceSGD).
        post: A stage applied after the noise, if any.
        divisor: The divisor of the summed rows (None: the expected batch size B).
    """

    per_sample: list[PerSample]
    error_feedback: ErrorFeedback | None = None
    post: Stage | None = None
    divisor: float | None = None


Build = Callable[[AlgoConfig, dict, float, "SecretKey | None"], Parts]  # (config, settings, B, key of the stage draws)
Source = Callable[..., RowSource]  # (model, loss_fn, config, settings, *, n, batch_size, key)


def _c1_c2(cfg: AlgoConfig) -> tuple[float, float]:
    return cfg.clip, cfg.c2


@dataclass(frozen=True)
class Algorithm:
    """A named recipe: data, not a subclass (registered with ``register``).

    Attributes:
        name: The algorithm's name; names match the ``--algo`` values of the CLI.
        description: What it is, in a few words (written to results.json).
        private: Whether it adds noise (False: a non-private baseline, epsilon = inf).
        accounting: ``"gaussian"``, ``"dice"`` or ``"none"``: the kind of its ``AccountingSpec``.
        build: ``build(cfg, settings, B, key)`` returns the ``Parts`` (``key``: the run's ``SecretKey`` for
            the stages' secret draws; None where only the structure is read).
        schema: Its method settings (``Setting``), read from ``AlgoConfig.extra``; unknown keys are refused.
        source: ``source(model, loss_fn, cfg, settings, n=, batch_size=, key=)`` gives the row source (None:
            per-example gradients).
        optimizer: The base optimizer it uses unless ``AlgoConfig.optimizer`` says otherwise (default
            ``"sgd"``).
        certifiable: False where even the paper's (refuted) DiceSGD proof does not apply;
            ``why_not_certifiable`` says why.
        why_not_certifiable: Why ``certifiable`` is False, in words.
        dice_units: ``dice_units(cfg)`` gives (C1, C2) of DiceSGD's accounting (default
            ``(cfg.clip, cfg.c2)``).
        dice_grad_bound: ``dice_grad_bound(cfg, settings)`` gives the G_max DiceSGD's accounting may use
            (default ``cfg.grad_bound``).
        validate: ``validate(cfg, settings, q, B)`` refuses settings the guarantee does not cover.
        note: ``note(cfg, settings)`` states the sensitivity and sampling in words.
        gradient_noise: ``gradient_noise(cfg, settings, z, B)``: the gradient noise multiplier when the
            accounted z also pays for another release (adaptive clipping).
        bandable: Its rows are a function of one example and one step (no state across steps in the rows or
            the sums), it releases only the noisy update and one stage bounds the rows: the banded
            accounting covers it (``algorithms.bands``), so its noise may have more than one band.
        composable: It is a base of ``compose`` (pre-clipping perturbation, self-augmentation): its rows are
            per-example gradients (no ``source``) and its one per-example stage bounds them, so the pieces keep
            its sensitivity and accounting.
    """

    name: str
    description: str
    private: bool
    accounting: str  # 'gaussian' | 'dice' | 'none'
    build: Build
    schema: tuple[Setting, ...] = ()
    source: Source | None = None
    optimizer: str = "sgd"
    certifiable: bool = True
    why_not_certifiable: str = ""
    dice_units: Callable[[AlgoConfig], tuple[float, float]] = _c1_c2
    dice_grad_bound: Callable[[AlgoConfig, dict], float | None] | None = None
    validate: Callable[[AlgoConfig, dict, float, float], None] | None = None
    note: Callable[[AlgoConfig, dict], str] | None = None
    # the gradient noise multiplier when the accounted z also pays for another release (adaptive clipping)
    gradient_noise: Callable[[AlgoConfig, dict, float, float], float] | None = None
    # its rows are a function of one example and one step (no state across steps in the rows or the sums),
    # it releases only the noisy update and one stage bounds the rows: the banded accounting covers it
    # (``algorithms.bands``), so its noise may have more than one band
    bandable: bool = False
    composable: bool = False  # a base of ``compose``: rows of per-example gradients, one bounding stage

    def settings(self, cfg: AlgoConfig) -> dict:
        """The validated method settings of ``cfg.extra`` (unknown keys refused)."""
        return read_settings(self.name, self.schema, cfg)

    @property
    def needs_public(self) -> bool:
        """Whether the algorithm reads public features (``AlgoConfig.extra['public']``)."""
        return any(s.key == "public" for s in self.schema)

    def parts(self, cfg: AlgoConfig, expected_batch_size: float = 1.0, key: SecretKey | None = None) -> Parts:
        return self.build(cfg, self.settings(cfg), expected_batch_size, key)

    def with_defaults(self, cfg: AlgoConfig, expected_batch_size: float) -> AlgoConfig:
        """``cfg`` with what the accounting needs filled in: DiceSGD's feedback clip C2 (``ef_clip``), when
        not given, the one of ``privacy.dice.default_ef_clip`` (r = B C2 / C1 = 0.01)."""
        if self.accounting == "dice" and cfg.ef_clip is None:
            return replace(cfg, ef_clip=default_ef_clip(cfg.clip, expected_batch_size))
        return cfg

    def check_bands(self, bands: int) -> None:
        """Refuse noise of ``bands`` > 1 bands where the banded accounting does not cover the algorithm."""
        if bands != 1 and not self.bandable:
            names = sorted(n for n, a in ALGORITHMS.items() if a.bandable)
            raise ConfigError(f"`bands={bands}` is not available for {self.name}: banded noise is accounted for "
                              f"algorithms whose rows depend on one example at one step and that release only the "
                              f"noisy update ({', '.join(names)}, and each with +disk); error feedback, adaptive "
                              f"clipping, per-example momentum, inner-outer momentum and group clipping carry an "
                              f"example's gradient across steps, release more or mix examples in a row "
                              f"(docs/privacy.md, \"Banded noise\")")

    def workload_momentum(self, cfg: AlgoConfig) -> float:
        """The momentum the banded noise's coefficients are shaped for: the base SGD's (0 for Adam)."""
        return cfg.momentum if (cfg.optimizer or self.optimizer) == "sgd" else 0.0

    def pipeline(self, cfg: AlgoConfig, expected_batch_size: float, z: float, key: SecretKey,
                 coefs: tuple[float, ...] = (1.0,), strategy: str = "taylor") -> Pipeline:
        """The update rule; the noise std is ``z * sensitivity / divisor``, its coefficients ``coefs`` (one
        band: independent noise; more: banded noise whose coefficients ``strategy`` named, refused where
        ``bandable`` is not declared); ``key`` keys the noise and the stages' secret draws."""
        parts = self.parts(cfg, expected_batch_size, key)
        reference = [Clip(cfg.grad_bound)] if cfg.grad_bound is not None else []
        div = parts.divisor if parts.divisor is not None else expected_batch_size
        p = Pipeline(parts.per_sample, div, reference, parts.error_feedback, post=parts.post)
        from .blt import BLT
        blt = coefs if isinstance(coefs, BLT) else None
        self.check_bands(blt.classes if blt is not None else len(coefs))
        if self.private:
            if p.sensitivity is None:
                raise ConfigError(f"{self.name}: no stage bounds the per-example norm")
            zg = self.gradient_noise(cfg, self.settings(cfg), z, expected_batch_size) if self.gradient_noise else z
            # a moving bound (adaptive clipping): the noise follows it
            per_bound = zg / div if p.per_sample[-1].dynamic else None
            std = zg * p.sensitivity / div
            p.noise = BLTNoise(std, key, blt) if blt is not None else \
                GaussianNoise(std, key, coefs, strategy, per_bound)
        return p

    def spec(self, cfg: AlgoConfig, sample_rate: float, z: float, expected_batch_size: float,
             bands: int = 1, shape=None) -> AccountingSpec:
        """The accounting description: kind, rate, z, the numeric sensitivity and why it holds; with noise
        of ``bands`` > 1 bands, the banded accounting (``bands.banded_spec``), or with ``shape`` a BLT
        strategy (``blt.BLT``), BLT noise's."""
        self.check_bands(bands)
        s = self.settings(cfg)
        if self.validate is not None:
            self.validate(cfg, s, sample_rate, expected_batch_size)
        if not self.private:
            return AccountingSpec("none", sample_rate)
        per_sample = self.build(cfg, s, expected_batch_size, None).per_sample
        if not per_sample or per_sample[-1].bound is None:
            last = type(per_sample[-1]).__name__ if per_sample else "none"
            raise ConfigError(f"{self.name}: the last per-example stage ({last}) bounds no norm; it must be "
                              f"a Clip or Normalize")
        last = per_sample[-1]
        note = (self.note(cfg, s) if self.note is not None else
                f"per-example L2 sensitivity {last.bound:g} ({type(last).__name__})")
        dice = None
        if self.accounting == "dice":
            c1, c2 = self.dice_units(cfg)
            gb = self.dice_grad_bound(cfg, s) if self.dice_grad_bound is not None else cfg.grad_bound
            dice = DiceParams(sample_rate, 1, c1, c2, expected_batch_size, gb)
        return banded_spec(AccountingSpec(self.accounting, sample_rate, z, note, dice, self.certifiable,
                                          self.why_not_certifiable, last.bound), bands, shape)

    def row_source(self, model: nn.Module, loss_fn: LossFn, cfg: AlgoConfig, *, n: int, batch_size: float,
                   key: SecretKey | None = None) -> RowSource:
        """Where the engine's rows come from when the caller gives no gradient backend."""
        if self.source is None:
            return PerExampleRows(FuncGradients(model, loss_fn))
        return self.source(model, loss_fn, cfg, self.settings(cfg), n=n, batch_size=batch_size, key=key)

    @property
    def reads_ef_clip(self) -> bool:
        """Whether the algorithm clips an error-feedback buffer with ``AlgoConfig.ef_clip`` (C2)."""
        ef = self.build(AlgoConfig(clip=2.0, ef_clip=3.0), {s.key: s.default for s in self.schema
                                                            if s.key != "public"}, 1.0, None).error_feedback
        return ef is not None and ef.c2 == 3.0


ALGORITHMS: Registry[Algorithm] = Registry("an algorithm", "algo")
# "BASE+SUFFIX" names built on demand (not listed in ALGORITHMS): suffix -> builder from the base's name
DERIVED: dict[str, Callable[[str], Algorithm]] = {}
_derived: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    """Add ``algo`` to ``ALGORITHMS`` under its name (a name is registered once)."""
    return ALGORITHMS.register(algo)


def get(name: str) -> Algorithm:
    """The registered algorithm ``name``, or a derived one ``BASE+SUFFIX`` (e.g. ``dice+disk``: a
    registered base with a stage of ``DERIVED``), built once and cached."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    base, _, suffix = name.rpartition("+") if isinstance(name, str) else ("", "", "")
    if base and suffix in DERIVED:
        if name not in _derived:
            _derived[name] = DERIVED[suffix](base)
        return _derived[name]
    derived = "".join(f"; or BASE+{k} (e.g. dpsgd+{k})" for k in DERIVED)
    raise ConfigError(f"`algo` must be one of {', '.join(sorted(ALGORITHMS))}{derived}, got {name!r}")


def clip_or_normalize(cfg: AlgoConfig, normalize: bool) -> PerSample:
    """The bounding stage: ``Clip(C)`` (bound C) or ``Normalize(gamma)`` (bound 1)."""
    return Normalize(cfg.gamma) if normalize else Clip(cfg.clip)


def make_optimizer(name: str, params, cfg: AlgoConfig) -> torch.optim.Optimizer:
    """The base optimizer that consumes the private update as ``.grad``."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    raise ConfigError(f"`optimizer` must be one of sgd, adam, adamw, got {name!r}")
