"""Helpers shared by subcommands: JSON/table output, signals, process tuning."""

from __future__ import annotations

import json
import sys

from ..files import jsonable

__all__ = ["emit", "exit_code", "jsonable", "on_sigterm", "plain", "tune_allocator", "warn"]


def emit(data: dict, as_json: bool, stream=None) -> None:
    stream = stream or sys.stdout
    if as_json:
        print(json.dumps(jsonable(data), indent=2), file=stream)
        return
    width = max(len(k) for k in data)
    for k, v in data.items():
        print(f"{k:<{width}}  {plain(v)}", file=stream)


def plain(v) -> str:
    """A value as the console shows it, spelled as in the JSON files: true/false, none for None and for
    an empty list, a list's items separated by "; "."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, (list, tuple)):
        return "; ".join(map(plain, v)) if v else "none"
    return str(v)


def warn(msg: str | None) -> None:
    """A library warning or note on stderr, its parameter names spoken as the command's flags."""
    if msg:
        from ._flags import speak
        print(speak(msg), file=sys.stderr)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so it stops as cleanly as on Ctrl-C (exit 143)."""


def on_sigterm(signum, frame) -> None:
    raise Terminated()


def exit_code(e: KeyboardInterrupt) -> int:
    """130 for Ctrl-C (SIGINT), 143 for SIGTERM: the shell's 128 + signal number."""
    return 143 if isinstance(e, Terminated) else 130


def tune_allocator(keep: bool = True) -> bool:
    """Keep freed memory inside the process (glibc ``mallopt``); returns whether it applied.
    ``keep=False`` (the fast path, whose steps hold no [B, d] matrices) lowers the mmap threshold to
    32 MiB: keeping every block below 1 GiB on the heap fragmented it and raised the peak (a 64M GPT
    at B = 128: 9.5 GB resident for 7.2 GB of allocations; 7.4 GB at 32 MiB, and no slower).

    Every step allocates per-example gradient matrices of hundreds of MB (B x d floats). With glibc's
    defaults each such block is a fresh ``mmap`` whose pages all fault on first touch and go back to
    the kernel on free: on Fashion-MNIST (scatter-linear, cnn; B = 2048) that kernel time was as
    large as the computation itself. Raising the mmap and trim thresholds removes it (measured: sys
    time per step 0.8 s -> 0.002 s). Process-wide, so only the commands call it, not the library.
    """
    import ctypes
    import sys
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        ok = libc.mallopt(m_mmap_threshold, 1 << 30 if keep else 32 << 20) == 1
        libc.mallopt(m_trim_threshold, (1 << 31) - 1)
        libc.mallopt(m_top_pad, 256 << 20)
        return ok
    except (OSError, AttributeError):  # not glibc
        return False
