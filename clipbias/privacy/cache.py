"""A disk cache of calibrated noise multipliers, so a repeated configuration does not pay the
accountant again (a sound DiceSGD or PLD calibration takes seconds to tens of seconds).

The key is every input of the calibration (kind, rate, DiceSGD parameters, epsilon, delta, steps,
accountant, basis) plus a digest of the accounting code and the dp-accounting version: a change of
either starts a fresh cache. Nothing here is trusted blindly: ``DPEngine`` accounts the cached noise
multiplier again at the end of the run before training (``engine.privacy(steps)``) and
``calibrate`` re-checks a cached value against the target (``verify``) before returning it, so a
corrupt or tampered file can cost time, never a wrong epsilon. The inputs are public run
parameters (no data). Location: ``$CLIPBIAS_CACHE`` or ``$XDG_CACHE_HOME/clipbias`` or
``~/.cache/clipbias``; ``CLIPBIAS_CACHE=off`` disables it.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Callable

_FILE = "calibrations.json"


def _directory() -> Path | None:
    env = os.environ.get("CLIPBIAS_CACHE")
    if env == "off":
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clipbias"


def _code_digest() -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for path in sorted(here.glob("*.py")):  # the accounting code, every accountant included
        h.update(path.read_bytes())
    try:
        h.update(metadata.version("dp-accounting").encode())
    except metadata.PackageNotFoundError:  # pragma: no cover - a dependency
        pass
    return h.hexdigest()[:16]


def cached(key: dict, compute: Callable[[], float], verify: Callable[[float], bool]) -> float:
    """``compute()`` unless the cache holds a value for ``key`` that passes ``verify``; stores it."""
    folder = _directory()
    if folder is None:
        return compute()
    k = hashlib.sha256(json.dumps({**key, "code": _code_digest()}, sort_keys=True).encode()).hexdigest()
    path = folder / _FILE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    v = table.get(k) if isinstance(table, dict) else None
    if isinstance(v, (int, float)) and v > 0 and verify(float(v)):
        return float(v)
    z = compute()
    try:
        from ..files import atomic_write
        folder.mkdir(parents=True, exist_ok=True)
        table = table if isinstance(table, dict) else {}
        table[k] = z
        data = (json.dumps(table) + "\n").encode()
        atomic_write(path, lambda fh: fh.write(data))
    except OSError:  # a cache that cannot be written is only slower
        pass
    return z
