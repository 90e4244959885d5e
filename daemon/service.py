"""The daemon as a background process: start/stop/status (its pid and log files and the
pid record: daemon/service_state.py).
Its service files for systemd (user unit) and launchd (agent) are daemon/service_files.py;
rendering one never runs systemctl or launchctl, the user is told the commands."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil

# (the paths and the pid record, named here as the callers know them)
from daemon.service_state import SERVICE_NAME as SERVICE_NAME
from daemon.service_state import DaemonRecord as DaemonRecord
from daemon.service_state import ServicePaths as ServicePaths
from daemon.service_state import default_paths as default_paths
from daemon.small_files import SmallFileError, regular

LAUNCHD_LABEL = "dev.specd.daemon"


class ServiceError(RuntimeError):
    """The background daemon cannot be started, stopped or reached as asked."""


class ListenError(ServiceError):
    """The daemon's address cannot be listened on (taken by another program, or not ours)."""

    def __init__(self, host: str, port: int, error: OSError) -> None:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if error.errno == errno.EADDRINUSE:
            why = "the address is already in use (another specd, or another program)"
            fix = "pick another port with --port PORT or server.port in the config"
        elif error.errno == errno.EACCES:
            why = error.strerror or str(error)
            fix = "pick a port above 1023 with --port PORT or server.port in the config"
        else:  # (an address this machine does not have, a name that does not resolve)
            why = error.strerror or str(error)
            fix = "give one of this machine's addresses with --host HOST or server.host"
        super().__init__(f"cannot listen on {where}: {why}; {fix}")


def check_listen(host: str, port: int) -> None:
    """Raise ListenError if `host:port` cannot be bound now, as the daemon would bind it
    (every address the name resolves to, SO_REUSEADDR as asyncio sets it). Port 0 (any
    free port) always can."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in infos:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
    except OSError as exc:
        raise ListenError(host, port, exc) from None


def check_pid_file(paths: ServicePaths) -> None:
    """A ServiceError where the pid file cannot be kept (its path is a folder, a FIFO):
    checked before a daemon is started, which `stop` would otherwise never find."""
    _check_keepable(paths.pid_file, "the pid file")


def _check_keepable(path: Path, what: str) -> None:
    try:
        regular(path)
    except FileNotFoundError:
        return
    except (OSError, SmallFileError) as exc:
        raise ServiceError(f"{what} cannot be kept: {exc}; remove {path} and start again") from None


# The start times psutil reads for one process agree to the clock tick; two processes
# started this close on one pid cannot both exist.
CREATED_TOLERANCE = 0.05


def alive(record: DaemonRecord) -> bool:
    """Whether the recorded daemon is still running: its pid names a live process (a
    zombie is gone) that is that process, started when recorded and running `specd serve`.
    A pid the system has since given to another program is not ours: status says not
    running, start proceeds, and stop never signals it."""
    try:
        proc = psutil.Process(record.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        # Its start time, where recorded, tells it apart from a later process given the
        # same pid; its command line, from any other process a hostile file names.
        started = record.created
        if started is not None and abs(proc.create_time() - started) > CREATED_TOLERANCE:
            return False
        return _serves(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return False  # another user's process: never ours


def _serves(argv: list[str]) -> bool:
    """Whether a command line is `specd serve`'s (`serve_command`, or the console script)."""
    return "serve" in argv and any(a.endswith(("daemon.cli", "specd")) for a in argv)


