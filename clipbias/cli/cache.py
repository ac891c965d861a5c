"""``clipbias cache``: where clipbias caches derived data, how large it is, and clearing it.

Two caches, both safe to delete (everything in them is recomputed on demand): decoded data and
scattering features (``$CLIPBIAS_CACHE_DIR`` or ``~/.cache/clipbias``: Fashion-MNIST tensors, and
per split the scattering features of the scatter models, about 1.4 GB after the default
``clipbias compare``), and calibrated noise multipliers, optimised band coefficients, BLT strategies and the
choices the command line offers (``$CLIPBIAS_CACHE`` or ``$XDG_CACHE_HOME/clipbias``, four small JSON files;
``CLIPBIAS_CACHE=off`` disables them). ``--clear``
removes only the files clipbias writes there, nothing else in those folders.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import _choices
from ._common import emit


def cached_files() -> list[Path]:
    """The files clipbias has cached, in both caches."""
    from ..data.catalog import cache_dir
    from ..privacy import cache as calibration_cache
    data = cache_dir()
    files = sorted(data.glob("fashion-mnist-*.pt")) + sorted((data / "scatter").glob("*.pt"))
    from ..algorithms import band_strategy, blt
    folder = calibration_cache._directory()
    for name in (calibration_cache._FILE, band_strategy._FILE, blt._FILE, _choices.FILE):
        if folder is not None and (folder / name).is_file():
            files.append(folder / name)
    return files


def _run(args: argparse.Namespace) -> int:
    from ..data.catalog import cache_dir
    from ..privacy import cache as calibration_cache
    files = cached_files()
    size = sum(f.stat().st_size for f in files)
    folder = calibration_cache._directory()
    info = {"data_cache": str(cache_dir()), "calibration_cache": str(folder) if folder else "off",
            "files": len(files), "bytes": size, "size": f"{size / 2**20:.1f} MB"}
    if args.clear:
        for f in files:
            f.unlink(missing_ok=True)
        info["cleared"] = len(files)
    emit(info, args.json)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="show (or --clear) clipbias's on-disk caches",
                       description=__doc__.split("\n\n")[1].replace("``", "'"))
    p.add_argument("--clear", action="store_true",
                   help="delete the cached files (decoded data, scattering features, calibrations); they are "
                        "recomputed when needed")
    p.add_argument("--json", action="store_true", help="print JSON on stdout")
    p.set_defaults(func=_run)
