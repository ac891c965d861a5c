"""Exceptions raised by clipbias. Each message says what was wrong and how to fix it; an optional
dependency is imported by ``require``, whose error names the extra that installs it.

A message names what to change as the Python API spells it, in backquotes: a parameter
(`` `epsilon` ``), a field (`` `AlgoConfig.clip` ``), a method setting (`` `AlgoConfig.extra['k']` ``)
or a suggested value (`` `accountant='rdp'` ``). The command line shows the same message with its
flags in their place (``--epsilon``, ``--clip``, ``--accountant rdp``: ``clipbias/cli/_flags.py``)."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"kymatio": ("kymatio", "scatter"), "sklearn": ("scikit-learn", "datasets"),
          "matplotlib": ("matplotlib", "plots"), "transformers": ("transformers", "hf"),
          "tokenizers": ("tokenizers", "hf"), "peft": ("peft", "hf"), "lightning": ("lightning", "lightning")}
"""The optional dependencies: top-level module -> (its distribution on PyPI, the extra of clipbias
that installs it, ``pip install "clipbias[extra]"``; pyproject.toml lists the extras)."""


class ClipbiasError(Exception):
    """Base class of every error clipbias raises on purpose."""


class ConfigError(ClipbiasError, ValueError):
    """An invalid setting (epsilon, delta, rate, norm, ...). The message names the setting."""


class PathRefusal(ConfigError):
    """A gradient path (``path``: ``"rows"`` or ``"fast"``) cannot compute this model's per-example
    gradients, found from the model's structure at a step before anything changed; under
    ``grad_path="auto"`` the engine takes the other path instead."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self):
        return type(self), (self.path, str(self))


class UnsupportedModelError(ClipbiasError, ValueError):
    """The model mixes examples (e.g. BatchNorm in train mode), so per-example DP is impossible."""


class NonFiniteGradientError(ClipbiasError, FloatingPointError):
    """A per-example gradient held NaN or Inf; raised before any state changed."""


class PrivacyAccountingError(ClipbiasError, ValueError):
    """A privacy guarantee was asked for outside the conditions under which it is proven."""


class ResumeMismatchError(ClipbiasError, ValueError):
    """A resumed run's privacy-relevant settings differ from the checkpoint's."""


class TrainingDivergedError(ClipbiasError, FloatingPointError):
    """The training loss (or the model) became infinite or NaN: the result is unusable."""


class WriteError(ClipbiasError, OSError):
    """A file could not be written (disk full, permissions); the previous file, if any, is unchanged."""


class MissingDependencyError(ClipbiasError, ImportError):
    """An optional dependency is not installed; the message names the extra of clipbias that installs it."""


def require(module: str, needed_for: str) -> ModuleType:
    """``importlib.import_module(module)`` for an optional dependency (its top-level name in
    ``EXTRAS``), or a ``MissingDependencyError`` that says what needs it and the
    ``pip install "clipbias[extra]"`` that installs it. An installed package that fails to import
    for another reason raises that error unchanged."""
    top = module.partition(".")[0]
    dist, extra = EXTRAS[top]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] != top:
            raise
        raise MissingDependencyError(f"{needed_for} needs {dist}, which is not installed: "
                                     f"pip install \"clipbias[{extra}]\" (or pip install {dist})") from e
