"""``clipbias`` command line. Each subcommand is a module of this package with
``register(subparsers)``; modules are discovered, so adding a command touches no other file.

Building the parsers imports no torch and no accountant (``--help`` answers at once): a command's
module imports what it runs inside its run function, and the choices the parsers offer (algorithms,
models, data sets) come from ``_choices``. ``tests/test_cli.py`` checks it."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys
import threading

from ..errors import ClipbiasError
from ._common import Terminated, exit_code, on_sigterm
from ._flags import speak, use

# Order in --help; modules not listed come after, alphabetically.
_ORDER = ["train", "compare", "account", "calibrate", "audit", "toy", "diagnose", "export"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clipbias",
        description="Differentially private training without clipping bias: DP-SGD, DiceSGD and the "
                    "bias-reduction methods of Chen et al. and Xiao et al., with proven accounting and "
                    "empirical privacy audits.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    mods = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    for name in sorted(mods, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n)):
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    if args.command != "train" and os.environ.get("WORLD_SIZE", "1") != "1":
        from .. import distributed
        if distributed.env_world_size() > 1:
            print(f"clipbias {args.command}: error: only `clipbias train` runs on several processes (torchrun "
                  f"started {distributed.env_world_size()}); run `clipbias {args.command}` as one process",
                  file=sys.stderr)
            return 2
    use(parser, args.command)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    try:
        return int(args.func(args) or 0)
    except ClipbiasError as e:  # the library names its parameters; the command names its flags
        print(f"clipbias {args.command}: error: {speak(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print("terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted", file=sys.stderr)
        return exit_code(e)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
