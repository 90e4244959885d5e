"""Where the background daemon's state is kept (`ServicePaths`: its pid file, its log) and
what `specd start` records of it in the pid file (`DaemonRecord`), read as hostile."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from daemon.small_files import read_small

SERVICE_NAME = "specd"


@dataclass(frozen=True)
class ServicePaths:
    state_dir: Path
    log_dir: Path

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "specd.pid"

    @property
    def log_file(self) -> Path:
        return self.log_dir / "specd.log"


def default_paths() -> ServicePaths:
    return ServicePaths(
        Path(platformdirs.user_state_dir(SERVICE_NAME)),
        Path(platformdirs.user_log_dir(SERVICE_NAME)),
    )


@dataclass
class DaemonRecord:
    """What `specd start` leaves in the pid file for `stop` and `status`: the pid, and
    what tells the daemon's process apart from a later one the system gave the same pid
    (its start time, as the kernel records it), and the API key file it serves with, whose
    key `status` and `chat` send it (a `--config` given to `start` alone may name one)."""

    pid: int
    url: str
    created: float | None = None  # psutil's create_time of the daemon's process
    key_file: str | None = None  # an absolute path

    @classmethod
    def read(cls, paths: ServicePaths) -> DaemonRecord | None:
        """The pid file's record, or None where there is none or it is not one specd wrote
        (read as hostile: a regular file of at most PID_FILE_BYTES, each value checked)."""
        try:
            data = json.loads(read_small(paths.pid_file, PID_FILE_BYTES))
        except (OSError, ValueError, RecursionError):
            return None
        if not isinstance(data, dict):
            return None
        pid, url, created = data.get("pid"), data.get("url"), data.get("created")
        key_file = data.get("key_file")
        if type(pid) is not int or not 0 < pid < MAX_PID:
            return None
        if not (isinstance(url, str) and URL.fullmatch(url)):
            return None
        if created is not None and not (
            isinstance(created, (int, float)) and 0 < created < 1e11  # (seconds since 1970)
        ):
            return None
        if key_file is not None and not (
            isinstance(key_file, str)
            and 0 < len(key_file) <= MAX_PATH_CHARS
            and "\0" not in key_file
            and Path(key_file).is_absolute()
        ):
            return None
        return cls(pid, url, None if created is None else float(created), key_file)

    def write(self, paths: ServicePaths) -> None:
        paths.state_dir.mkdir(parents=True, exist_ok=True)
        body: dict[str, object] = {"pid": self.pid, "url": self.url, "created": self.created}
        if self.key_file is not None:
            body["key_file"] = self.key_file
        paths.pid_file.write_text(json.dumps(body))


PID_FILE_BYTES = 4096
MAX_PATH_CHARS = 1024  # a recorded key file's path (the pid file holds at most PID_FILE_BYTES)
MAX_PID = 1 << 22  # Linux's pid_max limit (macOS's is lower)
URL = re.compile(r"http://[A-Za-z0-9.:\[\]%-]{1,300}")  # what `daemon_url` makes
