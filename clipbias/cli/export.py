"""``clipbias export DIR FILE``: the releasable artefact of a run, the model weights only.

The run's ``checkpoint.pt`` is PRIVATE (DiceSGD's error-feedback buffer, optimizer state, the secret key);
the exported file holds ``{"state_dict": model weights, "meta": public facts (model, data, epsilon,
delta, certified, basis)}`` and nothing of the engine.
"""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ._common import emit


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..run.training import export_weights
    if Path(args.file).resolve() == (Path(args.dir) / "checkpoint.pt").resolve():
        raise ConfigError("FILE must not be the private checkpoint itself; choose another file name")
    if Path(args.file).exists() and not args.overwrite:
        raise ConfigError(f"FILE {args.file} exists; pass --overwrite to replace it")
    info = export_weights(args.dir, args.file)
    emit(info, args.json)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's model weights (the releasable artefact)",
                       description="Write only the model weights of the run in DIR to FILE (torch.save). "
                                   "The private engine state (DiceSGD error feedback, the secret key) is "
                                   "never exported. Load with torch.load(FILE)['state_dict'].")
    p.add_argument("dir", metavar="DIR", help="run directory holding checkpoint.pt")
    p.add_argument("file", metavar="FILE", help="output file, e.g. model.pt")
    p.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=_run)
