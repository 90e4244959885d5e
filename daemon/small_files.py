"""The small files specd reads back or is pointed at (its learned state, its pid file, a
YAML configuration, an API key, the tail of its log) read as hostile input: a regular file
only (opened without blocking: opening a FIFO waits for a writer, forever), and never
more than a stated number of bytes (a link to /dev/zero, or a file grown past any real
one, would fill memory). Model files have their own checks (modeling/checkpoints/)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from modeling.checkpoints.regular import open_regular

MAX_KEY_BYTES = 4096  # an API key file: a key is a line


class SmallFileError(ValueError):
    """A file that is not one to read: not a regular file, or past its size limit."""


def regular(path: Path) -> os.stat_result:
    """`path`'s stat, or a SmallFileError where it is not a regular file (an OSError where
    it is not there)."""
    info = os.stat(path)  # (links followed: a link to a regular file is one)
    if not stat.S_ISREG(info.st_mode):
        raise SmallFileError(f"{path}: not a regular file (a FIFO, a device or a folder)")
    return info


def read_small(path: Path, limit: int) -> bytes:
    """`path`'s bytes, at most `limit` of them, or a SmallFileError saying why not (an
    OSError where it is not there). Opened as model files are (`open_regular`: without
    blocking, and checked once open)."""
    try:
        fd = open_regular(path)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        raise SmallFileError(f"{path}: not a regular file (a FIFO, a device or a folder)") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise SmallFileError(f"{path}: {size:,} bytes, past the {limit:,} such a file may hold")
        data = f.read(limit + 1)  # (a file that grew since its stat)
    if len(data) > limit:
        raise SmallFileError(f"{path}: past the {limit:,} bytes such a file may hold")
    return data
