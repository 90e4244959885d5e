"""The command line itself: commands that run no model import no torch, flags are never
abbreviated, each command lists only the flags it uses, and temperature has one range."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.cli.argtypes import TEMPERATURE_RANGE
from daemon.cli.commands import BENCH_HELP, build_parser, main
from daemon.settings import (
    DTYPE_CHOICES,
    QUANTIZE_CHOICES,
    STRATEGY_CHOICES,
    TREE_VERIFICATION_CHOICES,
)

ROOT = Path(__file__).resolve().parents[1]

# Commands that only talk to the daemon or read configuration.
LIGHT_COMMANDS = [
    ["--help"],
    ["status"],
    ["status", "--help"],
    ["stop"],
    ["chat", "--help"],
    ["config", "show"],
    ["logs"],
    ["serve", "--help"],
    ["plan", "--help"],
]


@pytest.mark.parametrize("argv", LIGHT_COMMANDS, ids=" ".join)
def test_commands_without_a_model_do_not_import_torch(argv: list[str], tmp_path: Path) -> None:
    script = (
        "import sys, daemon.cli\n"
        "try:\n"
        f"    daemon.cli.main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in ('torch', 'aiohttp') if m in sys.modules)\n"
        "print('IMPORTED', heavy, file=sys.stderr)\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "SPECD_SERVER_PORT": "9",  # status asks a port where nothing answers
    }
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert "IMPORTED []" in run.stderr, run.stderr


# Modules `specd generate` on a local base model does not need, each a measured start-up
# cost: torch._dynamo (with sympy and torch.fx's symbolic shapes) about a second, imported
# by torch._refs the first time a meta tensor is drawn at random or raised to a power;
# Jinja is for chat templates (stories260k has none); huggingface_hub resolves hub ids, not
# folders; aiohttp is the server's.
NOT_FOR_GENERATE = ("torch._dynamo", "sympy", "jinja2", "huggingface_hub", "aiohttp")


def test_generate_imports_only_what_it_runs(stories_target: Path, stories_draft: Path) -> None:
    script = (
        "import sys, daemon.cli\n"
        f"daemon.cli.main(['generate', '--model', {str(stories_target)!r}, '--draft', "
        f"{str(stories_draft)!r}, '--prompt', 'Once', '--max-tokens', '4'])\n"
        f"print('IMPORTED', sorted(m for m in {NOT_FOR_GENERATE!r} if m in sys.modules))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert "IMPORTED []" in run.stdout, run.stdout


def test_runtime_options_import_no_torch() -> None:
    """What a runtime is built from is a plain record: the settings and the command line
    build one without loading torch."""
    script = "import sys, daemon.options\nprint('IMPORTED', 'torch' in sys.modules)\n"
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert "IMPORTED False" in run.stdout, run.stdout


def test_prefix_cache_default_restates_the_caches() -> None:
    from daemon.options import RuntimeOptions
    from speculative.prefix_cache import DEFAULT_MAX_BYTES

    assert RuntimeOptions(model="m").prefix_cache == DEFAULT_MAX_BYTES


def test_dtype_choices_restate_the_checkpoints() -> None:
    from modeling.checkpoints.checkpoint import DTYPE_CHOICES as LOADER_CHOICES

    assert DTYPE_CHOICES == LOADER_CHOICES


def test_quantize_choices_restate_the_loaders() -> None:
    from daemon.cli import argtypes
    from modeling.weights import quant

    assert QUANTIZE_CHOICES == quant.QUANTIZE_CHOICES
    assert argtypes.QUANTIZE_GROUP == quant.QUANTIZE_GROUP


def test_strategy_choices_restate_the_runtimes() -> None:
    from daemon.runtime import STRATEGY_BUILDERS

    assert tuple(STRATEGY_BUILDERS) == STRATEGY_CHOICES


def test_tree_verification_choices_restate_the_strategys() -> None:
    from speculative import acceptance

    assert TREE_VERIFICATION_CHOICES == acceptance.TREE_VERIFICATION_CHOICES


def test_bench_placeholder_says_what_bench_says() -> None:
    """`specd --help` lists bench without importing its module; the line must not drift."""

    def bench_help(command: str | None) -> str | None:
        sub = next(a for a in build_parser(command)._actions if a.dest == "command")
        return next(c.help for c in sub._choices_actions if c.dest == "bench")

    assert bench_help(None) == BENCH_HELP == bench_help("bench")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "m", "--max-token", "5"],
        ["chat", "--max-tok", "5"],
        ["serve", "--mod", "m"],
        ["config", "show", "--mod", "m"],
        ["service", "install", "--pri"],
    ],
)
def test_abbreviated_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["chat", "status"])
def test_client_commands_list_no_model_flags(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "--port" in out and "--config" in out
    for flag in ("--model", "--draft", "--offload", "--budget", "--gpu-budget", "--dtype"):
        assert flag not in out, f"{command} --help lists {flag}"


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "m", "--temperature"],
        ["chat", "--once", "hi", "--url", "http://127.0.0.1:9", "--temperature"],
    ],
)
@pytest.mark.parametrize("value", ["2.5", "-0.1", "nan", "hot"])
def test_temperature_has_the_apis_range_and_message(
    argv: list[str], value: str, capsys: pytest.CaptureFixture
) -> None:
    from daemon.http.openai_errors import ApiError
    from daemon.http.openai_fields import WireLimits
    from daemon.http.openai_wire import parse_chat

    with pytest.raises(SystemExit):
        main([*argv, value])
    cli_message = capsys.readouterr().err
    lo, hi = TEMPERATURE_RANGE
    assert f"temperature must be a number in [{lo}, {hi}]" in cli_message
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": messages, "temperature": 2.5}, WireLimits(512, 8192))
    assert f"temperature must be a number in [{lo}, {hi}]" in str(info.value)
    parse_chat({"messages": messages, "temperature": hi}, WireLimits(512, 8192))  # the bound itself


def test_console_help_names_every_command() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0
    for command in ("generate", "serve", "start", "stop", "status", "chat", "bench", "plan"):
        assert command in run.stdout


def test_start_up_runs_without_the_collector_and_freezes_what_it_made() -> None:
    import gc

    from daemon.startup import collector_paused

    try:
        with collector_paused():
            assert not gc.isenabled()
            made = [[] for _ in range(100)]
        assert gc.isenabled() and gc.get_freeze_count() >= len(made)
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_failed_start_up_freezes_nothing_and_turns_the_collector_back_on() -> None:
    import gc

    from daemon.startup import collector_paused

    gc.unfreeze()
    try:
        with pytest.raises(RuntimeError, match="no model"), collector_paused():
            raise RuntimeError("no model")
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        gc.enable()
