"""`specd chat` against a scripted stand-in for the daemon's streaming endpoint: the
conversation outlives the context, Ctrl-C stops an answer (and its request) but not the
chat, cut answers are marked, /reset starts over, --stats, and the output ends a line."""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from daemon.cli import chat as chat_cmd
from daemon.cli import main
from daemon.cli.chat import ChatError, daemon_address

CONTEXT_CHARS = 60  # the stand-in's "context": message characters it accepts in all


class FakeDaemon(ThreadingHTTPServer):
    """Answers each chat request with `reply` streamed in words, finishing with `finish`,
    or refuses a conversation longer than CONTEXT_CHARS as the daemon does (HTTP 400,
    code context_length_exceeded). With `hold`, it sends one word and then waits for the
    client to close the connection, and records that it did (`closed`)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.bodies: list[dict[str, Any]] = []
        self.reply = "Hello there."
        self.finish = "stop"
        self.completion_tokens = 3
        self.hold = False
        self.closed = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: FakeDaemon
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        if sum(len(m["content"]) for m in body["messages"]) > CONTEXT_CHARS:
            error = {"message": "the prompt has 530 tokens but the context holds 512",
                     "code": "context_length_exceeded"}  # fmt: skip
            raw = json.dumps({"error": error}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        words = self.server.reply.split(" ")
        for i, word in enumerate(words):
            self._event({"choices": [{"delta": {"content": (" " if i else "") + word}}]})
            if self.server.hold:
                if self.rfile.read(1) == b"":  # blocks until the client hangs up
                    self.server.closed.set()
                return
        stats = {"tokens_per_second": 12.5, "tokens_per_target_pass": 2.5}
        choice = {"delta": {}, "finish_reason": self.server.finish}
        self._event({"choices": [choice], "specd": stats})
        usage = {"completion_tokens": self.server.completion_tokens}
        self._event({"choices": [], "usage": usage, "specd": stats})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture
def daemon() -> Iterator[FakeDaemon]:
    server = FakeDaemon()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def typed(monkeypatch: pytest.MonkeyPatch, *lines: str) -> None:
    """The user types `lines`, then Ctrl-D."""
    pending = list(lines)

    def fake_input(prompt: str = "") -> str:
        if not pending:
            raise EOFError
        return pending.pop(0)

    monkeypatch.setattr("builtins.input", fake_input)


def roles(body: dict[str, Any]) -> list[str]:
    return [m["role"] for m in body["messages"]]


def test_the_conversation_outlives_the_context(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    typed(monkeypatch, "first question", "second question", "third question")
    argv = ["chat", "--url", daemon.url, "--system", "Be brief."]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # Turn 3 does not fit with both earlier turns: refused once, then sent without turn 1.
    assert [roles(b) for b in daemon.bodies] == [
        ["system", "user"],
        ["system", "user", "assistant", "user"],
        ["system", "user", "assistant", "user", "assistant", "user"],
        ["system", "user", "assistant", "user"],
    ]
    last = daemon.bodies[-1]["messages"]
    assert last[0]["content"] == "Be brief." and last[1]["content"] == "second question"
    assert out.count("[context full: dropped the oldest 1 turn of the conversation]") == 1
    assert out.count("Hello there.\n") == 3 and out.endswith("\n")  # the shell prompt's line
    assert daemon.bodies[0]["stream_options"] == {"include_usage": True}


def test_a_message_larger_than_the_context_keeps_the_chat_going(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    typed(monkeypatch, "x" * (CONTEXT_CHARS + 1), "short")
    assert main(["chat", "--url", daemon.url]) == 0
    captured = capsys.readouterr()
    assert "context holds 512" in captured.err
    assert "Hello there.\n" in captured.out
    assert roles(daemon.bodies[-1]) == ["user"]  # the refused message was not kept


def test_reset_starts_over_and_keeps_the_system_prompt(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    typed(monkeypatch, "one", "/reset", "two", "/exit", "never sent")
    assert main(["chat", "--url", daemon.url, "--system", "S"]) == 0
    assert [roles(b) for b in daemon.bodies] == [["system", "user"], ["system", "user"]]
    assert "[conversation reset]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("completion_tokens", "mark"),
    [(5, "[cut at --max-tokens 5]"), (2, "[cut: the context is full]")],
)
def test_an_answer_cut_short_is_marked(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture, completion_tokens: int, mark: str
) -> None:
    daemon.finish, daemon.completion_tokens = "length", completion_tokens
    assert main(["chat", "--url", daemon.url, "--once", "hi", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out == f"Hello there.\n{mark}\n"


def test_tree_verification_rides_in_each_request(daemon: FakeDaemon) -> None:
    argv = ["chat", "--url", daemon.url, "--once", "hi"]
    assert main([*argv, "--tree-verification", "rejection"]) == 0
    assert daemon.bodies[-1]["tree_verification"] == "rejection"
    assert main(argv) == 0
    assert "tree_verification" not in daemon.bodies[-1]  # the daemon's own setting


def test_stats_after_each_answer(daemon: FakeDaemon, capsys: pytest.CaptureFixture) -> None:
    assert main(["chat", "--url", daemon.url, "--once", "hi", "--stats"]) == 0
    out = capsys.readouterr().out
    assert out == "Hello there.\n[12.5 tokens/s, 2.50 tokens per target pass]\n"


def test_ctrl_c_stops_the_answer_and_its_request_not_the_chat(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    daemon.hold = True
    daemon.reply = "a long answer that the user stops"
    written: list[str] = []

    def write_then_interrupt(self: chat_cmd.Screen, text: str) -> None:
        written.append(text)
        if text == "a":  # Ctrl-C while the first word is on the screen
            raise KeyboardInterrupt
        self.out.write(text)

    monkeypatch.setattr(chat_cmd.Screen, "write", write_then_interrupt)
    typed(monkeypatch, "tell me a story", "and then?")
    assert main(["chat", "--url", daemon.url]) == 0
    assert daemon.closed.wait(10), "the stopped answer's connection was left open"
    assert len(daemon.bodies) == 2  # the chat went on to the next turn
    kept = daemon.bodies[1]["messages"]
    assert [m["content"] for m in kept] == ["tell me a story", "a", "and then?"]
    assert "[stopped]" in written[1]


def test_an_unreachable_daemon_is_one_line(capsys: pytest.CaptureFixture) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        assert main(["chat", "--url", f"http://127.0.0.1:{port}", "--once", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach specd" in err[0] and "specd status" in err[0]


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
        seed=None, once=None, tree_verification=None,
    )  # fmt: skip
    assert chat_cmd.cmd_chat(args) == 1
    err = capsys.readouterr().err
    assert "cannot use daemon URL 'localhost:8716'" in err and "http://HOST:PORT" in err
