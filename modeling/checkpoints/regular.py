"""Opening a file of a model, a store or specd's own state as hostile input: a regular
file only, opened without blocking. Imports nothing heavy: `specd status` reads its pid
file through it (daemon/small_files.py)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def open_regular(path: Path) -> int:
    """A file descriptor for reading the regular file at `path`, else OSError. Opened
    without blocking (a FIFO's open waits for a writer: forever, for a model path) and
    checked once open, so a file swapped for a FIFO after some earlier check is refused."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a folder)")
    return fd
