"""Several clients at once: correct outputs, shared target passes (nobody's first token
waits for another's whole generation), and a client that disconnects is cancelled and
freed."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from daemon import engine as engine_module
from daemon.http.server import BackgroundServer
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from daemon.settings_loading import load_settings
from speculative.generation import Chunk, Generation
from speculative.sampling import SamplingParams

MODEL = "stories260k"
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom",
    "One day, a big",
    "The sun was",
    "Tim had a red",
    "In the park",
    "Mom said",
]


@pytest.fixture(scope="module")
def server(stories_target: Path) -> Iterator[BackgroundServer]:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "test"),
            "models.draft": ("none", "test"),  # plain decoding: every request a pass a token
            "runtime.compile": ("off", "test"),
            "server.port": (0, "test"),
            "server.keepalive_seconds": (0.05, "test"),
            "limits.max_concurrent": (8, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(stories_target: Path) -> Runtime:
    return Runtime(RuntimeOptions(model=str(stories_target), device="cpu"))


def expected_text(runtime: Runtime, prompt: str, max_tokens: int) -> str:
    strategy = runtime.strategy("autoregressive")
    gen = Generation(
        strategy,
        runtime.new_session(strategy),
        runtime.tokenizer,
        runtime.tokenizer.encode(prompt),
        SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
    )
    return gen.run().text


async def stream_completion(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}
    text = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event
            text.append(event["choices"][0]["text"])
    return "".join(text)


def test_eight_concurrent_streams_are_all_correct(
    server: BackgroundServer, reference: Runtime
) -> None:
    async def run_all() -> list[str]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(
                *(stream_completion(session, server.url, p) for p in PROMPTS)
            )

    results = asyncio.run(run_all())
    assert results == [expected_text(reference, p, 40) for p in PROMPTS]
    assert server.server.engine.active_count == 0


def test_nobody_waits_for_another_whole_generation(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three jobs submitted together: the later ones get their first tokens long before
    the first one, which asks for many more tokens, finishes."""
    order: list[tuple[int, str]] = []
    lock = threading.Lock()
    real_post = engine_module.Job.post

    def recording_post(self, event):  # type: ignore[no-untyped-def]
        with lock:
            kind = "chunk" if isinstance(event, Chunk) else type(event).__name__
            order.append((self.request.max_tokens, kind))
        real_post(self, event)

    monkeypatch.setattr(engine_module.Job, "post", recording_post)
    engine = server.server.engine
    tok = engine.runtime.tokenizer  # type: ignore[union-attr]

    async def submit_three() -> None:
        loop = asyncio.get_running_loop()
        jobs = [
            engine.submit(
                engine_module.GenerationRequest(
                    prompt_ids=tok.encode(prompt),
                    params=SamplingParams(temperature=0.0),
                    max_tokens=n,
                    ignore_eos=True,
                ),
                loop,
            )
            for prompt, n in (("Once upon a time", 200), ("The little dog", 5), ("Mom", 6))
        ]
        for job in jobs:
            while not isinstance(await job.events.get(), engine_module.Finished):
                pass

    asyncio.run(submit_three())
    long_done = order.index((200, "Finished"))
    assert order.index((5, "chunk")) < long_done and order.index((6, "chunk")) < long_done
    assert order.index((5, "Finished")) < long_done and order.index((6, "Finished")) < long_done


def test_disconnected_client_is_cancelled_and_freed(server: BackgroundServer) -> None:
    engine = server.server.engine
    cancelled_before = engine.metrics.cancelled.value
    completed_before = engine.metrics.completion_tokens.value
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    body = {
        "model": MODEL,
        "prompt": [1],
        "max_tokens": 500,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: ")
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 60
    while engine.metrics.cancelled.value == cancelled_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.metrics.cancelled.value == cancelled_before + 1
    assert engine.active_count == 0
    # Its tokens were never counted as a completed generation, and it left no cached session.
    assert engine.metrics.completion_tokens.value == completed_before
    assert engine.idle_sessions <= server.server.settings.limits.cached_sessions
    status_conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    status_conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "Lily", "max_tokens": 3, "temperature": 0}),
    )
    assert status_conn.getresponse().status == 200


