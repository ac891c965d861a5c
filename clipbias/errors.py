"""Exceptions raised by clipbias. Each message says what was wrong and how to fix it."""

from __future__ import annotations


class ClipbiasError(Exception):
    """Base class of every error clipbias raises on purpose."""


class ConfigError(ClipbiasError, ValueError):
    """An invalid setting (epsilon, delta, rate, norm, ...). The message names the setting."""


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