def fetch_health(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    """(status, body) of GET /health; (0, {}) when nothing answers."""
    return fetch_json(url + "/health", timeout=timeout)


def answers_at(record: DaemonRecord, url: str, health: dict | None = None) -> bool:
    """Whether the recorded daemon is the one at `url`: its own URL, or another name for it
    (localhost for 127.0.0.1, the machine's name) on its port, known by the pid its /health
    reports (`health`: that body, where the caller has asked already)."""
    if record.url == url:
        return True
    if urllib.parse.urlsplit(record.url).port != urllib.parse.urlsplit(url).port:
        return False  # (another machine's daemon may report the same pid)
    if health is None:
        health = fetch_health(url)[1]
    return health.get("pid") == record.pid


def fetch_json(url: str, api_key: str | None = None, timeout: float = 2.0) -> tuple[int, dict]:
    """(status, body) of a GET that answers JSON; (0, {}) when nothing answers."""
    request = urllib.request.Request(url)
    if api_key is not None:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            body = json.loads(resp.read() or b"{}")
            return resp.status, body if isinstance(body, dict) else {}
    except urllib.error.HTTPError as err:
        try:
            body = json.loads(err.read() or b"{}")
        except ValueError:
            return err.code, {}
        return err.code, body if isinstance(body, dict) else {}
    except (OSError, ValueError):
        return 0, {}


def serve_command(flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "daemon.cli", "serve", *flags]


def start(
    paths: ServicePaths,
    flags: list[str],
    url: str,
    wait_seconds: float,
    listen: tuple[str, int] | None = None,
    key_file: str | None = None,
) -> DaemonRecord:
    """Start `specd serve` detached, logging to the log file; wait until /health says ready.
    `key_file`: the API key file it serves with, recorded for `status` and `chat`.
    `listen` (host, port) is checked first, so a taken port is one line, not a failed start.
    One start at a time (`_start_lock`): two at once each spawned a daemon, and the pid
    file could name the one that lost the port while the other served, out of `stop`'s
    reach."""
    with _start_lock(paths):
        return _start(paths, flags, url, wait_seconds, listen, key_file)


@contextlib.contextmanager
def _start_lock(paths: ServicePaths) -> Iterator[None]:
    """An exclusive lock on `specd.start.lock` in the state folder for as long as a start
    runs (released by the kernel if the process dies); a ServiceError at once if another
    start holds it."""
    try:
        import fcntl
    except ImportError:  # (no flock on this system: starts are not serialised)
        yield
        return
    lock = paths.state_dir / "specd.start.lock"
    try:
        paths.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        raise ServiceError(
            f"the start lock cannot be kept: {exc}; remove {lock} and start again"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ServiceError(
                "another `specd start` is starting specd now; `specd status` shows it once it is up"
            ) from None
        yield
    finally:
        os.close(fd)


def _start(
    paths: ServicePaths,
    flags: list[str],
    url: str,
    wait_seconds: float,
    listen: tuple[str, int] | None,
    key_file: str | None = None,
) -> DaemonRecord:
    record = DaemonRecord.read(paths)
    if record is not None and alive(record):
        raise ServiceError(
            f"specd is already running (pid {record.pid}) at {record.url}; `specd stop` stops it"
        )
    if listen is not None:
        check_listen(*listen)
    check_pid_file(paths)
    _check_keepable(paths.log_file, "the log")  # (opening a FIFO to append would wait)
    paths.log_dir.mkdir(parents=True, exist_ok=True)
    rotate_log(paths.log_file)
    with open(paths.log_file, "ab") as log:
        # The log keeps every run; a failed start shows only what this run wrote.
        this_run = log.tell()
        proc = subprocess.Popen(
            serve_command(flags),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the terminal that started it
            cwd=os.getcwd(),
        )
    record = DaemonRecord(proc.pid, url, _created(proc.pid), key_file)
    record.write(paths)
    deadline = time.monotonic() + wait_seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if DaemonRecord.read(paths) == record:  # (only the record this start wrote)
                paths.pid_file.unlink(missing_ok=True)
            why = start_failure(tail(paths.log_file, 15, start=this_run))
            raise ServiceError(
                f"specd exited during start-up (status {proc.returncode}): {why} (its log: "
                f"{paths.log_file})"
            )
        status, body = fetch_health(url, timeout=1.0)
        if status == 200 and body.get("pid") == proc.pid:  # (ours, not another at the URL)
            return record
        time.sleep(0.05)  # polling a child process's readiness: a cheap local request
    raise ServiceError(
        f"specd (pid {proc.pid}) did not become ready within {wait_seconds:.0f} s; "
        f"see {paths.log_file} (it keeps loading in the background)"
    )


LOG_KEEP_BYTES = 64 << 20  # a log past this at a start becomes specd.log.1 (one kept)


def rotate_log(file: Path) -> None:
    """The log keeps every run's lines: past LOG_KEEP_BYTES, a start moves it to
    `specd.log.1` (replacing the one before) and begins a new one."""
    with contextlib.suppress(OSError, SmallFileError):
        if regular(file).st_size > LOG_KEEP_BYTES:
            os.replace(file, file.with_name(file.name + ".1"))


def _created(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def stop(paths: ServicePaths, wait_seconds: float = 30.0) -> int | None:
    """SIGTERM the daemon and wait for it; returns its pid, or None if none was running
    (a pid file naming a process that is not the recorded daemon is removed, and that
    process left alone)."""
    record = DaemonRecord.read(paths)
    if record is None or not alive(record):
        check_pid_file(paths)  # (a folder there: one line, not unlink's traceback)
        paths.pid_file.unlink(missing_ok=True)
        return None
    os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_seconds
    while alive(record) and time.monotonic() < deadline:
        _reap(record.pid)
        time.sleep(0.1)
    if alive(record):
        raise ServiceError(f"specd (pid {record.pid}) did not stop within {wait_seconds:.0f} s")
    paths.pid_file.unlink(missing_ok=True)
    return record.pid


def _reap(pid: int) -> None:
    """If the daemon is our own child (started in this process), collect its exit status."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


TAIL_BYTES = 1 << 20  # what is read of a log's end for its last lines


# A log line's level and logger, before its message ("... ERROR specd.server: MESSAGE").
_LOGGED = re.compile(r".*? (?:ERROR|CRITICAL) [\w.]+: ")


def start_failure(log: str) -> str:
    """Why a daemon exited as it started, from what this run logged: its last error's
    message (the CLI's `specd: error: ...` line, or a logged ERROR), else the last line.
    (The whole tail, several timestamped lines joined, read as one long line.)"""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("specd: error: "):
            return line.removeprefix("specd: error: ")
        if line.startswith("Traceback (most recent call last)"):
            return lines[-1]  # (an exception that ended it: its own line, the traceback's last)
        logged = _LOGGED.match(line)
        if logged is not None:
            return line[logged.end() :]
    return lines[-1] if lines else "it wrote nothing"


def tail(file: Path, lines: int, start: int = 0) -> str:
    """The last `lines` lines of `file`, reading from byte offset `start` (at most its
    last TAIL_BYTES)."""
    try:
        size = regular(file).st_size
        with open(file, "rb") as f:
            f.seek(max(start, size - TAIL_BYTES))
            text = f.read(TAIL_BYTES).decode(errors="replace")
    except (OSError, SmallFileError):
        return ""
    return "\n".join(text.splitlines()[-lines:])
