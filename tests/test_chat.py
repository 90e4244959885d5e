"""`specd chat` against a scripted stand-in for the daemon's streaming endpoint: the
conversation outlives the context, Ctrl-C stops an answer (and its request) but not the
chat, cut answers are marked, /reset starts over, --stats, tool calls are shown as they
stream and go back with the next turn, and the output ends a line."""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import chat as chat_cmd
from daemon.cli import main
from daemon.cli.chat_client import Answer, ChatError, ToolCall, daemon_address

CONTEXT_CHARS = 60  # the stand-in's "context": message characters it accepts in all
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


class FakeDaemon(ThreadingHTTPServer):
    """Answers each chat request with `reply` streamed in words, finishing with `finish`
    (the next request only: with `calls` instead, (name, argument fragments) each, streamed
    as OpenAI tool-call deltas), or refuses a conversation longer than CONTEXT_CHARS as the daemon does (HTTP 400,
    code context_length_exceeded). With `hold`, it sends one word and then waits for the
    client to close the connection, and records that it did (`closed`)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.bodies: list[dict[str, Any]] = []
        self.reply = "Hello there."
        self.calls: list[tuple[str, list[str]]] = []
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

    def do_GET(self) -> None:  # /health, as specd answers it
        raw = json.dumps({"status": "ready", "model": "stand-in", "active": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        if sum(len(m["content"] or "") for m in body["messages"]) > CONTEXT_CHARS:
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
        calls, self.server.calls = self.server.calls, []
        if calls:
            self._calls(calls)
            return
        words = self.server.reply.split(" ")
        for i, word in enumerate(words):
            self._event({"choices": [{"delta": {"content": (" " if i else "") + word}}]})
            if self.server.hold:
                if self.rfile.read(1) == b"":  # blocks until the client hangs up
                    self.server.closed.set()
                return
        self._finish(self.server.finish)

    def _calls(self, calls: list[tuple[str, list[str]]]) -> None:
        for index, (name, fragments) in enumerate(calls):
            function = {"name": name, "arguments": ""}
            head = {"index": index, "id": f"call_{index}", "type": "function", "function": function}
            self._event({"choices": [{"delta": {"tool_calls": [head]}}]})
            for fragment in fragments:
                part = {"index": index, "function": {"arguments": fragment}}
                self._event({"choices": [{"delta": {"tool_calls": [part]}}]})
        self._finish("length" if self.server.finish == "length" else "tool_calls")

    def _finish(self, reason: str) -> None:
        stats = {"tokens_per_second": 12.5, "tokens_per_target_pass": 2.5}
        choice = {"delta": {}, "finish_reason": reason}
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
    typed(monkeypatch, "one", "/help", "/reset", "two", "/exit", "never sent")
    assert main(["chat", "--url", daemon.url, "--system", "S"]) == 0
    # (/help shows the commands: it was sent to the model as a message)
    assert [roles(b) for b in daemon.bodies] == [["system", "user"], ["system", "user"]]
    out = capsys.readouterr().out
    assert "[conversation reset]" in out and "/help shows this]" in out


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


@pytest.fixture
def tools_file(tmp_path: Path) -> Path:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER]))
    return path


def test_tool_calls_stream_onto_the_screen_and_go_back_with_the_next_turn(
    daemon: FakeDaemon,
    tools_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    daemon.calls = [("get_weather", ['{"city":', '"Paris"}']), ("get_time", ["{}"])]
    written: list[str] = []
    write = chat_cmd.Screen.write

    def recorded(self: chat_cmd.Screen, text: str) -> None:
        written.append(text)
        write(self, text)

    monkeypatch.setattr(chat_cmd.Screen, "write", recorded)
    typed(monkeypatch, "weather in Paris, and the time?", "thanks")
    assert main(["chat", "--url", daemon.url, "--tools", str(tools_file)]) == 0
    out = capsys.readouterr().out
    calls = '[tool call] get_weather({"city":"Paris"})\n[tool call] get_time({})\n'
    assert calls + "Hello there.\n" in out  # the next answer ("thanks") on a line of its own
    # Written as it streamed: the name first, then each fragment of the arguments.
    start = written.index("[tool call] get_weather(")
    assert written[start : start + 4] == ["[tool call] get_weather(", '{"city":', '"Paris"}', ")"]
    first, second = daemon.bodies
    assert first["tools"] == [WEATHER] and first["tool_choice"] == "auto"
    assert second["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }  # fmt: skip


def test_once_shows_a_call_and_leaves_one_cut_open(
    daemon: FakeDaemon, tools_file: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["chat", "--url", daemon.url, "--once", "weather?", "--tools", str(tools_file)]
    daemon.calls = [("get_weather", ['{"city":"Paris"}'])]
    assert main([*argv, "--tool-choice", "get_weather"]) == 0
    assert capsys.readouterr().out == '[tool call] get_weather({"city":"Paris"})\n'
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert daemon.bodies[-1]["tool_choice"] == named
    # Cut by --max-tokens mid-arguments: no closing parenthesis, and the mark says why.
    daemon.calls, daemon.finish, daemon.completion_tokens = [("get_weather", ['{"ci'])], "length", 5
    assert main([*argv, "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out == '[tool call] get_weather({"ci\n[cut at --max-tokens 5]\n'


def test_a_call_cut_mid_arguments_is_not_sent_back() -> None:
    answer = Answer(tool_calls=[ToolCall("call_0", "get_weather", '{"ci')])
    assert answer.message() == {"role": "assistant", "content": ""}


def test_a_max_tokens_below_one_is_a_usage_error(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture
) -> None:
    """Refused as the flag is read, exit 2 (it went to the daemon, whose 400 exited 1)."""
    with pytest.raises(SystemExit) as done:
        main(["chat", "--url", daemon.url, "--once", "hi", "--max-tokens", "0"])
    assert done.value.code == 2
    assert "--max-tokens must be at least 1" in capsys.readouterr().err
    assert daemon.bodies == []


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--tool-choice", "required"], "--tool-choice needs --tools FILE"),
        (["--tools", "{nowhere}"], "No such file"),
        (["--tools", "{not_a_list}"], "must hold a JSON list"),
        (["--tools", "{not_json}"], "is not JSON"),
    ],
)
def test_unusable_tools_fail_before_anything_is_sent(
    daemon: FakeDaemon,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    argv: list[str],
    error: str,
) -> None:
    (tmp_path / "not_a_list.json").write_text(json.dumps(WEATHER))
    (tmp_path / "not_json.json").write_text("[{")
    paths = {name: str(tmp_path / f"{name}.json") for name in ("nowhere", "not_a_list", "not_json")}
    argv = [arg.format(**paths) for arg in argv]
    assert main(["chat", "--url", daemon.url, "--once", "hi", *argv]) == 2  # (a user's mistake)
    assert error in capsys.readouterr().err
    assert daemon.bodies == []


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
        seed=None, once=None, tree_verification=None, tools=None, tool_choice=None,
    )  # fmt: skip
    assert chat_cmd.cmd_chat(args) == 2
    err = capsys.readouterr().err
    assert "cannot use daemon URL 'localhost:8716'" in err and "http://HOST:PORT" in err


class NotSpecd(BaseHTTPRequestHandler):
    """Another program on specd's port (`python -m http.server`): HTML for everything."""

    def log_message(self, *args: Any) -> None:
        pass

    def _page(self) -> None:
        raw = b"<!DOCTYPE HTML><html><body>Error 501</body></html>"
        self.send_response(501)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    do_GET = do_POST = _page


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_interactive_chat_with_no_daemon_fails_before_the_prompt(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It showed the prompt and failed on every line, then ended with status 0."""

    def no_input(prompt: str = "") -> str:
        raise AssertionError("chat asked for input with no daemon to answer")

    monkeypatch.setattr("builtins.input", no_input)
    assert main(["chat", "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    captured = capsys.readouterr()
    assert "specd chat at" not in captured.out
    assert "cannot reach specd at http://127.0.0.1:" in captured.err
    assert "`specd start --model MODEL` starts it" in captured.err


@pytest.mark.parametrize("once", [True, False])
def test_another_program_on_the_port_is_named_as_such(
    once: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`specd chat --once` printed the other program's HTML page as the error."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotSpecd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    typed(monkeypatch, "hello")
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["chat", "--url", url, *(["--once", "hi"] if once else [])]) == 1
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert f"something other than specd answers at {url} (HTTP 501" in err
    assert "DOCTYPE" not in err


def test_piped_messages_that_all_failed_end_with_status_1(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    typed(monkeypatch, "x" * (CONTEXT_CHARS + 1))  # too long alone: refused every time
    assert main(["chat", "--url", daemon.url]) == 1
    assert "context holds 512" in capsys.readouterr().err
    typed(monkeypatch, "x" * (CONTEXT_CHARS + 1), "short")  # the last one answered: 0
    assert main(["chat", "--url", daemon.url]) == 0


@pytest.mark.parametrize("kind", ["fifo", "huge"])
def test_a_chat_history_that_is_no_small_file_is_not_read(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The history in the state folder is read as specd's other state files are: a FIFO
    there hung `specd chat` on a terminal; a 3 GB file took 2.1 GB of memory."""
    import os
    import readline

    from daemon.cli import chat as chat_module

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    history = tmp_path / "specd" / "chat_history"
    history.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(history)
    else:
        with history.open("wb") as f:
            f.truncate(chat_module.MAX_HISTORY_BYTES + 1)
    monkeypatch.setattr(chat_module.sys.stdin, "isatty", lambda: True)
    read: list[Path] = []
    monkeypatch.setattr(readline, "read_history_file", lambda p: read.append(p))
    monkeypatch.setattr(readline, "write_history_file", lambda p: None)
    with chat_module.line_editing():
        pass
    assert read == []
