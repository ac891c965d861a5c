"""The algorithms, each a recipe: which stages, which base optimizer, which accounting.

Adding a method means registering an ``Algorithm`` whose ``build`` assembles stages from
``clipbias.transforms``: no optimizer subclasses. Names match the ``--algo`` values of the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import ConfigError
from .privacy import AccountingSpec, DiceParams
from .transforms import Clip, ErrorFeedback, GaussianNoise, Normalize, PerSample, Pipeline


@dataclass(frozen=True)
class AlgoConfig:
    """Hyper-parameters shared by the algorithms (unused ones are ignored by a recipe).

    ``clip`` is C1 (per-example clip); ``ef_clip`` is C2 (clip of the DiceSGD feedback buffer, on
    the average-gradient scale; default C1); ``grad_bound`` is an optional outer clip G_max applied
    to every per-example gradient before anything else (then "g_i" means clip(g_i, G_max)
    everywhere, and DiceSGD's certified accounting can use G' = G_max - C1); ``gamma`` is the
    normalisation stability constant.
    """

    lr: float = 0.1
    clip: float = 1.0
    ef_clip: float | None = None
    grad_bound: float | None = None
    gamma: float = 0.01
    optimizer: str | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    extra: dict = field(default_factory=dict)  # method-specific settings (perturbation k, p, ...)

    def __post_init__(self) -> None:
        for name in ("lr", "clip", "gamma"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {v!r}")
        for name in ("ef_clip", "grad_bound"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {v!r}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must lie in [0, 1), got {self.momentum!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay!r}")

    @property
    def c2(self) -> float:
        return self.ef_clip if self.ef_clip is not None else self.clip


@dataclass(frozen=True)
class Algorithm:
    """A named recipe.

    ``stages(cfg)`` returns ``(per-example stages, error feedback or None)``; the noise std is
    ``z * sensitivity / B`` with the sensitivity read off the last bounding stage.
    """

    name: str
    description: str
    private: bool
    accounting: str  # 'gaussian' | 'dice' | 'none'
    stages: Callable[[AlgoConfig], tuple[list[PerSample], ErrorFeedback | None]]
    optimizer: str = "sgd"
    certifiable: bool = True
    why_not_certifiable: str = ""
    dice_units: Callable[[AlgoConfig], tuple[float, float]] = lambda c: (c.clip, c.c2)

    def pipeline(self, cfg: AlgoConfig, expected_batch_size: float, z: float, seed: int = 0,
                 device: torch.device | str = "cpu") -> Pipeline:
        per_sample, ef = self.stages(cfg)
        reference = [Clip(cfg.grad_bound)] if cfg.grad_bound is not None else []
        p = Pipeline(per_sample, expected_batch_size, reference, ef)
        if self.private:
            if p.sensitivity is None:
                raise ConfigError(f"{self.name}: no stage bounds the per-example norm")
            p.noise = GaussianNoise(z * p.sensitivity / expected_batch_size, seed, device)
        return p

    def spec(self, cfg: AlgoConfig, sample_rate: float, z: float, expected_batch_size: float) -> AccountingSpec:
        if not self.private:
            return AccountingSpec("none", sample_rate)
        per_sample, _ = self.stages(cfg)
        last = per_sample[-1]
        if last.bound is None:
            raise ConfigError(f"{self.name}: the last per-example stage ({type(last).__name__}) bounds no norm")
        note = f"per-example L2 sensitivity {last.bound:g} ({type(last).__name__})"
        dice = None
        if self.accounting == "dice":
            c1, c2 = self.dice_units(cfg)
            dice = DiceParams(sample_rate, 1, c1, c2, expected_batch_size, cfg.grad_bound)
        return AccountingSpec(self.accounting, sample_rate, z, note, dice, self.certifiable,
                              self.why_not_certifiable)


ALGORITHMS: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    ALGORITHMS[algo.name] = algo
    return algo


def get(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ConfigError(f"--algo must be one of {', '.join(sorted(ALGORITHMS))}, got {name!r}")
    return ALGORITHMS[name]


register(Algorithm("sgd", "plain SGD on per-example gradients (non-private)", False, "none",
                   lambda c: ([], None)))
register(Algorithm("clip-sgd", "SGD with per-example clipping, no noise (non-private)", False, "none",
                   lambda c: ([Clip(c.clip)], None)))
register(Algorithm("ef-sgd", "clipped error-feedback SGD, no noise (non-private DiceSGD)", False, "none",
                   lambda c: ([Clip(c.clip)], ErrorFeedback(c.c2))))
register(Algorithm("dpsgd", "DPSGD-GC (Abadi et al. 2016; Zhang et al. Alg. 1)", True, "gaussian",
                   lambda c: ([Clip(c.clip)], None)))
register(Algorithm("normalized", "per-example normalisation g/(||g||+gamma) (automatic clipping)", True,
                   "gaussian", lambda c: ([Normalize(c.gamma)], None)))
register(Algorithm("dice", "DiceSGD, clipped error feedback (Zhang et al. Alg. 2)", True, "dice",
                   lambda c: ([Clip(c.clip)], ErrorFeedback(c.c2))))
register(Algorithm("dice-adam", "DiceSGD with Adam/AdamW on v + w (Zhang et al. Alg. 3)", True, "dice",
                   lambda c: ([Clip(c.clip)], ErrorFeedback(c.c2)), optimizer="adam"))
register(Algorithm(
    "dice-auto", "automatic DiceSGD: normalised gradients and feedback (Zhang et al. Alg. 4)", True, "dice",
    lambda c: ([Normalize(c.gamma)], ErrorFeedback(normalize=c.gamma)),
    certifiable=False,
    why_not_certifiable="normalisation e/(||e||+gamma) is not non-expansive (Lipschitz 1/gamma), but "
                        "the proof's first term (App. A.2, after eq. (21)) needs a non-expansive map",
    dice_units=lambda c: (1.0, 1.0)))


def reads_ef_clip(algo: Algorithm) -> bool:
    """Whether ``algo`` clips an error-feedback buffer with ``AlgoConfig.ef_clip`` (C2)."""
    if algo.accounting != "dice" and algo.name != "ef-sgd":
        return False
    _, ef = algo.stages(AlgoConfig(clip=2.0, ef_clip=3.0))
    return ef is not None and ef.c2 == 3.0


def make_optimizer(name: str, params, cfg: AlgoConfig) -> torch.optim.Optimizer:
    """The base optimizer that consumes the private update as ``.grad``."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    raise ConfigError(f"--optimizer must be one of sgd, adam, adamw, got {name!r}")


from . import methods  # noqa: E402,F401  registers the paper methods
