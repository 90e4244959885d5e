"""The small files specd reads back or is pointed at, read as hostile input
(daemon/small_files.py): its pid file, a YAML configuration (and SPECD_* variables), an API
key file, the log. Each case was a traceback, a hang, memory filled, or an unrelated
process signalled; now each is one line, or the file is set aside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon import service
from daemon.cli import main
from daemon.http.server import read_api_key
from daemon.settings import SettingsError
from daemon.settings_loading import load_settings, read_yaml
from daemon.settings_yaml import MAX_CONFIG_BYTES, MAX_VALUES
from daemon.small_files import SmallFileError, read_small
from tests.conftest import ROOT


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("XDG_CONFIG_HOME", "XDG_STATE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    return tmp_path


def make(path: Path, kind: str) -> Path:
    """A path that is not a file to read: a FIFO, a link to /dev/zero, a folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    return path


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "folder"])
def test_a_file_that_is_no_file_is_not_read(kind: str, tmp_path: Path) -> None:
    with pytest.raises(SmallFileError, match="not a regular file"):
        read_small(make(tmp_path / "x", kind), 100)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(SmallFileError, match="101 bytes, past the 100"):
        read_small(big, 100)


# ---- the pid file ----

BAD_RECORDS = {
    "a negative pid": {"pid": -1, "url": "http://127.0.0.1:9"},
    "a pid past any float": '{"pid": 1e400, "url": "http://127.0.0.1:9"}',
    "a pid as text": {"pid": "12", "url": "http://127.0.0.1:9"},
    "a url that is none": {"pid": 12, "url": "garbage"},
    "a url as a list": {"pid": 12, "url": ["x"]},
    "a start time past any date": {"pid": 12, "url": "http://127.0.0.1:9", "created": 1e300},
    "no mapping": "[1, 2]",
    "deep nesting": "[" * 100_000,
}


