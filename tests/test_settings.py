"""Configuration: precedence (flags > env > user file > packaged default), sources, errors
that name the file, the key and the allowed values, and the shipped files themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.cli import main
from daemon.settings import SettingsError
from daemon.settings_loading import (
    PACKAGED_DEFAULT,
    PROFILES_DIR,
    build,
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
        ("servr:\n  port: 1\n", ["servr: unknown section", "server"]),
        ("server:\n  prot: 1\n", ["server.prot: unknown key", "port"]),
        ("server:\n  port: high\n", ["server.port", "'high'", "integer from 0 to 65535"]),
        ("server:\n  port: 70000\n", ["server.port", "70000", "0 to 65535"]),
        ("models:\n  dtype: fp8\n", ["models.dtype", "fp32, bf16, fp16"]),
        ("offload:\n  gpu_budget: lots\n", ["offload.gpu_budget", "24GB"]),
        ("speculation:\n  budget: 0\n", ["speculation.budget", "'auto'"]),
        ("server: [1, 2]\n", ["server: a list is not a section", "mapping of keys"]),
        ("server:\n  allowed_hosts: [http://myhost]\n", ["server.allowed_hosts", "myhost.lan"]),
        ("server:\n  allowed_hosts: ['[::1].evil']\n", ["server.allowed_hosts", "not a host"]),
        ("server:\n  port: [\n", ["not valid YAML"]),
        # YAML 1.1's surprises: a key written twice (the last one won, silently), a port
        # in base 60 (1:20 was 80)
        ("server:\n  port: 9000\n  port: 9001\n", ["line 3", "found 'port' twice"]),
        ("server:\n  port: 1:20\n", ["server.port", "'1:20' is not allowed"]),
        # A default past the cap (a request without max_tokens ran past it): the key the
        # file set is the one named.
        ("limits:\n  max_tokens: 10\n", ["limits.max_tokens: 10", "default_max_tokens (512)"]),
        (
            "limits:\n  max_tokens: 10\n  default_max_tokens: 20\n",
            ["limits.default_max_tokens: 20", "at most limits.max_tokens (10)"],
        ),
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


def test_numbers_are_read_as_yaml_1_2_reads_them(tmp_path: Path) -> None:
    """A leading zero is no octal (YAML 1.1 read `port: 01234` as 668), 0o is; `1e1` is a
    number (it was the text '1e1')."""
    file = write(
        tmp_path,
        "server:\n  port: 01234\n  max_connections: 0o17\n"
        "  send_timeout_seconds: 1e1\nlimits:\n  queue_size: 0x10\n",
    )
    s = load_settings(file, environ={})
    assert (s.server.port, s.server.max_connections) == (1234, 15)
    assert (s.server.send_timeout_seconds, s.limits.queue_size) == (10.0, 16)


def test_environment_errors_name_the_variable(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"env SPECD_SERVER_PROT: server\.prot: unknown key"):
        load_settings(write(tmp_path, ""), environ={"SPECD_SERVER_PROT": "1"})
    with pytest.raises(SettingsError, match=r"env SPECD_LIMITS_QUEUE_SIZE.*limits\.queue_size"):
        load_settings(write(tmp_path, ""), environ={"SPECD_LIMITS_QUEUE_SIZE": "-4"})


def test_a_misspelt_section_in_a_variable_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SPECD_SERVR_PORT was ignored without a word (a misspelt key was an error already);
    other tools' variables (SPECD_TORCH_SPEC) and specd's scripts' (SPECD_MODEL_CACHE) are
    left alone."""
    environ = {"SPECD_SERVR_PORT": "1", "SPECD_TORCH_SPEC": "torch", "SPECD_MODEL_CACHE": "/x"}
    with caplog.at_level("WARNING", logger="specd.settings"):
        settings = load_settings(write(tmp_path, ""), environ=environ)
    assert settings.server.port == 8716
    assert [r.getMessage() for r in caplog.records] == [
        "env SPECD_SERVR_PORT: no section 'servr', so it is not read; did you mean "
        "SPECD_SERVER_...?"
    ]


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
    argv = ["config", "show", "--model", "m", "--strategy", "tree"]
    assert main([*argv, "--tree-verification", "rejection"]) == 0
    out = capsys.readouterr().out
    assert "target: m  # --model" in out
    assert "strategy: tree  # --strategy" in out
    assert "tree_verification: rejection  # --tree-verification" in out
    assert "port: 9100  # env SPECD_SERVER_PORT" in out
    assert "queue_size: 32  # default" in out
    assert f"# user config file: {tmp_path / 'none' / 'specd' / 'specd.yaml'} (absent)\n" in out
    good = write(tmp_path, "limits:\n  queue_size: 4\n")
    assert main(["config", "show", "--config", str(good)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# config file: {good}\n") and "queue_size: 4  # " in out
    assert main(["config", "validate", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("limits:\n  queue: 4\n")
    assert main(["config", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"{bad}: limits.queue: unknown key (did you mean queue_size?); limits keys are "
        f"{LIMITS_KEYS}\n"
    )


LIMITS_KEYS = (
    "max_body_bytes, queue_size, max_concurrent, cached_sessions, default_max_tokens, "
    "max_tokens, clamp_max_tokens, batch_passes, max_pass_tokens, schema_max_depth, "
    "schema_max_ref_chain, schema_max_members, schema_max_bytes, "
    "schema_max_pattern_properties, schema_max_repetition, grammar_compile_seconds"
)


def test_validate_reports_every_problem_at_once_in_one_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write(
        tmp_path,
        "servr:\n  port: 1\nserver:\n  port: high\n  prot: 3\nmodels:\n  dtype: fp8\nlimits: 7\n",
    )
    assert main(["config", "validate", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"{bad}: servr: unknown section (did you mean server?); sections are models, runtime, "
        "speculation, offload, context, server, limits, logging, memory.pressure",
        f"{bad}: server.prot: unknown key (did you mean port?); server keys are host, port, "
        "api_key_file, "
        "cors_origins, allowed_hosts, keepalive_seconds, stream_interval_ms, "
        "idle_timeout_seconds, request_timeout_seconds, send_timeout_seconds, "
        "min_body_bytes_per_second, min_send_bytes_per_second, max_connections, "
        "max_connections_per_client",
        f"{bad}: limits: a number is not a section; a section is a mapping of keys",
        f"{bad}: models.dtype: 'fp8' is not allowed; expected one of auto, fp32, bf16, fp16",
        f"{bad}: server.port: 'high' is not allowed; expected an integer from 0 to 65535",
    ]


def test_every_layer_reports_in_the_same_format(tmp_path: Path) -> None:
    file = write(tmp_path, "server:\n  port: -1\n")
    env = {"SPECD_LIMITS_QUEUE_SIZE": "0", "SPECD_SERVER_PROT": "1"}
    with pytest.raises(SettingsError) as info:
        load_settings(file, overrides={"models.dtype": ("fp8", "--dtype")}, environ=env)
    problems = info.value.problems
    assert str(info.value) == "\n".join(problems)
    assert sorted(p.split(": ")[0] for p in problems) == sorted(
        ["env SPECD_SERVER_PROT", "--dtype", str(file), "env SPECD_LIMITS_QUEUE_SIZE"]
    )
    for problem in problems:
        _where, key, rest = problem.split(": ", 2)
        assert "." in key and "; " in rest, problem


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("server:\n  port: [\n", "line 3: not valid YAML"),
        ("[1, 2]\n", "the top level is a list; it must be a mapping of sections"),
    ],
)
def test_a_file_that_cannot_be_read_is_one_line(tmp_path: Path, text: str, needle: str) -> None:
    file = write(tmp_path, text)
    with pytest.raises(SettingsError) as info:
        validate_file(file)
    assert info.value.problems == [str(info.value)]
    assert str(info.value).startswith(f"{file}: {needle}")


def test_daemon_url_brackets_ipv6_and_reaches_wildcards_through_loopback():
    from daemon.addresses import daemon_url

    assert daemon_url("127.0.0.1", 8716) == "http://127.0.0.1:8716"
    assert daemon_url("::1", 8716) == "http://[::1]:8716"
    assert daemon_url("0.0.0.0", 9000) == "http://127.0.0.1:9000"
    assert daemon_url("::", 9000) == "http://127.0.0.1:9000"
    assert daemon_url("localhost", 1) == "http://localhost:1"


def test_list_keys_without_any_layer_are_empty_lists() -> None:
    # No layer sets anything: every key takes its built-in value; the list keys come from
    # a default factory (a dataclass field cannot hold a shared list default).
    settings = build({})
    assert settings.server.cors_origins == [] and settings.server.allowed_hosts == []
    assert settings.sources["server.cors_origins"] == "built-in"


def test_sizes_and_rates_in_a_configuration_need_their_unit(tmp_path: Path) -> None:
    """A bare number would be bytes (`gpu_budget: 24` planned with 24 bytes, `bandwidth: 25`
    estimated at 25 B/s): refused, naming the key; 0 still turns the prefix cache off."""
    file = write(
        tmp_path,
        "offload:\n  gpu_budget: 24\n  ram_budget: '0'\n  bandwidth: 25\n  cpu_rate: '8'\n"
        "speculation:\n  prefix_cache: 0\n",
    )  # (a budget of 0 is none: refused; a pressure threshold of 0 is "never")
    with pytest.raises(SettingsError) as info:
        load_settings(file, environ={})
    assert sorted(p.split(": ")[1] for p in info.value.problems) == [
        "offload.bandwidth",
        "offload.cpu_rate",
        "offload.gpu_budget",
        "offload.ram_budget",
    ]
    never = write(tmp_path, "models:\n  target: m\nmemory:\n  pressure:\n    tight_host_free: 0\n"
                  "    critical_host_free: '0'\n")  # fmt: skip
    assert load_settings(never, environ={}).memory_pressure.tight_host_free == 0
    ok = write(tmp_path, "models:\n  target: m\noffload:\n  gpu_budget: 24GB\n"
               "  bandwidth: 25GB/s\nspeculation:\n  prefix_cache: 0\n")  # fmt: skip
    settings = load_settings(ok, environ={})
    assert settings.offload.gpu_budget == "24GB" and settings.runtime_options().prefix_cache == 0
