"""The Taylor coefficients of banded noise (``bands_strategy="taylor"``, the default): the first b
coefficients of ``((1 - x)(1 - beta x))^(-1/2)`` scaled to unit norm. Their own module so that both
``bands`` (the noise stage) and ``band_strategy`` (the optimised coefficients, which start from these
and are never worse) read them without importing each other."""

from __future__ import annotations

import math

from ..errors import ConfigError


def coefficients(bands: int, momentum: float = 0.0) -> tuple[float, ...]:
    """c_0 .. c_{b-1}: the first ``bands`` Taylor coefficients of ((1 - x)(1 - momentum x))^(-1/2), scaled to
    unit L2 norm (c_0 > 0). ``momentum`` 0 gives the square root of the prefix sum, binom(2k, k) / 4^k."""
    if not 0.0 <= momentum < 1.0:
        raise ConfigError(f"banded noise: momentum must lie in [0, 1), got {momentum!r}")
    r = [1.0]
    for k in range(1, bands):
        r.append(r[-1] * (2 * k - 1) / (2 * k))  # binom(2k, k) / 4^k
    c = [sum(r[j] * r[k - j] * momentum ** (k - j) for j in range(k + 1)) for k in range(bands)]
    norm = math.sqrt(sum(x * x for x in c))
    return tuple(x / norm for x in c)
