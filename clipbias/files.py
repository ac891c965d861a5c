"""Files that are never half-written (``atomic_write``), JSON without infinities (``jsonable``) and run
directories that one run at a time may use (``run_lock``)."""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import ConfigError, WriteError

LOCK = ".clipbias.lock"


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
    writes with the first. The lock is released when the process ends, however it ends. A run that
    wrote nothing (refused) leaves the directory as it found it: a lock file it created is removed
    (still locked, so a waiting run re-checks the inode and takes the new file), and so is a
    directory it created.
    """
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    had_lock = (out / LOCK).exists()
    before = sorted(p.name for p in out.iterdir())
    fh = _acquire(out / LOCK)
    try:
        yield
    finally:
        after = sorted(p.name for p in out.iterdir())
        if not had_lock and [n for n in after if n != LOCK] == [n for n in before if n != LOCK]:
            (out / LOCK).unlink(missing_ok=True)  # refused before writing anything
            if created:
                out.rmdir()
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
            raise ConfigError(f"--out {path.parent} is in use by another clipbias run (it holds {path}); wait "
                              f"for it to finish or choose another --out") from None
        try:
            if os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
                return fh
        except FileNotFoundError:
            pass
        fh.close()
