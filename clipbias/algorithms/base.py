"""One ``Algorithm`` type and the registry: the bottom of ``clipbias.algorithms``.

An algorithm is data, not a subclass: its settings (``Setting``), a ``build`` that assembles the
pipeline's stages (``Parts``), optionally its own ``RowSource`` (rows that are not plain
per-example gradients), and its accounting (kind, sensitivity read off the last bounding stage,
DiceSGD units). Every method module registers its algorithms with ``register``; the catalog
(``clipbias.algorithms``) imports the modules. Nothing here imports the catalog.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..config import AlgoConfig, Setting, read_settings
from ..errors import ConfigError
from ..grads.rows import FuncGradients, LossFn, PerExampleRows, RowSource
from ..privacy import AccountingSpec, DiceParams
from ..randomness import SecretKey
from ..transforms import Clip, ErrorFeedback, GaussianNoise, Normalize, PerSample, Pipeline, Stage


@dataclass(frozen=True)
class Parts:
    """What ``Algorithm.build`` returns: the per-example stages (the last one bounds the norm), the
    error feedback, a post-noise stage, and the divisor of the summed rows (None: B)."""

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
    """A named recipe. Names match the ``--algo`` values of the CLI.

    ``build(cfg, settings, B, key)`` returns the ``Parts`` (``key``: the run's ``SecretKey`` for the
    stages' secret draws; None where only the structure is read); ``source(model, loss_fn, cfg,
    settings, n=, batch_size=, key=)`` the row source (None: per-example gradients); ``validate(cfg, settings,
    q, B)`` refuses settings the guarantee does not cover; ``note(cfg, settings)`` states the
    sensitivity and sampling in words; ``dice_units(cfg)`` gives (C1, C2) of DiceSGD's accounting and
    ``dice_grad_bound(cfg, settings)`` the G_max it may use (default ``cfg.grad_bound``).
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

    def settings(self, cfg: AlgoConfig) -> dict:
        """The validated method settings of ``cfg.extra`` (unknown keys refused)."""
        return read_settings(self.name, self.schema, cfg)

    @property
    def needs_public(self) -> bool:
        """Whether the algorithm reads public features (``AlgoConfig.extra['public']``)."""
        return any(s.key == "public" for s in self.schema)

    def parts(self, cfg: AlgoConfig, expected_batch_size: float = 1.0, key: SecretKey | None = None) -> Parts:
        return self.build(cfg, self.settings(cfg), expected_batch_size, key)

    def pipeline(self, cfg: AlgoConfig, expected_batch_size: float, z: float, key: SecretKey) -> Pipeline:
        """The update rule; the noise std is ``z * sensitivity / divisor``; ``key`` keys the noise and the
        stages' secret draws."""
        parts = self.parts(cfg, expected_batch_size, key)
        reference = [Clip(cfg.grad_bound)] if cfg.grad_bound is not None else []
        div = parts.divisor if parts.divisor is not None else expected_batch_size
        p = Pipeline(parts.per_sample, div, reference, parts.error_feedback, post=parts.post)
        if self.private:
            if p.sensitivity is None:
                raise ConfigError(f"{self.name}: no stage bounds the per-example norm")
            zg = self.gradient_noise(cfg, self.settings(cfg), z, expected_batch_size) if self.gradient_noise else z
            p.noise = GaussianNoise(zg * p.sensitivity / div, key)
            if getattr(p.per_sample[-1], "dynamic", False):  # the bound moves: the noise follows it
                p.noise_per_bound = zg / div
        return p

    def spec(self, cfg: AlgoConfig, sample_rate: float, z: float, expected_batch_size: float) -> AccountingSpec:
        """The accounting description: kind, rate, z, the numeric sensitivity and why it holds."""
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
        return AccountingSpec(self.accounting, sample_rate, z, note, dice, self.certifiable,
                              self.why_not_certifiable, last.bound)

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


ALGORITHMS: dict[str, Algorithm] = {}
# "BASE+SUFFIX" names built on demand (not listed in ALGORITHMS): suffix -> builder from the base's name
DERIVED: dict[str, Callable[[str], Algorithm]] = {}
_derived: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    if algo.name in ALGORITHMS:
        raise ConfigError(f"an algorithm named {algo.name!r} is already registered")
    ALGORITHMS[algo.name] = algo
    return algo


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
