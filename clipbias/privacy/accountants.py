"""The accountants of the Poisson-subsampled Gaussian: a registry of typed objects.

An ``Accountant`` turns T compositions of the subsampled Gaussian (noise multiplier z, sampling rate
q) into an epsilon at delta, says which theorem that number rests on (``basis``), below which noise
multiplier it refuses (``floor``) and, optionally, which cheaper accountants aim its calibration
(``aims``). ``gaussian.epsilon``, ``gaussian.report`` and ``gaussian.calibrate`` validate their
inputs once and ask the accountant registered under the name; the CLI offers the registered names.

A new accountant is one module of ``clipbias.privacy`` that subclasses ``Accountant`` and calls
``register`` (the package's ``__init__.py`` imports every module of it; ``pld`` and ``rdp`` are the models).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable

from dp_accounting import dp_event

from ..errors import ClipbiasError, ConfigError
from ..registry import Registry


@dataclass(frozen=True)
class SampledGaussian:
    """One step: Gaussian noise with multiplier z on a Poisson sample of rate q (q = 1: full batch)."""

    noise_multiplier: float
    sample_rate: float

    def event(self, steps: int = 1) -> dp_event.DpEvent:
        if self.noise_multiplier == 0:
            return dp_event.NonPrivateDpEvent()
        step: dp_event.DpEvent = dp_event.GaussianDpEvent(self.noise_multiplier)
        if self.sample_rate < 1:
            step = dp_event.PoissonSampledDpEvent(self.sample_rate, step)
        return dp_event.SelfComposedDpEvent(step, steps) if steps != 1 else step


class NoiseTooSmallError(ConfigError):
    """A noise multiplier too small for any meaningful guarantee (and below an accountant's floor)."""


EpsOf = Callable[[float], float]


class Accountant(abc.ABC):
    """Epsilon of T steps of the Poisson-subsampled Gaussian, by one method.

    Subclasses set ``name`` (what ``accountant=`` takes), ``basis`` (the theorem, in words, that
    every report carries) and implement ``compute``; ``floor`` > 0 is the smallest noise multiplier
    accounted (below it ``compute`` raises ``NoiseTooSmallError``; the calibration never searches
    below it) and ``floor_reason`` says why.
    """

    name: str = ""
    basis: str = ""
    floor: float = 0.0
    floor_reason: str = ""

    @abc.abstractmethod
    def compute(self, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
        """Epsilon for valid inputs (0 < z finite, 0 < q <= 1, steps >= 1, 0 < delta < 1)."""

    def epsilon(self, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
        """``compute``, with what the numerical libraries raise for an unrepresentable (z, q) pair (out of
        memory, dp-accounting's "Maximum allowed size exceeded") turned into a ``ConfigError``."""
        try:
            return self.compute(noise_multiplier, sample_rate, steps, delta)
        except ClipbiasError:
            raise
        except MemoryError as e:  # the PLD grid of an extreme (z, q) pair does not fit in memory
            raise ConfigError(
                f"the {self.name} accountant cannot represent noise multiplier {noise_multiplier:g} at sample "
                f"rate {sample_rate:g} ({steps} steps): its privacy-loss grid does not fit in memory. Use a larger "
                f"`noise_multiplier` (this one gives no meaningful epsilon) or `accountant='rdp'`") from e
        except ValueError as e:  # dp-accounting: "Maximum allowed size exceeded" for an extreme grid
            raise ConfigError(f"the {self.name} accountant cannot represent noise multiplier {noise_multiplier:g} "
                              f"at sample rate {sample_rate:g} ({steps} steps): {e}. Use a larger "
                              f"`noise_multiplier` or `accountant='rdp'`") from e

    def basis_for(self, sample_rate: float) -> str:
        """The basis of a report at this sampling rate."""
        return self.basis

    def aims(self, sample_rate: float, steps: int, delta: float) -> list[tuple[EpsOf, float]]:
        """Cheaper epsilons (with their relative tolerances) that bring the calibration's secant near
        the answer before this accountant confirms it (``search.calibrate_levels``); none: the
        accountant aims by itself."""
        return []


ACCOUNTANTS: Registry[Accountant] = Registry("an accountant", "accountant")
"""The registered accountants by name (``register``); ``pld`` is the default everywhere."""


def register(accountant: Accountant) -> Accountant:
    """Add ``accountant`` to ``ACCOUNTANTS`` under its name (a name is registered once)."""
    return ACCOUNTANTS.register(accountant)


def get(name: str) -> Accountant:
    """The accountant registered as ``name``."""
    return ACCOUNTANTS.lookup(name)
