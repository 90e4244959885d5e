"""The README's main job (`scripts/demo.sh`) on the real chat model: it starts the daemon on
SmolLM2-135M-Instruct, answers a question through curl and `specd chat --once`, gives a
JSON-schema answer through the official client with the speculation statistics, and stops
the daemon; run as a newcomer runs it, in a state folder of its own."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SHARED_MODELS

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(shutil.which("curl") is None, reason="the demo's REST step needs curl")
def test_the_demo_answers_on_the_real_model(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SPECD_SHARED_MODELS": str(SHARED_MODELS),
        "SPECD_DEMO_PORT": str(free_port()),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
    }
    done = subprocess.run(
        ["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    rest = json.loads(out.split("(curl, not streamed) ---\n", 1)[1].splitlines()[0])
    assert "Paris" in rest["choices"][0]["message"]["content"]
    assert rest["specd"]["draft_kind"] == "ngram" and rest["specd"]["tokens_per_target_pass"] >= 1
    chat = out.split("(streamed over SSE) ---\n", 1)[1].split("--- a JSON-schema", 1)[0]
    assert "red" in chat.lower() and "tokens per target pass" in chat
    answer = json.loads(out.split("answer: ", 1)[1].splitlines()[0])
    assert set(answer) == {"country", "capital"} and answer["capital"] == "Paris"
    assert "speculation: draft ngram (tree), " in out and " tokens per target pass, " in out
    assert " tokens forced by the schema's grammar\n" in out
    assert "\ntree budget, last round: auto: " in out  # (a tree, or plain decoding, and why)
    assert "stopped" in out.splitlines()[-1]
