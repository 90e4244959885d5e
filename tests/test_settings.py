"""Configuration: precedence (flags > env > user file > packaged default), sources, errors
that name the file, the key and the allowed values, and the shipped files themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.cli import main
from daemon.settings import (
    PACKAGED_DEFAULT,
    PROFILES_DIR,
    SettingsError,
    load_settings,
    validate_file,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "specd.yaml"
    path.write_text(text)
    return path


def test_packaged_default_alone(tmp_path: Path) -> None:
    s = load_settings(config_file=write(tmp_path, ""), environ={})
    assert s.server.host == "127.0.0.1" and s.server.port == 8716
    assert s.sources["server.port"] == "default"
    assert s.models.target is None


def test_precedence_flags_over_env_over_file_over_default(tmp_path: Path) -> None:
    file = write(tmp_path, "server:\n  port: 9001\n  host: localhost\nmodels:\n  target: a\n")
    env = {"SPECD_SERVER_PORT": "9002", "SPECD_MODELS_TARGET": "b", "SPECD_TORCH_SPEC": "x"}
    s = load_settings(file, overrides={"models.target": ("c", "--model")}, environ=env)
    assert s.models.target == "c" and s.sources["models.target"] == "--model"
    assert s.server.port == 9002 and s.sources["server.port"] == "env SPECD_SERVER_PORT"
    assert s.server.host == "localhost" and s.sources["server.host"] == f"file {file}"
    assert s.limits.queue_size == 32 and s.sources["limits.queue_size"] == "default"
    options = s.runtime_options()
    assert options.model == "c" and options.offload == "auto" and options.budget == "auto"


def test_user_config_dir_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    (tmp_path / "specd").mkdir()
    (tmp_path / "specd" / "specd.yaml").write_text("speculation:\n  budget: 64\n")
    s = load_settings(environ={})
    assert s.speculation.budget == 64 and "specd.yaml" in s.sources["speculation.budget"]


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("servr:\n  port: 1\n", ["unknown section 'servr'", "server"]),
        ("server:\n  prot: 1\n", ["unknown key server.prot", "port"]),
        ("server:\n  port: high\n", ["server.port", "'high'", "integer from 0 to 65535"]),
        ("server:\n  port: 70000\n", ["server.port", "70000", "0 to 65535"]),
        ("models:\n  dtype: fp8\n", ["models.dtype", "fp32, bf16, fp16"]),
        ("offload:\n  gpu_budget: lots\n", ["offload.gpu_budget", "24GB"]),
        ("speculation:\n  budget: 0\n", ["speculation.budget", "'auto'"]),
        ("server: [1, 2]\n", ["section 'server' must be a mapping"]),
        ("server:\n  allowed_hosts: [http://myhost]\n", ["server.allowed_hosts", "myhost.lan"]),
        ("server:\n  allowed_hosts: ['[::1].evil']\n", ["server.allowed_hosts", "not a host"]),
        ("server:\n  port: [\n", ["not valid YAML"]),
    ],
)
def test_errors_name_file_key_and_allowed_values(
    tmp_path: Path, text: str, needles: list[str]
) -> None:
    file = write(tmp_path, text)
    with pytest.raises(SettingsError) as info:
        load_settings(file, environ={})
    message = str(info.value)
    assert str(file) in message
    for needle in needles:
        assert needle in message


def test_environment_errors_name_the_variable(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"SPECD_SERVER_PROT.*unknown key server\.prot"):
        load_settings(write(tmp_path, ""), environ={"SPECD_SERVER_PROT": "1"})
    with pytest.raises(SettingsError, match=r"env SPECD_LIMITS_QUEUE_SIZE.*limits\.queue_size"):
        load_settings(write(tmp_path, ""), environ={"SPECD_LIMITS_QUEUE_SIZE": "-4"})


def test_no_model_is_a_clear_error(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, ""), environ={})
    with pytest.raises(SettingsError, match="--model"):
        s.runtime_options()


@pytest.mark.parametrize("path", [PACKAGED_DEFAULT, *sorted(PROFILES_DIR.glob("*.yaml"))])
def test_shipped_files_are_valid(path: Path) -> None:
    s = validate_file(path)
    if path != PACKAGED_DEFAULT:
        assert s.models.target and s.models.draft  # profiles name a real model pair


def test_profiles_cover_cpu_and_gpu_sizes() -> None:
    names = {p.stem for p in PROFILES_DIR.glob("*.yaml")}
    assert {"cpu", "gpu-8gb", "gpu-12gb", "gpu-16gb", "gpu-24gb"} <= names


def test_every_default_key_is_documented() -> None:
    """Each key in the packaged default has a comment line right above it."""
    lines = PACKAGED_DEFAULT.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  ") and not line.lstrip().startswith("#") and ":" in line:
            assert lines[i - 1].lstrip().startswith("#"), f"undocumented: {line.strip()}"


def test_config_show_and_validate_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "none"))
    monkeypatch.setenv("SPECD_SERVER_PORT", "9100")
    assert main(["config", "show", "--model", "m", "--strategy", "tree"]) == 0
    out = capsys.readouterr().out
    assert "target: m  # --model" in out
    assert "strategy: tree  # --strategy" in out
    assert "port: 9100  # env SPECD_SERVER_PORT" in out
    assert "queue_size: 32  # default" in out
    good = write(tmp_path, "limits:\n  queue_size: 4\n")
    assert main(["config", "validate", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("limits:\n  queue: 4\n")
    assert main(["config", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown key limits.queue" in err and str(bad) in err


def test_daemon_url_brackets_ipv6_and_reaches_wildcards_through_loopback():
    from daemon.settings import daemon_url

    assert daemon_url("127.0.0.1", 8716) == "http://127.0.0.1:8716"
    assert daemon_url("::1", 8716) == "http://[::1]:8716"
    assert daemon_url("0.0.0.0", 9000) == "http://127.0.0.1:9000"
    assert daemon_url("::", 9000) == "http://127.0.0.1:9000"
    assert daemon_url("localhost", 1) == "http://localhost:1"
