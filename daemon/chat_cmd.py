"""`specd chat`: an interactive streaming client of the daemon's REST endpoint.

It speaks plain HTTP + SSE through the standard library, so it needs nothing the daemon
does not already install, and it exercises exactly what any OpenAI client would."""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from daemon import service
from daemon.argtypes import temperature
from daemon.serve_cmd import add_settings_args, settings_from_args
from daemon.settings import daemon_url


class ChatError(RuntimeError):
    """The daemon answered with an error (its message is shown to the user)."""


def stream_chat(
    url: str, body: dict[str, Any], api_key: str | None = None, timeout: float = 600.0
) -> Iterator[str]:
    """POST /v1/chat/completions with stream=true; yields text deltas as they arrive."""
    host, port = daemon_address(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise ChatError(_error_message(resp.status, resp.read()))
        for raw in resp:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line.startswith("data: "):
                continue  # blank separators and ": keep-alive" comments
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise ChatError(event["error"].get("message", "error"))
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    yield text
    except ConnectionError as exc:
        raise ChatError(
            f"cannot reach specd at {url}: {exc} (is it running? `specd status`)"
        ) from None
    finally:
        conn.close()


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


def _error_message(status: int, raw: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(raw)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {raw[:200]!r}"


def _default_url(args: argparse.Namespace) -> str:
    record = service.DaemonRecord.read(service.default_paths())
    if record is not None and service.alive(record.pid):
        return record.url
    settings = settings_from_args(args)
    return daemon_url(settings.server.host, settings.server.port)


def _api_key(path: str | None) -> str | None:
    return Path(path).expanduser().read_text().strip() if path else None


def cmd_chat(args: argparse.Namespace) -> int:
    url = args.url or _default_url(args)
    key = _api_key(args.api_key_file)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    request = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        request["seed"] = args.seed

    def turn(user_text: str) -> None:
        history.append({"role": "user", "content": user_text})
        answer = []
        for text in stream_chat(url, {**request, "messages": history}, key):
            answer.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(answer)})

    try:
        daemon_address(url)  # a bad --url fails now, not after the first message is typed
        if args.once is not None:
            turn(args.once)
            return 0
        print(f"specd chat at {url} (Ctrl-D to quit)")
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            if line.strip():
                turn(line)
    except ChatError as exc:
        print(f"specd: error: {exc}", file=sys.stderr)
        return 1


def register(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="chat with the running daemon (streams the answer)")
    add_settings_args(chat)
    chat.add_argument("--url", default=None, help="daemon URL (default: the running one)")
    chat.add_argument("--once", default=None, help="send one message, print the answer, exit")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument(
        "--temperature", type=temperature, default=0.0, help="0 = greedy (default), up to 2"
    )
    chat.add_argument("--seed", type=int, default=None)
    chat.set_defaults(func=cmd_chat)
