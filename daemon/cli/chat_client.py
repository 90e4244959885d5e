"""The client `specd chat` talks to the daemon with: POST /v1/chat/completions with
stream=true over plain HTTP + SSE from the standard library, so it needs nothing the daemon
does not already install and exercises exactly what any OpenAI client would. `ChatStream`
yields an answer's text and tool calls as they arrive and fills its `Answer`; closing it
drops the connection, which is how the daemon learns to cancel the generation."""

from __future__ import annotations

import contextlib
import http.client
import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


class ChatError(RuntimeError):
    """The daemon answered with an error (its message is shown to the user)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ToolCall:
    """One tool call of an answer, as far as it streamed."""

    id: str
    name: str
    arguments: str = ""  # JSON text; it parses once the call is whole

    def whole(self) -> bool:
        try:
            json.loads(self.arguments)
        except ValueError:
            return False
        return True

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


class Thought(str):
    """A piece of the answer's reasoning (`reasoning_content`: a reasoning model's think
    block, a harmony model's analysis), as it streams."""


@dataclass
class Answer:
    """One streamed answer as far as it arrived."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | tool_calls; None while streaming
    completion_tokens: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)  # the daemon's "specd" figures
    stopped: bool = False  # Ctrl-C stopped it

    def message(self) -> dict[str, Any]:
        """The answer as the conversation sends it back: with its calls, less one that was
        stopped or cut mid-arguments (the daemon refuses arguments that are not JSON)."""
        calls = [call.as_openai() for call in self.tool_calls if call.whole()]
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if calls:
            message = {"role": "assistant", "content": self.text or None, "tool_calls": calls}
        if self.reasoning:  # (a reasoning model's template reads it back, or leaves it out)
            message["reasoning_content"] = self.reasoning
        return message


class ChatStream:
    """POST /v1/chat/completions with stream=true. Iterating yields what arrives and fills
    `answer`: text deltas, reasoning deltas as `Thought`s, and for a tool call its ToolCall
    when it begins (its name known) and then its arguments' fragments as text. `close()` drops the connection, and with it
    the generation."""

    def __init__(
        self, url: str, body: dict[str, Any], api_key: str | None = None, timeout: float = 600.0
    ) -> None:
        self.url = url
        self.answer = Answer()
        self._calls: dict[int, ToolCall] = {}  # the answer's calls by their stream index
        host, port = daemon_address(url)
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            self._conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
            self._response = self._conn.getresponse()
            if self._response.status != 200:
                raise _http_error(self._response.status, self._response.read(), url)
        except OSError as exc:
            self.close()
            raise unreachable(url, exc) from None
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> Iterator[str | ToolCall]:
        try:
            for raw in self._response:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data: "):
                    continue  # blank separators and ": keep-alive" comments
                data = line[len("data: ") :]
                if data == "[DONE]":
                    # The body's end read too, so the daemon sees the stream delivered
                    # (closed here at once, it could count a 499) and the connection ends
                    # cleanly; briefly (another server at --url may never end its body).
                    with contextlib.suppress(OSError, http.client.HTTPException):
                        if self._conn.sock is not None:
                            self._conn.sock.settimeout(DRAIN_SECONDS)
                        self._response.read(1 << 16)
                    return
                yield from self._event(json.loads(data))
        except OSError as exc:
            raise ChatError(f"the connection to specd at {self.url} broke: {exc}") from None
        finally:
            self.close()

    def _event(self, event: dict[str, Any]) -> Iterator[str | ToolCall]:
        if "error" in event:
            error = event["error"]
            raise ChatError(error.get("message", "error"), error.get("code"))
        self.answer.stats.update(event.get("specd") or {})
        if event.get("usage"):
            self.answer.completion_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices", []):
            self.answer.finish_reason = choice.get("finish_reason") or self.answer.finish_reason
            delta = choice.get("delta", {})
            thought = delta.get("reasoning_content")
            if thought:
                self.answer.reasoning += thought
                yield Thought(thought)
            text = delta.get("content")
            if text:
                self.answer.text += text
                yield text
            for part in delta.get("tool_calls") or []:
                yield from self._call_delta(part)

    def _call_delta(self, part: dict[str, Any]) -> Iterator[str | ToolCall]:
        """OpenAI's streamed call: its index, id and name first, then argument fragments
        under the same index."""
        function = part.get("function") or {}
        call = self._calls.get(part["index"])
        if call is None:
            call = ToolCall(part.get("id", ""), function.get("name", ""))
            self._calls[part["index"]] = call
            self.answer.tool_calls.append(call)
            yield call
        fragment = function.get("arguments")
        if fragment:
            call.arguments += fragment
            yield fragment

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def daemon_address(url: str) -> tuple[str, int]:
    """(host, port) of an http:// daemon URL. The daemon speaks plain HTTP, and a URL
    without a scheme ("localhost:8716") parses with no host at all."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ChatError(f"cannot use daemon URL {url!r}: give it as http://HOST:PORT")
    try:
        port = parts.port or 80
    except ValueError as exc:  # a port that is not a number or out of range
        raise ChatError(f"cannot use daemon URL {url!r}: {exc}") from None
    return parts.hostname, port


# How long a finished stream's end is waited for (specd sends it with [DONE]).
DRAIN_SECONDS = 2.0


def unreachable(url: str, exc: OSError) -> ChatError:
    return ChatError(
        f"cannot reach specd at {url}: {exc} (is it running? `specd status` says; "
        "`specd start --model MODEL` starts it)"
    )


def not_specd(url: str, status: int) -> ChatError:
    return ChatError(
        f"something other than specd answers at {url} (HTTP {status}, not specd's answer): "
        "give specd's address with --port or --url"
    )


# What a 401 tells a command that found the daemon but not its key (a daemon started with
# --config whose server.api_key_file the command was not given).
KEY_HINT = "give its key: --api-key-file FILE, or --config FILE naming server.api_key_file"


def _http_error(status: int, raw: bytes, url: str) -> ChatError:
    try:
        error = json.loads(raw)["error"]
        hint = f" ({KEY_HINT})" if status == 401 else ""
        return ChatError(f"HTTP {status}: {error['message']}{hint}", error.get("code"))
    except (ValueError, KeyError, TypeError):
        return not_specd(url, status)


def probe(url: str, timeout: float = 10.0) -> None:
    """GET /health at `url`: a ChatError unless specd answers there (loading, or failed to
    load, is specd's own answer, which a message then gets)."""
    host, port = daemon_address(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        raw = response.read(1 << 16)
    except OSError as exc:
        raise unreachable(url, exc) from None
    finally:
        conn.close()
    try:
        body = json.loads(raw)
        specd = isinstance(body, dict) and "status" in body and "model" in body
    except ValueError:
        specd = False
    if not specd:
        raise not_specd(url, response.status)
