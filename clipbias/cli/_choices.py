"""What the argument parsers offer, without importing torch: the registered algorithms and their method
settings, the models, data sets, accountants, toy problems and the audit's statistics and schedules.

The parsers are built for every command, including ``--help``; the modules these values live in import
torch and dp-accounting (seconds). So a command that has not loaded them reads them from a cache,
generated from the live registries and keyed by a digest of the package's source: ``cached()`` looks the
digest up in ``choices.json`` of clipbias's cache folder (``files.cache_directory``), and on a miss (a
new algorithm, setting, model, data set or accountant: any change of the source) runs
``python -m clipbias.cli._choices`` in a child process (which imports torch, so that this one does not),
stores what it prints and uses it. Nothing is written by hand and nothing can go stale: the digest
changes with the source. ``tests/test_startup.py`` checks that the cached values are the live ones and
that ``--help`` imports no torch, cold or cached.

A program that loaded a registry before calling ``clipbias.cli.main`` gets that registry's live values
(``current``), so a method, accountant or data set it registered itself appears in the parsers as well.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from ..errors import ClipbiasError
from ..files import atomic_write, cache_directory

FILE = "choices.json"  # in files.cache_directory(): {digest of the source: the values}
_KEEP = 8  # digests kept (checkouts or versions that share the cache folder)
_PACKAGE = Path(__file__).resolve().parent.parent
KEYS = ("algorithms", "settings", "models", "bandable", "public", "datasets", "accountants", "dice_accounting",
        "default_dice_accounting", "default_ef_ratio", "bands_strategies", "default_bands_strategy",
        "shape_accounted_strategies", "toy_problems", "audit_statistics", "audit_schedules")


def live() -> dict:
    """The values from the modules that define them (imports torch)."""
    from .. import algorithms, models
    from ..algorithms.bands import NOISE_STRATEGIES, TAYLOR
    from ..analysis import toy
    from ..audit.canary import SCHEDULES, STATISTICS
    from ..config import boolean
    from ..data.catalog import DATASETS
    from ..privacy import ACCOUNTANTS
    from ..privacy.dice import DEFAULT_DICE_ACCOUNTING, DEFAULT_EF_RATIO, DICE_ACCOUNTING

    settings = []  # the method flags: settings a trainer sets itself (cli=False) have none
    for s in (s for s in algorithms.all_settings().values() if s.cli):
        users = [a.name for a in algorithms.ALGORITHMS.values() if any(x.key == s.key for x in a.schema)]
        settings.append({"key": s.key, "flag": s.flag, "dest": s.dest, "default": s.default, "help": s.help,
                         "switch": s.check is boolean, "type": "float" if s.convert is float else "int",
                         "cli": s.cli, "users": users})
    return {"algorithms": sorted(algorithms.ALGORITHMS), "settings": settings, "models": list(models.MODEL_NAMES),
            "bandable": [a.name for a in algorithms.ALGORITHMS.values() if a.bandable],
            "public": [a.name for a in algorithms.ALGORITHMS.values() if a.needs_public],
            "datasets": list(DATASETS), "accountants": list(ACCOUNTANTS),
            "dice_accounting": list(DICE_ACCOUNTING), "default_dice_accounting": DEFAULT_DICE_ACCOUNTING,
            "default_ef_ratio": DEFAULT_EF_RATIO, "bands_strategies": list(NOISE_STRATEGIES),
            "default_bands_strategy": TAYLOR.name,
            "shape_accounted_strategies": [s.name for s in NOISE_STRATEGIES.values() if s.accounted_by_shape],
            "toy_problems": list(toy.PROBLEMS),
            "audit_statistics": list(STATISTICS), "audit_schedules": list(SCHEDULES)}


def digest() -> str:
    """SHA-256 of every module of the package (path and bytes): what the values are a function of."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(path.relative_to(_PACKAGE).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _generate() -> dict:
    """``live()`` computed by a child process (this one imports no torch); in this process if the child fails
    (which then raises the real error, or succeeds)."""
    code = f"import sys; sys.path.insert(0, {str(_PACKAGE.parent)!r}); from clipbias.cli._choices import _main; _main()"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        if done.returncode == 0:
            return json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return json.loads(json.dumps(live()))  # the child's form (JSON), so both ways give equal values


def _read(path: Path) -> dict:
    try:
        stored = json.loads(path.read_text())
        return stored if isinstance(stored, dict) else {}
    except (OSError, ValueError):
        return {}


@functools.cache
def cached() -> dict:
    """The live values, from the cache when it holds this source's digest, else generated and stored."""
    key, folder = digest(), cache_directory()
    stored = _read(folder / FILE) if folder is not None else {}
    if isinstance(stored.get(key), dict) and set(KEYS) <= set(stored[key]):
        return stored[key]
    values = _generate()
    if folder is not None:
        kept = {k: v for k, v in list(stored.items())[-(_KEEP - 1):] if k != key}
        try:
            atomic_write(folder / FILE, lambda f: f.write(json.dumps({**kept, key: values}).encode()))
        except (OSError, ClipbiasError):  # a read-only cache: the values stand, the next command makes them again
            pass
    return values


def current() -> dict:
    """What the parsers offer: the live values when the algorithm registry is loaded; else the cache's, with
    the accountants or data sets live where their registry is loaded (neither imports torch)."""
    if "clipbias.algorithms" in sys.modules:
        return live()
    values = dict(cached())
    accountants, catalog = sys.modules.get("clipbias.privacy.accountants"), sys.modules.get("clipbias.data.catalog")
    if accountants is not None:
        values["accountants"] = list(accountants.ACCOUNTANTS)
    if catalog is not None:
        values["datasets"] = list(catalog.DATASETS)
    return values


def _main() -> None:
    sys.stdout.write(json.dumps(live()))


if __name__ == "__main__":
    _main()
