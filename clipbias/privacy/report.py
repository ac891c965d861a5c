"""The privacy statement every run and command returns, and validation of its inputs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ..errors import ConfigError
from .accountants import get


@dataclass(frozen=True)
class PrivacyReport:
    """An (epsilon, delta) statement with what it rests on (frozen; ``to_dict`` for JSON).

    Attributes:
        epsilon: Epsilon; ``math.inf`` for non-private runs: never a made-up number.
        delta: Delta.
        accountant: The accountant that computed it (``"pld"``, ``"rdp"``; ``"none"`` without noise).
        basis: The theorem the number comes from, in words.
        certified: False when the number rests on a heuristic (the DiceSGD authors' protocol) rather than
            a proof, or when a caveat voids it for this run.
        noise_multiplier: The noise multiplier z of the run, where it has one.
        caveats: Why the statement does not hold as certified for this run, one sentence each (a
            seed-keyed run, statistics of the private data released outside the mechanism, ...).
        released: What the run releases beside the model, outside the mechanism, named (the training loss
            a framework logs, timings, n): epsilon does not cover them; keep them as private as the data.
    """

    epsilon: float
    delta: float
    accountant: str
    basis: str
    certified: bool
    noise_multiplier: float | None = None
    caveats: tuple[str, ...] = ()
    released: tuple[str, ...] = ()

    def with_caveat(self, why: str) -> "PrivacyReport":
        """The same statement, not certified, with ``why`` among its caveats.

        Args:
            why: The caveat, one sentence.

        Returns:
            A new ``PrivacyReport`` (this one is frozen).
        """
        return replace(self, certified=False, caveats=(*self.caveats, why))

    def to_dict(self) -> dict:
        """The statement as a JSON-ready dict (``caveats`` a list, an infinite epsilon the string ``"inf"``)."""
        d = asdict(self)
        d["caveats"], d["released"] = list(self.caveats), list(self.released)
        if math.isinf(self.epsilon):
            d["epsilon"] = "inf"
        return d


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    """``epsilon`` as a float when it is a positive finite number; the error names the parameter ``name``
    (so do the other checks: the CLI turns the name into its flag)."""
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ConfigError(f"`{name}` must be a positive finite number, got {epsilon!r}")
    return float(epsilon)


def check_delta(delta: float, name: str = "delta") -> float:
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ConfigError(f"`{name}` must lie in (0, 1), got {delta!r}; 1e-5 is usual for ~60k examples")
    return float(delta)


def delta_warning(delta: float, n: int | None) -> str | None:
    """A warning when delta >= 1/N: such a delta allows releasing one example outright."""
    if n is not None and n > 0 and delta >= 1.0 / n:
        return (f"warning: delta={delta:g} >= 1/N = {1.0 / n:g}; a delta this large permits leaking "
                f"a whole example. Use delta well below 1/N (e.g. {10 ** math.floor(math.log10(0.1 / n)):g}).")
    return None


def check_rate(q: float, name: str = "sample_rate") -> float:
    if not (isinstance(q, (int, float)) and 0 < q <= 1):
        raise ConfigError(f"`{name}` must lie in (0, 1], got {q!r}")
    return float(q)


def check_steps(steps: int, name: str = "steps") -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"`{name}` must be an integer >= 1, got {steps!r}")
    return steps


def check_positive(value: float, name: str) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"`{name}` must be a positive finite number, got {value!r}")
    return float(value)


def check_nonnegative(value: float, name: str) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"`{name}` must be a finite number >= 0, got {value!r}")
    return float(value)


def check_accountant(name: str) -> str:
    """``name`` when an accountant is registered under it (``accountants.ACCOUNTANTS``)."""
    get(name)
    return name
