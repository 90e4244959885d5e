"""A client that hangs up mid-stream is normal operation: the daemon cancels its generation
and logs no error (it used to log `ERROR aiohttp.server … Cannot write to closing
transport` with a traceback)."""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.http.server import BackgroundServer
from daemon.settings_loading import load_settings


@pytest.fixture(scope="module")
def server(stories_target: Path) -> Iterator[BackgroundServer]:
    overrides = {
        "models.target": (str(stories_target), "--model"),
        "runtime.compile": ("off", "test"),
        "server.port": (0, "--port"),
        # (an answer asked again would be replayed from the cache, done before it is read)
        "speculation.prefix_cache": (0, "test"),
    }
    with BackgroundServer(load_settings(overrides=overrides, environ={})) as srv:
        yield srv


def _hang_up_mid_stream(server: BackgroundServer) -> str:
    """Start a long stream, read its first event, hang up; the stream's id."""
    engine = server.server.engine
    cancelled = engine.metrics.cancelled.value
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    body = {"prompt": [1], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
    response = conn.getresponse()
    assert response.status == 200
    first = json.loads(response.readline().decode().removeprefix("data: "))
    hang_up_and_see_it_cancelled(conn, server, cancelled)
    return first["id"]


def hang_up_and_see_it_cancelled(
    conn: http.client.HTTPConnection, server: BackgroundServer, cancelled: float
) -> None:
    """Close the client's socket; the engine cancels one more job within 20 s (it looks
    between passes, the handler between rounds)."""
    conn.sock.close()
    conn.close()
    engine = server.server.engine
    deadline = time.monotonic() + 20
    while engine.metrics.cancelled.value == cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.metrics.cancelled.value == cancelled + 1


def test_a_client_hanging_up_mid_stream_logs_no_error(
    server: BackgroundServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    _hang_up_mid_stream(server)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == [], [r.getMessage() for r in loud]


def test_a_client_hanging_up_mid_stream_is_one_debug_line_with_the_request_id(
    server: BackgroundServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    stream_id = _hang_up_mid_stream(server)
    lines = [r for r in caplog.records if stream_id in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.DEBUG]


def test_a_client_hanging_up_while_its_stream_has_nothing_to_send_is_noticed(
    server: BackgroundServer,
) -> None:
    """A stream whose text is all held back (every character so far may begin its stop
    string) writes nothing, so no failed write tells it the client left: it ran on to
    max_tokens. Its connection is looked at after every round's events."""
    engine = server.server.engine
    # the whole context's answer (512 tokens): its text + one more character is the stop
    body = {"prompt": [1], "max_tokens": 511, "ignore_eos": True, "temperature": 0}
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body))
    text = json.loads(conn.getresponse().read())["choices"][0]["text"]
    conn.close()
    cancelled = engine.metrics.cancelled.value
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    held = {**body, "stream": True, "stop": text + "\x01"}
    conn.request("POST", "/v1/completions", json.dumps(held))
    assert conn.getresponse().status == 200  # the headers, and nothing more to read
    hang_up_and_see_it_cancelled(conn, server, cancelled)


def test_a_client_that_closes_at_done_had_the_whole_answer(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An SSE client stops reading at `data: [DONE]` and may close before the body's last
    bytes (the chunked end): the body's end then fails to write, which was counted a 499,
    for 3 of 15 `specd chat --once` answers a newcomer ran. It is the whole answer: a 200,
    and no error logged. (The failed write is made certain here.)"""
    from aiohttp import web

    real = web.StreamResponse.write_eof

    async def closed_at_done(self: web.StreamResponse, data: bytes = b"") -> None:
        if self.content_type == "text/event-stream":
            raise ConnectionResetError("Cannot write to closing transport")
        await real(self, data)

    monkeypatch.setattr(web.StreamResponse, "write_eof", closed_at_done)
    caplog.set_level(logging.DEBUG)
    metrics = server.server.metrics

    def counted(status: str) -> float:
        return sum(
            s.value
            for m in metrics.registry.collect()
            for s in m.samples
            if s.name == "specd_requests_total"
            and s.labels == {"endpoint": "/v1/completions", "status": status}
        )

    ok, gone = counted("200"), counted("499")
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    body = {"prompt": [1], "max_tokens": 4, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body))
    response = conn.getresponse()
    lines = []
    while not lines or lines[-1] != b"data: [DONE]":
        lines.append(response.readline().strip())
    conn.sock.close()
    deadline = time.monotonic() + 10
    while counted("200") == ok and counted("499") == gone and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (counted("200"), counted("499")) == (ok + 1, gone)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == [], [r.getMessage() for r in loud]
