"""The Hugging Face hub cache's model repositories, each by its newest snapshot
(`hub_snapshots`), for `specd models` and the draft `auto` looks for: the cache's folders
are walked as hostile (bounded in repositories, revisions and files; a FIFO or a link to
a device never opened)."""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

# The most repositories of the hub cache listed, and files of a snapshot measured.
MAX_HUB_REPOS = 4096
MAX_SNAPSHOTS = 256  # revisions of one repository looked at
MAX_SNAPSHOT_FILES = 4096


@dataclass(frozen=True)
class HubSnapshot:
    repo_id: str
    path: Path  # the newest snapshot's folder
    size: int  # bytes of its files (at most MAX_SNAPSHOT_FILES of them)


def hub_snapshots() -> list[HubSnapshot]:
    """The hub cache's model repositories, each by its newest snapshot (the snapshot folder
    written last: the hub's own scan took its newest file), found by walking the cache's
    folders: the hub library's `scan_cache_dir`
    reads every `refs/` file whole, and a FIFO there hung `specd models` (and every command
    whose draft is `auto`), a link to /dev/zero filled the memory."""
    from huggingface_hub import constants

    try:
        repos = sorted(
            p for p in Path(constants.HF_HUB_CACHE).iterdir() if p.name.startswith("models--")
        )[:MAX_HUB_REPOS]
    except OSError:  # no cache (or none readable)
        return []
    found = []
    for repo in repos:
        try:
            entries = list(itertools.islice((repo / "snapshots").iterdir(), MAX_SNAPSHOTS))
        except OSError:
            continue
        folders = []
        for path in entries:
            with contextlib.suppress(OSError):  # (a dangling link hides only itself)
                if path.is_dir():
                    folders.append((path.stat().st_mtime, path))
        if folders:
            newest = max(folders)[1]
            repo_id = repo.name.removeprefix("models--").replace("--", "/")
            found.append(HubSnapshot(repo_id, newest, _files_size(newest)))
    return found


def _files_size(folder: Path) -> int:
    """Bytes of the files under `folder` (a snapshot's links to its blobs followed), at most
    MAX_SNAPSHOT_FILES of them; what cannot be read counts nothing."""
    size = seen = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            seen += 1
            if seen > MAX_SNAPSHOT_FILES:
                return size
            with contextlib.suppress(OSError):
                size += (Path(parent) / name).stat().st_size
    return size
