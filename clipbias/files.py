"""Files that are never half-written (``atomic_write``) and run directories that one run at a time
may use (``run_lock``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import ConfigError, WriteError

LOCK = ".clipbias.lock"


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
    writes with the first. The lock is released when the process ends, however it ends. A directory
    created here that holds nothing but the lock afterwards (the run was refused before writing) is
    removed again.
    """
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    fh = open(out / LOCK, "a+")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"--out {out} is in use by another clipbias run (it holds {out / LOCK}); wait for "
                              f"it to finish or choose another --out") from None
        yield
    finally:
        if created and [p.name for p in out.iterdir()] == [LOCK]:  # refused before writing anything
            (out / LOCK).unlink()
            out.rmdir()
        fh.close()  # the lock file itself stays (unlinking it would let two runs lock two inodes)
