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
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..errors import ClipbiasError
from ..files import cache_directory

_FILE = "calibrations.json"


def _directory() -> Path | None:
    return cache_directory()


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
    def load(v) -> float | None:
        return float(v) if isinstance(v, (int, float)) and v > 0 and verify(float(v)) else None
    return memo(_FILE, {**key, "code": _code_digest()}, compute, load)


T = TypeVar("T")


def memo(file: str, key: dict, compute: Callable[[], T], load: Callable[[Any], T | None],
         dump: Callable[[T], Any] = lambda v: v) -> T:
    """The JSON table ``file`` in the cache folder, keyed by a digest of ``key``: what ``load`` makes of the
    stored entry (None, or an error it raises: not usable), else ``compute()``, stored as ``dump`` of it.
    The calibrations and the optimised noise strategies (``band_strategy``, ``blt``) use it."""
    folder = _directory()
    if folder is None:
        return compute()
    k = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    path = folder / file
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table = table if isinstance(table, dict) else {}
    try:
        got = load(table.get(k))
    except (ClipbiasError, TypeError, ValueError, KeyError):  # a damaged entry costs time, nothing else
        got = None
    if got is not None:
        return got
    v = compute()
    try:
        from ..files import atomic_write
        folder.mkdir(parents=True, exist_ok=True)
        table[k] = dump(v)
        data = (json.dumps(table) + "\n").encode()
        atomic_write(path, lambda fh: fh.write(data))
    except OSError:  # a cache that cannot be written is only slower
        pass
    return v


def module_digest(path: str) -> str:
    """A digest of one module's source and the scipy version (what an optimised strategy depends on)."""
    import scipy
    h = hashlib.sha256(Path(path).read_bytes())
    h.update(scipy.__version__.encode())
    return h.hexdigest()[:16]