@pytest.mark.parametrize("name", list(BAD_RECORDS))
def test_a_pid_file_specd_did_not_write_is_no_daemon(
    name: str, dirs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`{"pid": -1}` made `status`, `stop` and `start` tracebacks until the file was
    removed; `1e400` and a garbage url did too."""
    paths = service.default_paths()
    paths.state_dir.mkdir(parents=True)
    record = BAD_RECORDS[name]
    paths.pid_file.write_text(record if isinstance(record, str) else json.dumps(record))
    assert service.DaemonRecord.read(paths) is None
    assert main(["status", "--port", "9"]) == 3
    assert "not running" in capsys.readouterr().out
    assert main(["stop"]) == 0
    assert "was not running" in capsys.readouterr().out
    assert not paths.pid_file.exists()


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_pid_file_that_is_no_file_is_no_daemon(
    kind: str, dirs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO hung `status` and `stop`; a link to /dev/zero filled memory."""
    paths = service.default_paths()
    make(paths.pid_file, kind)
    assert main(["status", "--port", "9"]) == 3
    capsys.readouterr()


def test_a_pid_file_that_cannot_be_kept_refuses_start_before_the_daemon_runs(
    dirs: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a folder where the pid file goes, `start` launched the daemon and then crashed
    writing the pid file: a daemon no `stop` could find."""
    paths = service.default_paths()
    make(paths.pid_file, "folder")
    launched: list[list[str]] = []
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kw: launched.append(argv))
    with pytest.raises(service.ServiceError, match="the pid file cannot be kept"):
        service.start(paths, [], "http://127.0.0.1:9", 5.0)
    assert launched == []
    assert main(["stop"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the pid file cannot be kept" in err


# ---- the configuration ----

BOMB = "\n".join(
    ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    + ["server:", "  port: *a9"]
)


def test_a_yaml_alias_bomb_is_one_line(tmp_path: Path) -> None:
    """Nine aliases nine levels down: 387 million values from 1 kB. `config validate`
    printed 250 MB of it in its error line, and `status`, `serve` and `start` hung."""
    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB)
    with pytest.raises(SettingsError) as raised:
        read_yaml(config)
    (line,) = raised.value.problems
    assert line.startswith(f"{config}: holds more than {MAX_VALUES:,} values")
    assert len(line) < 300


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("server:\n  port: " + "[" * 20_000, "nested past any configuration"),
        ("server:\n  port: 1" + "0" * 5000, "digits"),
        ("server:\n  port: " + "[" * 40 + "1" + "]" * 40, "nests past 32 levels"),
    ],
)
def test_a_yaml_nesting_or_number_past_any_config_is_one_line(
    text: str, said: str, tmp_path: Path
) -> None:
    config = tmp_path / "specd.yaml"
    config.write_text(text)
    with pytest.raises(SettingsError, match=said):
        read_yaml(config)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "not UTF-8"])
def test_a_config_that_is_no_text_file_is_one_line(kind: str, tmp_path: Path) -> None:
    config = tmp_path / "specd.yaml"
    if kind == "not UTF-8":
        config.write_bytes(b"server:\n  host: \xff\xfe\n")
        said = "not UTF-8 text"
    else:
        make(config, kind)
        said = "not a regular file"
    with pytest.raises(SettingsError, match=said):
        read_yaml(config)


def test_a_config_past_its_bound_is_refused_before_parsing(tmp_path: Path) -> None:
    """1 MiB of one flat list took the pure-Python parser 15 s: a config is at most 256 KiB
    (`MAX_CONFIG_BYTES`), read with libyaml's parser where PyYAML has it."""
    config = tmp_path / "specd.yaml"
    config.write_text("server:\n  allowed_hosts: [" + "a, " * (MAX_CONFIG_BYTES // 3) + "a]\n")
    with pytest.raises(SettingsError, match=f"past the {MAX_CONFIG_BYTES:,} such a file may hold"):
        read_yaml(config)


def test_an_environment_variable_bomb_is_its_problem_line() -> None:
    """The same bomb in SPECD_LIMITS_QUEUE_SIZE hung `config show`, `status` and `stop`."""
    flow = "{" + BOMB.split("\nserver:")[0].replace("\n", ", ") + "}"
    with pytest.raises(SettingsError) as raised:
        load_settings(environ={"SPECD_LIMITS_QUEUE_SIZE": flow})
    (line,) = raised.value.problems
    assert line.startswith("env SPECD_LIMITS_QUEUE_SIZE: holds more than")


def test_a_broken_environment_does_not_stop_stop_or_status(dirs: Path) -> None:
    """docs/cli.md: a broken configuration does not stop `specd stop` or `specd status`."""
    env = {
        **os.environ,
        "XDG_STATE_HOME": str(dirs / "xdg_state_home"),
        "XDG_CONFIG_HOME": str(dirs / "xdg_config_home"),
        "SPECD_LIMITS_QUEUE_SIZE": "1" + "0" * 5000,
        "SPECD_SERVER_PORT": "[" * 100_000,
    }
    for argv in (["status"], ["stop"]):
        done = subprocess.run(
            [sys.executable, "-m", "daemon.cli", *argv],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr
        assert done.returncode in (0, 3), done.stderr


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_an_api_key_file_that_is_no_file_is_one_line(kind: str, tmp_path: Path) -> None:
    """`serve` hung on a FIFO and filled memory from /dev/zero."""
    with pytest.raises(SettingsError, match=r"server\.api_key_file: .*not a regular file"):
        read_api_key(str(make(tmp_path / "key", kind)))


def test_the_log_is_read_from_its_end(tmp_path: Path) -> None:
    """`specd logs` read the whole log (never rotated): an 8 GB one was a MemoryError."""
    log = tmp_path / "specd.log"
    with open(log, "wb") as f:
        f.seek(8 << 30)  # sparse: 8 GB of zeros, on no disk
        f.write(b"\nthe last line\n")
    assert service.tail(log, 1) == "the last line"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_threads_past_the_bound_are_a_usage_error(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specd generate --threads 100000` was a panic in the tokenizers library's pool."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--model", "m", "--threads", "100000"])
    assert exit_.value.code == 2
    assert "--threads must be at most 1024, got 100000" in capsys.readouterr().err


def test_a_start_moves_a_long_log_aside(tmp_path: Path) -> None:
    """The log was never rotated: every run's lines, for as long as specd is used."""
    log = tmp_path / "specd.log"
    with open(log, "wb") as f:
        f.seek(service.LOG_KEEP_BYTES)
        f.write(b"\nthe old run\n")
    service.rotate_log(log)
    assert not log.exists() and service.tail(tmp_path / "specd.log.1", 1) == "the old run"
    log.write_text("a new run\n")
    service.rotate_log(log)  # (a short one stays)
    assert log.read_text() == "a new run\n"


def test_an_address_that_is_not_this_machines_says_so() -> None:
    """`--host 256.1.1.1` said to pick another port."""
    with pytest.raises(service.ListenError) as raised:
        service.check_listen("256.1.1.1", 18_999)
    said = str(raised.value)
    assert "give one of this machine's addresses with --host" in said
    assert "pick another port" not in said


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", "1, x"])
def test_prompt_ids_with_an_empty_or_bad_item_are_a_usage_error(
    ids: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--prompt-ids 1,,2` was read as [1, 2]."""
    with pytest.raises(SystemExit):
        main(["generate", "--model", "m", "--prompt-ids", ids])
    assert "--prompt-ids takes comma-separated integers" in capsys.readouterr().err
