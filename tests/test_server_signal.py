"""SIGTERM during a stream: a real `specd serve` subprocess ends the stream with an error
event and [DONE], and exits 0."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.daemon_process import wait_ready

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("signals", ["one", "repeated"])
def test_sigterm_ends_streams_with_an_error_event_and_exits_0(
    tiny_checkpoint, tmp_path, signals: str
) -> None:
    """`repeated`: SIGTERM again and again until the process is gone (a supervisor that
    insists): the stop under way is unchanged, and the exit status is still 0 (a signal
    during the interpreter's exit killed it: -15)."""
    # A long context so that the generation cannot finish before the signal arrives.
    model = tiny_checkpoint("llama", max_position_embeddings=8192, seed=3)
    port = free_port()
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "serve", "--model", str(model), "--port", str(port),
         "--device", "cpu"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_ready(port, proc)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {
            "prompt": [1, 5, 9],
            "max_tokens": 8000,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        conn.request("POST", "/v1/completions", json.dumps(body))
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        events = [line[len("data: ") :] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "shutting_down" and set(error) == {
            "message",
            "type",
            "param",
            "code",
        }
        deadline = time.monotonic() + 30
        while signals == "repeated" and proc.poll() is None and time.monotonic() < deadline:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.002)  # (a signal every 2 ms until the process has exited)
        assert proc.wait(timeout=30) == 0
        log = proc.stderr.read().decode() if proc.stderr else ""
        # (Ctrl-C again is a person's way to quit now; a SIGTERM's log does not offer it)
        assert "stopping: ending in-flight requests\n" in log, log[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
