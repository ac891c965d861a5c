"""Helpers shared by subcommands: JSON/table output and common flags."""

from __future__ import annotations

import json
import math
import sys
from typing import Any


def jsonable(obj: Any) -> Any:
    """inf/nan become strings: JSON has no infinity, and epsilon = inf must never read as a number."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def emit(data: dict, as_json: bool, stream=None) -> None:
    stream = stream or sys.stdout
    if as_json:
        print(json.dumps(jsonable(data), indent=2), file=stream)
        return
    width = max(len(k) for k in data)
    for k, v in data.items():
        print(f"{k:<{width}}  {v}", file=stream)


def warn(msg: str | None) -> None:
    if msg:
        print(msg, file=sys.stderr)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so it stops as cleanly as on Ctrl-C (exit 143)."""


def on_sigterm(signum, frame) -> None:
    raise Terminated()


def exit_code(e: KeyboardInterrupt) -> int:
    """130 for Ctrl-C (SIGINT), 143 for SIGTERM: the shell's 128 + signal number."""
    return 143 if isinstance(e, Terminated) else 130
