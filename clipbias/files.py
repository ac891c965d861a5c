"""Files that are never half-written: every file clipbias writes goes through ``atomic_write``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


def atomic_write(path: Path, write: Callable[[Any], None], mode: int | None = None) -> None:
    """Write ``path`` through a temporary file in the same directory and ``os.replace``: a failure or a
    kill leaves the old file (or none), never a half-written one, and a hard link to the old file is
    left alone rather than overwritten. ``mode``: permissions of the new file (e.g. 0o600 for private
    checkpoints; default: 0o666 less the umask, as for any new file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a stale temporary would keep its old permissions
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)  # umask applies
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

