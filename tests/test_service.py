"""Background service plumbing: service files rendered (never enabled in tests), pid
records, and start/stop/status behaviour when nothing is running."""

from __future__ import annotations

import plistlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from daemon import service, service_files
from daemon.cli import main


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("XDG_CONFIG_HOME", "XDG_STATE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    return tmp_path


def test_systemd_unit(dirs: Path) -> None:
    spec = service_files.service_file(
        "linux", ["--model", "/m/x", "--port", "9000"], Path("/srv"), dirs, service.default_paths()
    )
    assert spec.path == dirs / "xdg_config_home" / "systemd" / "user" / "specd.service"
    assert (
        "ExecStart=" in spec.content
        and "-m daemon.cli serve --model /m/x --port 9000" in spec.content
    )
    assert "WorkingDirectory=/srv" in spec.content and "WantedBy=default.target" in spec.content
    assert "systemctl --user enable --now specd" in spec.enable_hint
    # Its output goes where `specd logs` reads, not only to the journal.
    log = service.default_paths().log_file
    assert f"StandardOutput=append:{log}" in spec.content
    assert f"StandardError=append:{log}" in spec.content
    assert "specd logs" in spec.enable_hint


def test_launchd_plist_is_valid_xml(dirs: Path) -> None:
    paths = service.default_paths()
    spec = service_files.service_file("darwin", ["--model", "a&b"], Path("/srv"), dirs, paths)
    plist = plistlib.loads(spec.content.encode())
    assert plist["Label"] == service_files.LAUNCHD_LABEL
    assert plist["ProgramArguments"][-3:] == ["serve", "--model", "a&b"]
    assert plist["RunAtLoad"] is True and plist["StandardErrorPath"] == str(paths.log_file)
    assert spec.path.name.endswith(".plist") and "LaunchAgents" in str(spec.path)


def test_unsupported_platform(dirs: Path) -> None:
    with pytest.raises(service.ServiceError, match="specd start"):
        service_files.service_file("win32", [], Path("/"), dirs, service.default_paths())


def test_service_install_writes_the_unit(
    dirs: Path, capsys: pytest.CaptureFixture[str], stories_target: Path
) -> None:
    assert main(["service", "install", "--platform", "linux", "--model", str(stories_target)]) == 0
    out = capsys.readouterr().out
    unit = dirs / "xdg_config_home" / "systemd" / "user" / "specd.service"
    assert f"wrote {unit}" in out and "systemctl --user" in out
    assert f"--model {stories_target}" in unit.read_text()
    assert service.default_paths().log_file.parent.is_dir()  # systemd makes the file only
    assert main(["service", "install", "--platform", "darwin", "--print", "--model", "m"]) == 0
    assert "<plist" in capsys.readouterr().out
    # No model configured: said at install, not by a unit restarting every few seconds.
    assert main(["service", "install", "--platform", "linux", "--print"]) == 2
    assert "no target model configured" in capsys.readouterr().err


def test_pid_record_round_trip(dirs: Path) -> None:
    paths = service.default_paths()
    assert service.DaemonRecord.read(paths) is None
    service.DaemonRecord(1234, "http://127.0.0.1:1", 1.5e9).write(paths)
    assert service.DaemonRecord.read(paths) == service.DaemonRecord(
        1234, "http://127.0.0.1:1", 1.5e9
    )
    assert paths.pid_file.parent == dirs / "xdg_state_home" / "specd"


def test_stop_and_status_when_not_running(dirs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = service.default_paths()
    service.DaemonRecord(2**22 + 12345, "http://127.0.0.1:9").write(paths)  # a stale pid
    assert main(["stop"]) == 0
    assert "was not running" in capsys.readouterr().out
    assert not paths.pid_file.exists()
    assert main(["status", "--port", "9"]) == 3
    assert "not answering" in capsys.readouterr().out


def test_start_without_a_model_fails_before_forking(
    dirs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["start"]) == 2
    assert "no target model configured" in capsys.readouterr().err
    assert not service.default_paths().pid_file.exists()


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_start_on_a_taken_port_is_one_line_before_forking(
    dirs: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    def no_fork(*args: object, **kwargs: object) -> None:
        raise AssertionError("specd start forked a daemon onto a taken port")

    monkeypatch.setattr(service.subprocess, "Popen", no_fork)
    assert main(["start", "--model", "m", "--port", str(taken_port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"specd: error: cannot listen on 127.0.0.1:{taken_port}: the address is already in use "
        "(another specd, or another program); pick another port with --port PORT or "
        "server.port in the config"
    ]
    assert not service.default_paths().pid_file.exists()


def test_serve_on_a_taken_port_is_one_line(
    dirs: Path, capsys: pytest.CaptureFixture[str], stories_target: Path, taken_port: int
) -> None:
    # The daemon binds before it loads any model: the failure comes at once.
    argv = ["serve", "--model", str(stories_target), "--port", str(taken_port)]
    assert main([*argv, "--log-level", "error"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specd: error: cannot listen on 127.0.0.1:{taken_port}: ")
    assert len(err.strip().splitlines()) == 1 and "--port PORT or server.port" in err


def test_a_failed_start_shows_only_its_own_log_lines(
    dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = service.default_paths()
    paths.log_dir.mkdir(parents=True)
    paths.log_file.write_text("specd: error: the previous attempt's failure\n")
    failing = [sys.executable, "-c", "print('specd: error: this attempt'); raise SystemExit(2)"]
    monkeypatch.setattr(service, "serve_command", lambda flags: failing)
    with pytest.raises(service.ServiceError) as info:
        service.start(paths, [], "http://127.0.0.1:9", wait_seconds=60)
    message = str(info.value)
    assert message == (
        f"specd exited during start-up (status 2): this attempt (its log: {paths.log_file})"
    )
    assert "previous attempt" in paths.log_file.read_text()  # the log itself keeps both


def test_a_failed_start_says_its_last_error_once() -> None:
    """The daemon's own log lines (timestamped, the same failure logged twice): the last
    error's message alone, not the tail joined into one long line."""
    log = (
        "2026-12-07 18:36:55,001 INFO specd.server: listening on http://127.0.0.1:8716\n"
        "2026-12-07 18:36:55,412 ERROR specd.engine: loading the models failed: no cuda\n"
        "2026-12-07 18:36:55,413 ERROR specd.server: specd cannot serve: no cuda\n"
    )
    assert service.start_failure(log) == "specd cannot serve: no cuda"
    assert service.start_failure("Traceback...\nKeyError: 'x'\n") == "KeyError: 'x'"
    # An exception after an earlier, unrelated error: the exception ended the run.
    crashed = (
        "2026-12-07 18:36:55,412 ERROR specd.compile: a background compile failed\n"
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "torch.OutOfMemoryError: CUDA out of memory\n"
    )
    assert service.start_failure(crashed) == "torch.OutOfMemoryError: CUDA out of memory"
    assert service.start_failure("") == "it wrote nothing"


def test_a_broken_user_config_does_not_stop_stop_or_status(
    dirs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = dirs / "xdg_config_home" / "specd" / "specd.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("models:\n  dtype: fp8\n")
    service.DaemonRecord(2**22 + 12345, "http://127.0.0.1:9").write(service.default_paths())
    assert main(["stop"]) == 0
    assert "was not running" in capsys.readouterr().out
    assert main(["status", "--port", "9"]) == 3
    captured = capsys.readouterr()
    assert "not answering at http://127.0.0.1:9" in captured.out
    assert f"{config}: models.dtype: 'fp8' is not allowed" in captured.err
    assert "configuration ignored" in captured.err


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen]:
    """An unrelated program: what a pid the system reused would name."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("created", ["earlier", "unrecorded", "its own"])
def test_a_reused_pid_is_never_signalled(
    dirs: Path, capsys: pytest.CaptureFixture[str], stranger: subprocess.Popen, created: str
) -> None:
    """The pid file names a pid that now belongs to another program: a process started
    after the daemon was (the recorded start time differs), or, for a pid file written
    before start times were kept, one whose command line is not `specd serve`, or a
    hostile file that gives the program's own start time (`stop` killed it). Status says
    not running, stop leaves it alone, and start is not refused."""
    paths = service.default_paths()
    started = psutil.Process(stranger.pid).create_time()
    when = {"earlier": started - 30.0, "unrecorded": None, "its own": started}[created]
    service.DaemonRecord(stranger.pid, "http://127.0.0.1:9", when).write(paths)
    assert main(["status", "--port", "9"]) == 3
    assert "not running" in capsys.readouterr().out
    assert main(["stop"]) == 0
    assert "was not running" in capsys.readouterr().out
    assert stranger.poll() is None  # still running: no signal reached it
    assert not paths.pid_file.exists()


def test_a_dead_daemon_left_as_a_zombie_is_gone(dirs: Path) -> None:
    """A SIGKILLed daemon that its parent has not reaped yet is a zombie: not running."""
    proc = subprocess.Popen(["sleep", "0"])
    record = service.DaemonRecord(
        proc.pid, "http://127.0.0.1:9", psutil.Process(proc.pid).create_time()
    )
    deadline = time.monotonic() + 10
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)  # waiting on the child's exit, a condition, not a duration
    try:
        assert not service.alive(record)
    finally:
        proc.wait()


def test_start_refuses_only_for_the_recorded_process(
    dirs: Path, stranger: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = service.default_paths()
    # A process whose command line is `specd serve`'s (it only sleeps).
    serving = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "-m", "daemon.cli", "serve"]
    )
    try:
        deadline = time.monotonic() + 10
        while "serve" not in psutil.Process(serving.pid).cmdline():  # (until it has exec'd)
            assert time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.01)
        created = psutil.Process(serving.pid).create_time()
        service.DaemonRecord(serving.pid, "http://127.0.0.1:9", created).write(paths)
        with pytest.raises(service.ServiceError, match="already running"):
            service.start(paths, [], "http://127.0.0.1:9", 5.0)
    finally:
        serving.kill()
        serving.wait()
    # A stale record: start goes on (here to a "daemon" that exits at once).
    monkeypatch.setattr(
        service, "serve_command", lambda flags: [sys.executable, "-c", "raise SystemExit(3)"]
    )
    stale = psutil.Process(stranger.pid).create_time() - 30.0
    service.DaemonRecord(stranger.pid, "http://127.0.0.1:9", stale).write(paths)
    with pytest.raises(service.ServiceError, match=r"exited during start-up \(status 3"):
        service.start(paths, [], "http://127.0.0.1:9", 5.0)
    assert stranger.poll() is None


def test_stop_takes_the_address_status_takes(
    dirs: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`specd stop --port` names which daemon: the background one if it listens there;
    one elsewhere is left running, saying where it is."""
    paths = service.default_paths()
    service.DaemonRecord(4321, "http://127.0.0.1:9").write(paths)
    stopped: list[Path] = []
    monkeypatch.setattr(service, "alive", lambda record: True)
    monkeypatch.setattr(service, "stop", lambda p, wait: stopped.append(p.pid_file) or 4321)
    assert main(["stop", "--port", "10"]) == 1
    assert "listens at http://127.0.0.1:9, not http://127.0.0.1:10" in capsys.readouterr().err
    assert stopped == []
    assert main(["stop", "--port", "9"]) == 0
    assert "specd (pid 4321) stopped" in capsys.readouterr().out
    assert stopped == [paths.pid_file]
    # Another name of the same address: the daemon answering there reports the record's pid.
    answering = {"http://localhost:9": 4321, "http://localhost:10": 999}
    monkeypatch.setattr(
        service,
        "fetch_health",
        lambda url: (200, {"pid": answering[url]}) if url in answering else (0, {}),
    )
    assert main(["stop", "--host", "localhost", "--port", "9"]) == 0
    assert stopped == [paths.pid_file] * 2
    assert main(["stop", "--host", "localhost", "--port", "10"]) == 1
    assert stopped == [paths.pid_file] * 2


def test_status_and_chat_ask_the_daemon_the_command_line_names(
    dirs: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background daemon listens at :9. `status --port 10` and `chat --port 10` ask :10
    (they asked :9, the pid file's, and reported its model); without an address they ask
    the background one. A broken configuration's problems are shown either way."""
    paths = service.default_paths()
    service.DaemonRecord(4321, "http://127.0.0.1:9").write(paths)
    monkeypatch.setattr(service, "alive", lambda record: True)
    asked: list[str] = []
    monkeypatch.setattr(service, "fetch_health", lambda url: asked.append(url) or (0, {}))
    assert main(["status", "--port", "10"]) == 3
    assert "not answering at http://127.0.0.1:10 (not running)" in capsys.readouterr().out
    config = dirs / "xdg_config_home" / "specd" / "specd.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("models:\n  dtype: fp8\n")
    assert main(["status"]) == 3
    captured = capsys.readouterr()
    assert "not answering at http://127.0.0.1:9 (pid 4321)" in captured.out
    assert "models.dtype: 'fp8' is not allowed" in captured.err
    assert "asking" not in captured.err  # (the pid file's address was asked, not the flags')
    assert asked == ["http://127.0.0.1:10", "http://127.0.0.1:9"]
    # The background daemon asked by another name of its address is still known by its pid.
    monkeypatch.setattr(
        service, "fetch_health", lambda url: (503, {"pid": 4321, "status": "loading"})
    )
    assert main(["status", "--host", "localhost", "--port", "9"]) == 1
    assert "loading at http://localhost:9 (pid 4321)" in capsys.readouterr().out
    config.unlink()
    assert main(["chat", "--port", "10", "--once", "hi"]) == 1
    assert "127.0.0.1:10" in capsys.readouterr().err


def test_one_start_at_a_time(dirs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a start runs (it holds the start lock), another is refused at once: two at
    once each spawned a daemon, and the pid file could name the one that lost the port."""
    import fcntl

    paths = service.default_paths()
    paths.state_dir.mkdir(parents=True)
    with open(paths.state_dir / "specd.start.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(service.ServiceError, match="another `specd start` is starting"):
            service.start(paths, [], "http://127.0.0.1:9", 5.0)
    # Released: a start goes on (here to a "daemon" that exits at once).
    monkeypatch.setattr(
        service, "serve_command", lambda flags: [sys.executable, "-c", "raise SystemExit(3)"]
    )
    with pytest.raises(service.ServiceError, match=r"exited during start-up \(status 3"):
        service.start(paths, [], "http://127.0.0.1:9", 5.0)


def test_a_start_is_ready_only_when_its_own_daemon_answers(
    dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another server answering ready at the URL (the daemon of a start that won the port)
    is not this start's daemon: this one's exit is reported, and the pid file it wrote is
    removed; the other's answer was taken for its own."""
    paths = service.default_paths()
    monkeypatch.setattr(service, "fetch_health", lambda url, timeout=2.0: (200, {"pid": 1}))
    monkeypatch.setattr(
        service,
        "serve_command",
        lambda flags: [sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(1)"],
    )
    with pytest.raises(service.ServiceError, match=r"exited during start-up \(status 1"):
        service.start(paths, [], "http://127.0.0.1:9", 10.0)
    assert not paths.pid_file.exists()


def test_status_and_chat_send_the_key_the_background_daemon_was_started_with(
    dirs: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specd start --config FILE` whose file names `server.api_key_file` (the user config
    names none): a plain `status` and `chat` send that key (they sent none, and were
    answered 401); one naming an address sends the configuration's."""
    import daemon.cli.chat as chat_cli

    monkeypatch.chdir(dirs)
    (dirs / "key.txt").write_text("s3cret\n")
    config = dirs / "key.yaml"
    config.write_text(
        "models:\n  target: ../models/x.gguf\nserver:\n  port: 9\n  api_key_file: key.txt\n"
    )
    started: list[str | None] = []

    def fake_start(paths, flags, url, wait, listen, key_file=None):  # type: ignore[no-untyped-def]
        started.append(key_file)
        record = service.DaemonRecord(4321, url, None, key_file)
        record.write(paths)
        return record

    monkeypatch.setattr(service, "start", fake_start)
    assert main(["start", "--config", str(config)]) == 0
    assert started == [str(dirs / "key.txt")]
    assert service.DaemonRecord.read(service.default_paths()).key_file == str(dirs / "key.txt")
    monkeypatch.setattr(service, "alive", lambda record: True)
    monkeypatch.setattr(service, "fetch_health", lambda url, timeout=2.0: (200, {"pid": 4321}))
    sent: list[str | None] = []
    monkeypatch.setattr(
        service,
        "fetch_json",
        lambda url, api_key=None, timeout=2.0: (sent.append(api_key), (0, {}))[1],
    )
    assert main(["status"]) == 0
    asked: list[tuple[str, str | None]] = []
    monkeypatch.setattr(
        chat_cli,
        "ask",
        lambda options, conversation, text, screen: (
            asked.append((options.url, options.api_key)) or type("Answer", (), {"stopped": False})()
        ),
    )
    assert main(["chat", "--once", "hi"]) == 0
    assert sent == ["s3cret"] and asked == [("http://127.0.0.1:9", "s3cret")]
    # Naming an address asks that daemon with the configuration's key (none here).
    assert main(["status", "--port", "9"]) == 0
    assert sent == ["s3cret", None]
    # A record that is not one specd wrote (a relative key path) is no record.
    paths = service.default_paths()
    paths.pid_file.write_text('{"pid": 4321, "url": "http://127.0.0.1:9", "key_file": "k"}')
    assert service.DaemonRecord.read(paths) is None
