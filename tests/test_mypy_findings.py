"""Behaviour behind places mypy flagged: a daemon URL without a host, lists built from a
dataclass default factory, and a target placed twice."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from daemon.cli import chat as chat_cmd
from daemon.cli.chat import ChatError, daemon_address
from daemon.memory_plan import place_target
from daemon.runtime import Runtime, RuntimeOptions
from daemon.settings import build


def test_daemon_address_of_an_http_url() -> None:
    assert daemon_address("http://127.0.0.1:8716") == ("127.0.0.1", 8716)
    assert daemon_address("http://localhost") == ("localhost", 80)
    assert daemon_address("http://[::1]:9000/") == ("::1", 9000)


@pytest.mark.parametrize(
    "url",
    ["localhost:8716", "127.0.0.1:8716", "https://localhost:8716", "http://", "http://h:99999"],
)
def test_unusable_daemon_url_is_a_chat_error(url: str) -> None:
    # "localhost:8716" parses as scheme "localhost" with no host: it used to reach
    # HTTPConnection(None) and end in a TypeError traceback.
    with pytest.raises(ChatError, match="cannot use daemon URL"):
        daemon_address(url)


def test_chat_with_a_bad_url_fails_before_any_input(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_input(prompt: str = "") -> str:
        raise AssertionError("chat asked for input despite an unusable --url")

    monkeypatch.setattr("builtins.input", no_input)
    args = argparse.Namespace(
        url="localhost:8716", api_key_file=None, system=None, max_tokens=8, temperature=0.0,
        seed=None, once=None,
    )  # fmt: skip
    assert chat_cmd.cmd_chat(args) == 1
    err = capsys.readouterr().err
    assert "cannot use daemon URL 'localhost:8716'" in err and "http://HOST:PORT" in err


def test_list_keys_without_any_layer_are_empty_lists() -> None:
    # No layer sets anything: every key takes its built-in value; the list keys come from
    # a default factory (a dataclass field cannot hold a shared list default).
    settings = build({})
    assert settings.server.cors_origins == [] and settings.server.allowed_hosts == []
    assert settings.sources["server.cors_origins"] == "built-in"


def test_placing_a_streamed_target_again_is_refused(stories_target: Path) -> None:
    runtime = Runtime(
        RuntimeOptions(
            model=str(stories_target), device="cpu", context=64, offload="stream",
            resident_layers=1,
        )
    )  # fmt: skip
    assert runtime.plan is not None and runtime.streamer is not None
    with pytest.raises(ValueError, match="already a streamer"):
        place_target(runtime.target, runtime.checkpoint, runtime.plan, runtime.device)
