"""Files that are never half-written (``atomic_write``), JSON without infinities (``jsonable``), run
directories that one run at a time may use (``run_lock``), the fresh default output directory of
each run (``new_run_dir``), and the folder of clipbias's small JSON caches (``cache_directory``)."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import ConfigError, WriteError

LOCK = ".clipbias.lock"


def cache_directory() -> Path | None:
    """The folder of clipbias's small JSON caches (calibrations, optimised noise strategies, the command
    line's choices): ``$CLIPBIAS_CACHE``, else ``$XDG_CACHE_HOME/clipbias``, else ``~/.cache/clipbias``;
    None where ``CLIPBIAS_CACHE=off`` disables them."""
    env = os.environ.get("CLIPBIAS_CACHE")
    if env == "off":
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clipbias"


def jsonable(obj: Any) -> Any:
    """inf/nan -> strings (JSON has no infinity; epsilon = inf must never read as a number)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def atomic_write(path: Path, write: Callable[[Any], None], mode: int | None = None) -> None:
    """Write ``path`` through a temporary file in the same directory and ``os.replace``: a failure or a
    kill leaves the old file (or none), never a half-written one, and a hard link to the old file is
    left alone rather than overwritten. ``mode``: permissions of the new file (e.g. 0o600 for private
    checkpoints; default: 0o666 less the umask, as for any new file)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)  # a stale temporary would keep its old permissions
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)  # umask applies
        with os.fdopen(fd, "wb") as raw:
            stream = _Stream(raw)
            try:
                write(stream)
            except Exception as e:  # torch.save reports a failed write (ENOSPC, Ctrl-C) as "unexpected pos"
                if stream.error is not None and stream.error is not e:
                    raise stream.error from None
                raise
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, (FileExistsError, NotADirectoryError)):  # mkdir or open met a file on the way
            raise WriteError(f"cannot write {path}: {e}. A file is in the way of the directory {path.parent}: "
                             f"choose another path") from e
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            raise WriteError(f"cannot write {path}: {e}. Check the free disk space and the write permission "
                             f"of {path.parent}; the previous file, if any, is unchanged") from e
        raise


def new_run_dir(name: str, parent: str | os.PathLike = "runs") -> Path:
    """Create and return ``parent/name-YYYYMMDD-HHMMSS`` (local time; ``-2``, ``-3``, ... appended when
    that exists): the default output directory of a command, new for every run, so two runs never
    write into one directory. Created atomically (``mkdir``), so two runs started in the same second
    get different directories. ``remove_if_empty`` undoes it for a run that wrote nothing."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        Path(parent).mkdir(parents=True, exist_ok=True)
        for n in itertools.count(1):
            path = Path(parent) / (f"{name}-{stamp}" + (f"-{n}" if n > 1 else ""))
            try:
                path.mkdir()
                return path
            except FileExistsError:
                if not path.is_dir():
                    raise
    except OSError as e:
        raise WriteError(f"cannot create a run directory under {parent}: {e}. Make {parent} a writable "
                         f"directory, or choose the output directory with `out` DIR") from e
    raise AssertionError("unreachable")


def remove_if_empty(path: str | os.PathLike) -> None:
    """Remove the directory ``path`` if nothing is in it (a default run directory of a refused run)."""
    with contextlib.suppress(OSError):
        os.rmdir(path)


class _Stream:
    """The file object ``atomic_write`` hands to the writer: it remembers the first exception a write
    raised, because torch.save turns any exception of the stream (a full disk's OSError, the
    KeyboardInterrupt of a Ctrl-C) into a RuntimeError ("unexpected pos"). ``atomic_write`` raises the
    original, so a full disk is a WriteError and a Ctrl-C an interrupt (exit 130), not a traceback."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.error = raw, None

    def write(self, data: Any) -> int:
        try:
            return self.raw.write(data)
        except BaseException as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


@contextlib.contextmanager
def run_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on the run directory ``out`` (created if needed) for the duration.

    A second run on the same directory is refused with a ConfigError instead of interleaving its
    writes with the first. The lock is released when the process ends, however it ends; the lock
    file is removed when the run ends (finished, refused or interrupted: only a killed process leaves
    it, and the next run takes it over). It is unlinked while still locked, so a run that opened the
    old file meanwhile re-checks the inode and takes a new file. A run that wrote nothing (refused)
    also removes a directory it created.
    """
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    before = sorted(p.name for p in out.iterdir() if p.name != LOCK)
    fh = _acquire(out / LOCK)
    try:
        yield
    finally:
        (out / LOCK).unlink(missing_ok=True)
        if created and sorted(p.name for p in out.iterdir()) == before:  # refused before writing anything
            remove_if_empty(out)
        fh.close()


def _acquire(path: Path) -> Any:
    """Open and flock ``path`` (non-blocking); retried if the file was unlinked meanwhile by a run
    that finished without writing, so two runs never hold locks on two different inodes."""
    while True:
        fh = open(path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise ConfigError(f"`out='{path.parent}'` is in use by another clipbias run (it holds {path}); wait "
                              f"for it to finish or choose another `out`") from None
        try:
            if os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
                return fh
        except FileNotFoundError:
            pass
        fh.close()