def test_concurrent_requests_share_passes_and_say_so(
    server: BackgroundServer, reference: Runtime
) -> None:
    """Non-streamed requests sent together ride in shared target passes: each answer is
    what it would be alone, and the `specd` stats report the batch."""

    async def one(session: aiohttp.ClientSession, prompt: str) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 30, "temperature": 0}
        async with session.post(server.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            return await resp.json()

    async def run_all() -> list[dict]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, p) for p in PROMPTS[:4]))

    answers = asyncio.run(run_all())
    assert [a["choices"][0]["text"] for a in answers] == [
        expected_text(reference, p, 30) for p in PROMPTS[:4]
    ]
    stats = [a["specd"] for a in answers]
    assert all(s["batch_size"] >= 1 and s["shared_passes"] >= 0 for s in stats)
    assert max(s["batch_size"] for s in stats) > 1  # they were in flight together
    assert max(s["shared_passes"] for s in stats) > 0


def test_a_client_that_stops_reading_its_stream_loses_its_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that reads nothing of a stream: once the socket's buffers are full each
    write waits, and after `server.send_timeout_seconds` the connection is dropped (its
    unsent bytes with it) and the generation cancelled. It held the connection for good:
    256 such clients locked everyone out. (Loopback's buffers hold megabytes, more than
    the test model can write: the response here is one whose writes never complete.)"""
    from types import SimpleNamespace
    from unittest import mock

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from daemon.http import streaming
    from daemon.http.edge import CONFIG, ApiConfig
    from daemon.http.openai_fields import WireLimits
    from daemon.http.openai_responses import ResponseShape
    from daemon.jobs import Job

    class Stalled:  # a StreamResponse whose client reads nothing
        def __init__(self, headers: dict[str, str] | None = None) -> None:
            self.headers = dict(headers or {})

        async def prepare(self, request: web.Request) -> None:
            pass

        async def write(self, data: bytes) -> None:
            await asyncio.Event().wait()

        async def write_eof(self) -> None:
            await asyncio.Event().wait()

    monkeypatch.setattr(streaming.web, "StreamResponse", Stalled)

    async def scenario() -> tuple[Job, mock.Mock]:
        app = web.Application()
        app[CONFIG] = ApiConfig("m", WireLimits(8, 8), 1024, send_timeout_seconds=0.2)
        transport = mock.Mock()
        transport.get_write_buffer_size.return_value = 1 << 20  # and it never goes down
        transport.get_extra_info.return_value = None
        transport.is_closing.return_value = False
        request = make_mocked_request("POST", "/v1/chat/completions", app=app, transport=transport)
        job = Job(None, asyncio.get_running_loop())  # type: ignore[arg-type]
        req = SimpleNamespace(tool_choice=None, include_usage=False)
        with pytest.raises(ConnectionResetError, match=r"read nothing for 0\.2 s"):
            await streaming.stream(request, [job], ResponseShape(chat=True, model="m"), req, 5.0, 0)  # type: ignore[arg-type]
        return job, transport

    job, transport = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert job.cancelled and transport.abort.called


def test_a_client_that_reads_slowly_keeps_its_connection() -> None:
    """The send timeout starts again whenever the client takes some of what is queued: a
    write that waits longer than `limit` for a client reading slowly is not dropped (a
    write waits until 48 KiB have gone, so at the default 60 s a client taking less than
    800 bytes a second was), the piece the write queued counted before the clock starts.
    One that takes nothing is, after `limit`."""
    from unittest import mock

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from daemon.http.sending import send_within

    limit = 0.05

    async def scenario(taking: bool) -> tuple[bool, bool]:
        queued = [1 << 20]

        def size() -> int:  # each look finds less queued while the client reads
            queued[0] -= 4096 if taking else 0
            return queued[0]

        transport = mock.Mock()
        transport.get_write_buffer_size.side_effect = size
        transport.get_extra_info.return_value = None
        transport.is_closing.return_value = False
        request = make_mocked_request(
            "POST", "/v1/completions", app=web.Application(), transport=transport
        )
        written = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_later(6 * limit, written.set)  # the write ends after six limits

        async def write() -> None:  # queues its piece, then waits on the full socket
            queued[0] += 64 << 10
            await written.wait()

        try:
            await send_within(request, write(), limit)
        except ConnectionResetError:
            return False, transport.abort.called
        return True, transport.abort.called

    assert asyncio.run(scenario(taking=True)) == (True, False)
    assert asyncio.run(scenario(taking=False)) == (False, True)


def test_a_connection_lost_in_a_write_is_the_clients_leaving_not_a_500() -> None:
    """aiohttp's drain raises the base ConnectionError ("Connection lost"), which neither the
    stream nor the edge caught as a client that left: a traceback as an internal error, and
    a 500 in the metrics, a reviewer found. Now a 499, and the stream's jobs cancelled."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from daemon.http.edge import CONFIG, METRICS, ApiConfig, edge_middleware
    from daemon.http.openai_fields import WireLimits
    from daemon.metrics import Metrics

    metrics = Metrics()
    app = web.Application()
    app[CONFIG] = ApiConfig("m", WireLimits(8, 8), 1024)
    app[METRICS] = metrics

    async def lost(request: web.Request) -> web.StreamResponse:
        raise ConnectionError("Connection lost")

    async def scenario() -> None:
        request = make_mocked_request("GET", "/health", app=app, headers={"Host": "127.0.0.1"})
        with pytest.raises(ConnectionError):
            await edge_middleware(request, lost)

    asyncio.run(scenario())
    counted = {
        (s.labels["status"], s.value)
        for m in metrics.registry.collect()
        for s in m.samples
        if s.name == "specd_requests_total"
    }
    assert counted == {("499", 1.0)}


