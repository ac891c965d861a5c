"""The settings an algorithm reads: ``AlgoConfig`` (shared hyper-parameters) and ``Setting``
(one method-specific setting, its rule, its CLI flag). The bottom of the package: no clipbias
import but ``errors``.

A method declares its settings as a tuple of ``Setting``; ``read_settings`` validates
``AlgoConfig.extra`` against it (unknown keys refused, each error names the setting), and the CLI
generates its method flags from the same tuples (``clipbias.cli.train``): one declaration, no
flag tables to keep in step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ConfigError


@dataclass(frozen=True)
class AlgoConfig:
    """Hyper-parameters shared by the algorithms (unused ones are ignored by a recipe).

    Args:
        lr: The base optimizer's learning rate (> 0).
        clip: C1, the per-example clip (> 0).
        ef_clip: C2, the clip of the DiceSGD feedback buffer, on the average-gradient scale (default C1).
        grad_bound: An optional outer clip G_max applied to every per-example gradient before anything else
            (then "g_i" means clip(g_i, G_max) everywhere, and DiceSGD's certified accounting can use
            G' = G_max - C1).
        gamma: The normalisation stability constant (> 0).
        optimizer: The base optimizer, ``"sgd"``, ``"adam"`` or ``"adamw"`` (default None: the algorithm's).
        momentum: The base SGD's momentum, in [0, 1).
        weight_decay: The base optimizer's weight decay (>= 0).
        betas: Adam's betas.
        extra: The method's own settings (perturbation k, p, ...), checked against the algorithm's schema.

    Raises:
        ConfigError: a value outside its range (the message names the field).
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
                raise ConfigError(f"`AlgoConfig.{name}` must be > 0, got {v!r}")
        for name in ("ef_clip", "grad_bound"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ConfigError(f"`AlgoConfig.{name}` must be > 0, got {v!r}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"`AlgoConfig.momentum` must lie in [0, 1), got {self.momentum!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"`AlgoConfig.weight_decay` must be >= 0, got {self.weight_decay!r}")

    @property
    def c2(self) -> float:
        return self.ef_clip if self.ef_clip is not None else self.clip


# ---------------------------------------------------------------- method settings (AlgoConfig.extra)
REQUIRED = object()  # Setting.default for a setting without default
OPTIONAL = None      # Setting.default for a setting that may stay unset (value None)


@dataclass(frozen=True)
class Setting:
    """One method setting read from ``AlgoConfig.extra[key]``."""

    key: str
    default: Any
    rule: str                        # e.g. "an integer >= 2"
    check: Callable[[Any], bool]
    flag: str                        # the CLI flag that sets it ("--x", or "--x/--no-x" for a switch)
    convert: Callable[[Any], Any] = lambda v: v
    help: str = ""
    aliases: tuple[str, ...] = ()    # other spellings accepted in ``extra`` (e.g. a CLI dest name)
    cli: bool = True                 # False: set by the trainer (e.g. public features), not a flag

    @property
    def dest(self) -> str:
        """The argparse destination of ``flag`` (``--aug-flip/--no-aug-flip`` -> ``aug_flip``)."""
        return self.flag.split("/")[0].lstrip("-").replace("-", "_")


def integral(v: Any) -> Any:
    """4.0 -> 4 (a CLI may parse integers as floats); anything else unchanged."""
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    return v


def integer(lo: int, hi: int | None = None) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        v = integral(v)
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)
    return ok


def real(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    return ok


def boolean(v: Any) -> bool:
    return isinstance(v, bool)


def anything(v: Any) -> bool:
    return True


def read_settings(algo: str, schema: tuple[Setting, ...], cfg: AlgoConfig) -> dict:
    """Validated settings; unknown keys (with a value other than None) are refused."""
    extra = {k: v for k, v in (cfg.extra or {}).items() if v is not None}
    known = {k for s in schema for k in (s.key, *s.aliases)}
    unknown = sorted(set(extra) - known)
    if unknown:
        valid = ", ".join(f"`AlgoConfig.extra[{s.key!r}]`" for s in schema) or "none"
        raise ConfigError(f"`algo='{algo}'` does not take setting(s) {', '.join(map(repr, unknown))}; "
                          f"its settings are: {valid}. Remove the others (or pass None).")
    out = {}
    for s in schema:
        given = [k for k in (s.key, *s.aliases) if k in extra]
        if len(given) > 1 and any(extra[k] is not extra[given[0]] and not _equal(extra[k], extra[given[0]])
                                  for k in given[1:]):
            raise ConfigError(f"`AlgoConfig.extra[{s.key!r}]` for `algo='{algo}'` is given twice with different values "
                              f"({', '.join(f'{k}={extra[k]!r}' for k in given)}); give it once")
        v = extra[given[0]] if given else s.default
        if v is REQUIRED:
            raise ConfigError(f"`algo='{algo}'` needs `AlgoConfig.extra[{s.key!r}]`: {s.help or s.rule}")
        if v is None:  # an optional setting left unset
            out[s.key] = None
            continue
        if not s.check(v):
            raise ConfigError(f"`AlgoConfig.extra[{s.key!r}]` for `algo='{algo}'` must be {s.rule}, "
                              f"got {v!r}")
        out[s.key] = s.convert(integral(v)) if s.check is not boolean else v
    return out


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors of different shapes, ...
        return False