def test_health_shows_the_places_held_by_requests_being_prepared(
    server: BackgroundServer,
) -> None:
    """A house full of slow preparations refuses requests while no generation is active or
    queued: /health and /v1/specd/status say why (`in_flight`)."""
    engine = server.server.engine
    limits = server.server.settings.limits
    most = limits.max_concurrent + limits.queue_size
    seats = [engine.reserve() for _ in range(3)]
    try:
        for path in ("/health", "/v1/specd/status"):
            with urllib.request.urlopen(server.url + path) as resp:
                body = json.loads(resp.read())
            assert body["in_flight"] == {"taken": 3, "preparing": 3, "limit": most}
            assert body["active"] == body["queued"] == 0
    finally:
        for seat in seats:
            engine.release(seat)
    with urllib.request.urlopen(server.url + "/health") as resp:
        assert json.loads(resp.read())["in_flight"]["taken"] == 0


def test_a_job_whose_client_gave_up_is_neither_taken_nor_queued() -> None:
    """With every decode slot busy, jobs whose clients left (and the choices an `n` request
    queued before it was refused, cancelled) stayed in /health's `taken` and `queued` until
    a slot freed, though admission already gave their places to others."""
    import queue
    import types

    from daemon.engine import Engine
    from daemon.jobs import InFlight, Job

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        jobs = [Job(None, loop) for _ in range(4)]  # type: ignore[arg-type]
        in_flight = InFlight(1, 3)
        for job in jobs:
            in_flight.enter(job)
        waiting: queue.Queue[Job] = queue.Queue()
        for job in jobs[:3]:
            waiting.put_nowait(job)
        engine = types.SimpleNamespace(_queue=waiting, _waiting=[jobs[3]])
        assert in_flight.figures()["taken"] == 4 and Engine.queued.fget(engine) == 4  # type: ignore[attr-defined]
        jobs[0].cancel()
        jobs[3].cancel()
        assert in_flight.figures() == {"taken": 2, "preparing": 0, "limit": 4}
        assert Engine.queued.fget(engine) == 2  # type: ignore[attr-defined]
        in_flight.enter(Job(None, loop))  # type: ignore[arg-type]  # (their places are free)

    asyncio.run(scenario())
