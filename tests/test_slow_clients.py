"""A daemon that stays responsive to hostile or careless clients, over real sockets: huge
prompts are prepared off the event loop (or refused before tokenizing), stalled
connections are closed on deadlines, and open connections are capped with a clean
refusal. Each test is bounded in time."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.http.server import BackgroundServer
from tests.keyed_server import keyed_server

KEY = "slow-client-key"
MODEL = "stories260k"
BIG = 1 << 20  # a megabyte
# Generous against a loaded CI machine; the daemon before this work paused 5-9 s.
MAX_PAUSE = 1.0
IDLE = 0.5  # server.idle_timeout_seconds here
BODY = 3.0  # server.request_timeout_seconds here (the rate floor is 1 KiB/s after 1 s)


@pytest.fixture(scope="module")
def server(
    stories_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundServer]:
    yield from keyed_server(
        stories_target,
        tmp_path_factory,
        KEY,
        {
            "limits.max_body_bytes": 4 * BIG,
            "server.idle_timeout_seconds": IDLE,
            "server.request_timeout_seconds": BODY,
            "server.min_body_bytes_per_second": 1024,
            "server.max_connections": 24,
        },
    )


def post(server: BackgroundServer, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=60)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data or b"{}")


def test_huge_prompts_pause_neither_health_nor_streams(server: BackgroundServer) -> None:
    """Eight 1 MB texts and eight 1 MB lists of token ids arrive at once while a stream
    runs: /health keeps answering and the stream keeps flowing (the daemon before this
    tokenized and validated on the event loop: up to 9.3 s for both)."""
    stream_gaps: list[float] = []
    health_latency: list[float] = []
    done = threading.Event()
    flowing = threading.Event()

    def stream() -> None:
        # Streams one after another until the senders are done (the refusals can take
        # less time than one stream): each stream's first gap holds its prefill.
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        while not done.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
            resp = conn.getresponse()
            last = None
            while not done.is_set():
                line = resp.readline()
                if not line or line.startswith(b"data: [DONE]"):
                    break
                if line.startswith(b"data:"):
                    now = time.perf_counter()
                    if last is not None:
                        stream_gaps.append(now - last)
                        flowing.set()
                    last = now
            conn.close()

    def health() -> None:
        while not done.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=60)
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            health_latency.append(time.perf_counter() - t0)
            conn.close()
            done.wait(0.05)  # a poll interval, not a wait for the result

    text = json.dumps({"model": MODEL, "prompt": "the dog ran. " * (BIG // 13)}).encode()
    ids = json.dumps({"model": MODEL, "prompt": list(range(3, 3 + BIG // 6))}).encode()
    watchers = [threading.Thread(target=stream), threading.Thread(target=health)]
    for w in watchers:
        w.start()
    if not flowing.wait(timeout=60):
        done.set()
        pytest.fail("the stream never flowed")
    answers: list[int] = []
    senders = [
        threading.Thread(
            target=lambda b=body: answers.append(post(server, "/v1/completions", b)[0])
        )
        for body in [text] * 8 + [ids] * 8
    ]
    for s in senders:
        s.start()
    for s in senders:
        s.join(timeout=120)
    done.set()
    for w in watchers:
        w.join(timeout=60)
    assert answers == [400] * 16  # each refused: too long for the context
    assert health_latency and stream_gaps
    print(f"longest /health {max(health_latency):.3f} s, stream gap {max(stream_gaps):.3f} s")
    assert max(health_latency) < MAX_PAUSE, max(health_latency)
    assert max(stream_gaps) < MAX_PAUSE, max(stream_gaps)


def test_a_text_that_cannot_fit_is_refused_before_tokenizing(server: BackgroundServer) -> None:
    """More characters than the context's tokens can stand for: refused by its length
    (the message says "at least"), whatever the tokenizer would make of it."""
    status, body = post(server, "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "x" * (2 * BIG)}).encode())  # fmt: skip
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "at least" in body["error"]["message"]


def raw_connection(server: BackgroundServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=10)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long it took;
    fails the test if it is still open after `seconds`."""
    sock.settimeout(seconds)
    t0 = time.perf_counter()
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the connection was still open after {seconds} s (received {got[:80]!r})")
    finally:
        sock.close()
    return got, time.perf_counter() - t0


HEAD = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
AUTH = f"Authorization: Bearer {KEY}\r\n"


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/compl", (HEAD + "Authoriz").encode()],
    ids=["nothing", "half-a-request-line", "half-a-header"],
)
def test_a_connection_without_a_whole_head_is_closed(server: BackgroundServer, sent: bytes) -> None:
    sock = raw_connection(server)
    sock.sendall(sent)
    _, seconds = closed_within(sock, 10 * IDLE)
    assert seconds < 5 * IDLE


def test_an_idle_kept_alive_connection_is_closed(server: BackgroundServer) -> None:
    sock = raw_connection(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    got, seconds = closed_within(sock, 10 * IDLE)
    assert got.startswith(b"HTTP/1.1 200") and seconds < 5 * IDLE


def test_half_a_body_gets_a_408_and_the_connection_closes(server: BackgroundServer) -> None:
    sock = raw_connection(server)
    sock.sendall((HEAD + AUTH + "Content-Length: 1000\r\n\r\n").encode() + b'{"model": ')
    got, seconds = closed_within(sock, 10 * BODY)
    assert got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got
    assert seconds < BODY  # the rate floor cut it, before the deadline


def trickle(server: BackgroundServer, chunk: int, seconds: float) -> tuple[bytes, float]:
    """A chunked body of `chunk` bytes every 0.1 s until the server answers (or `seconds`
    pass): what it answered, and when."""
    sock = raw_connection(server)
    sock.sendall((HEAD + AUTH + "Transfer-Encoding: chunked\r\n\r\n").encode())
    sock.settimeout(0.1)
    t0 = time.perf_counter()
    got = b""
    while time.perf_counter() - t0 < seconds:
        try:
            sock.sendall(f"{chunk:x}\r\n".encode() + b" " * chunk + b"\r\n")
        except OSError:  # closed (or reset) by the server
            got = got or b"<reset>"
            break
        try:
            data = sock.recv(65536)  # also paces the trickle (its 0.1 s timeout)
        except TimeoutError:
            continue
        except ConnectionResetError:
            # The server answered and closed while a chunk was on its way: its kernel
            # resets the connection, which may discard the answer before it is read.
            got += b"<reset>"
            break
        if not data:
            break
        got += data
    sock.close()
    return got, time.perf_counter() - t0


def cut_off(got: bytes) -> bool:
    """The server ended the body with its 408 (or closed on it: see `trickle`)."""
    return got.startswith(b"HTTP/1.1 408") or got == b"<reset>"


def test_a_trickled_chunked_body_is_cut_off_by_the_minimum_rate(server: BackgroundServer) -> None:
    """16 bytes every 0.1 s (160 B/s) against a floor of 1 KiB/s after the first second:
    cut soon after that second, well before the deadline."""
    got, seconds = trickle(server, 16, 10 * BODY)
    assert cut_off(got), got[:200]
    assert 1.0 <= seconds < BODY - 0.5  # by the floor (about 1.25 s), not the deadline


def test_a_body_at_a_fair_rate_still_has_a_deadline(server: BackgroundServer) -> None:
    """300 bytes every 0.1 s (3 KB/s, above the floor) for ever: cut at the deadline."""
    got, seconds = trickle(server, 300, 10 * BODY)
    assert cut_off(got), got[:200]
    assert BODY <= seconds < 3 * BODY


@pytest.fixture(scope="module")
def capped(
    stories_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundServer]:
    yield from keyed_server(
        stories_target, tmp_path_factory, KEY,
        {"server.max_connections": 4, "server.idle_timeout_seconds": 60.0},
    )  # fmt: skip


def test_connections_past_the_cap_are_refused_cleanly(capped: BackgroundServer) -> None:
    held = [raw_connection(capped) for _ in range(4)]
    try:
        for sock in held:  # each is open and accepted: a request on it is answered
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            sock.settimeout(10)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        extra = raw_connection(capped)
        got, _ = closed_within(extra, 10)
        assert got.startswith(b"HTTP/1.1 503") and b"too_many_connections" in got
        assert b"Retry-After: 1" in got
    finally:
        for sock in held:
            sock.close()
    # Once they are gone, connections are accepted again.
    deadline = time.monotonic() + 10
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", capped.server.port, timeout=10)
        conn.request("GET", "/health")
        status = conn.getresponse().status
        conn.close()
        if status == 200 or time.monotonic() > deadline:
            break
    assert status == 200


@pytest.fixture(scope="module")
def shared(
    stories_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundServer]:
    yield from keyed_server(
        stories_target, tmp_path_factory, KEY,
        {
            "server.max_connections": 8,
            "server.max_connections_per_client": 2,
            "server.idle_timeout_seconds": 60.0,
        },
    )  # fmt: skip


def connection_from(server: BackgroundServer, address: str) -> socket.socket:
    """A connection to the daemon from `address` (any of 127.0.0.0/8 is this host's)."""
    return socket.create_connection(
        ("127.0.0.1", server.server.port), timeout=10, source_address=(address, 0)
    )


def healthy(sock: socket.socket) -> bool:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    sock.settimeout(10)
    return sock.recv(65536).startswith(b"HTTP/1.1 200")


def test_one_client_cannot_hold_every_connection(shared: BackgroundServer) -> None:
    """`server.max_connections_per_client`: a client at its share is refused (503, before
    anything is read) while another address still gets in; its connections closed, it
    gets in again. One stranger reconnecting as fast as its stalled connections timed out
    held all of `server.max_connections`."""
    held = [connection_from(shared, "127.0.0.1") for _ in range(2)]
    other = connection_from(shared, "127.0.0.2")
    try:
        assert all(healthy(sock) for sock in held)
        got, _ = closed_within(connection_from(shared, "127.0.0.1"), 10)
        assert got.startswith(b"HTTP/1.1 503") and b"too_many_connections" in got
        assert b"server.max_connections_per_client" in got and b"Retry-After: 1" in got
        assert healthy(other)  # another client is served meanwhile
    finally:
        for sock in [*held, other]:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # (the daemon sees the closes a moment later)
        again = connection_from(shared, "127.0.0.1")
        try:
            if healthy(again) or time.monotonic() > deadline:
                break
        except OSError:
            pass
        finally:
            again.close()
    assert time.monotonic() <= deadline


@pytest.mark.parametrize(
    ("peer", "client"),
    [
        (("10.1.2.3", 5000), "10.1.2.3"),
        (("::ffff:10.1.2.3", 5000, 0, 0), "10.1.2.3"),
        (("2001:db8:1:2:aaaa::1", 5000, 0, 0), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:bbbb::9", 5001, 0, 0), "2001:db8:1:2::/64"),
        (("fe80::1%eth0", 5000, 0, 2), "fe80::/64"),
        ("/run/specd.sock", None),
        (None, None),
        (("not an address", 1), None),
    ],
)
def test_connections_are_counted_per_address_or_ipv6_64(peer: Any, client: str | None) -> None:
    from daemon.http.connections import client_of

    assert client_of(peer) == client


BIG_ANSWER = 32 << 20  # more than the loopback's buffers hold with the client's at 4 KiB


def whole_answer_to(
    reader: Callable[[socket.socket], Awaitable[None]], limit: float, min_rate: int = 0
) -> tuple[BaseException | None, float, float | None]:
    """A 32 MiB non-streamed answer written by the edge (`sending.deliver`) to a client over
    a real socket (its receive buffer 4 KiB) that `reader` plays after sending its request:
    how the handler's answer ended (None: written whole, or the exception) and when, and
    the 499s the metrics counted."""
    import asyncio

    from aiohttp import web

    from daemon.http.edge import CONFIG, METRICS, ApiConfig, edge_middleware
    from daemon.http.openai_fields import WireLimits
    from daemon.metrics import Metrics

    metrics = Metrics()

    async def scenario() -> tuple[BaseException | None, float]:
        ended: asyncio.Future[tuple[BaseException | None, float]] = asyncio.Future()

        @web.middleware
        async def watch(request: web.Request, handler: Any) -> web.StreamResponse:
            start = time.monotonic()
            try:
                response = await handler(request)
            except BaseException as exc:
                ended.set_result((exc, time.monotonic() - start))
                raise
            ended.set_result((None, time.monotonic() - start))
            return response

        async def big(request: web.Request) -> web.Response:
            return web.Response(body=b"x" * BIG_ANSWER, content_type="application/octet-stream")

        app = web.Application(middlewares=[watch, edge_middleware])
        app[CONFIG] = ApiConfig(
            "m",
            WireLimits(8, 8),
            1024,
            send_timeout_seconds=limit,
            min_send_bytes_per_second=min_rate,
        )
        app[METRICS] = metrics
        app.router.add_get("/big", big)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        playing: asyncio.Task[None] | None = None
        try:
            loop = asyncio.get_running_loop()
            await loop.sock_connect(client, ("127.0.0.1", port))
            await loop.sock_sendall(client, b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            playing = asyncio.ensure_future(reader(client))
            outcome = await asyncio.wait_for(ended, 30)
            playing.cancel()
            after.append(await _after_the_answer(client))
            return outcome
        finally:
            if playing is not None:
                playing.cancel()
            client.close()
            await runner.cleanup()

    after: list[str] = []
    error, seconds = asyncio.run(scenario())
    counted = {"endpoint": "/big", "status": "499"}  # (a client that left, not a 200)
    AFTER.append(after[0] if after else "")
    return error, seconds, metrics.registry.get_sample_value("specd_requests_total", counted)


# What the last `whole_answer_to`'s client met once the handler had ended, reading on for
# up to 2 s: "reset" or "end" (the connection closed in order) or "silence", after how
# many bytes ("reset 4096").
AFTER: list[str] = []


async def _after_the_answer(client: socket.socket) -> str:
    import asyncio

    loop = asyncio.get_running_loop()
    taken, deadline = 0, loop.time() + 2
    try:
        while loop.time() < deadline:
            got = await asyncio.wait_for(loop.sock_recv(client, 65536), deadline - loop.time())
            if not got:
                return f"end {taken}"
            taken += len(got)
    except ConnectionResetError:
        return f"reset {taken}"
    except TimeoutError:
        pass
    return f"silence {taken}"


async def reads_nothing(client: socket.socket) -> None:
    pass


def test_a_client_that_reads_none_of_a_whole_answer_loses_its_connection() -> None:
    """A non-streamed answer is written by the edge (`sending.deliver`) in pieces, each within
    `server.send_timeout_seconds`: a client that reads none of it is dropped, as a stream's
    is, over a real socket. Written by aiohttp after the handler returned, the answer waited
    on the full socket for good and held its connection (and its body) with it."""
    error, seconds, dropped = whole_answer_to(reads_nothing, 0.3)
    assert isinstance(error, ConnectionResetError), error
    assert "read nothing for 0.3 s" in str(error)
    assert seconds >= 0.3 and dropped == 1
    # Reset, what was queued dropped: `abort` alone left the kernel's send queue (MBs) to
    # reach the client in the background, outside every connection cap.
    how, taken = AFTER[-1].split()
    assert how == "reset" and int(taken) <= 1 << 20, AFTER[-1]


def reading(every: float, size: int) -> Callable[[socket.socket], Awaitable[None]]:
    """A client that reads `size` bytes every `every` seconds, for ever."""
    import asyncio

    async def read(client: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every)
            if not await loop.sock_recv(client, size):
                return

    return read


def test_a_client_reading_below_the_minimum_rate_loses_its_connection() -> None:
    """`server.min_send_bytes_per_second`: a client that takes a little of its answer now
    and then (4 KiB every 0.1 s, 40 KB/s, here against a floor of 1 MiB/s) never goes
    `limit` without taking something, and held its connection for as long as it liked (a
    byte a minute would have, at the default 60 s). It is dropped once its average since
    the write began to wait falls below the floor, counted from `limit` on; a client
    reading as fast as it can takes the whole answer."""
    slow, seconds, dropped = whole_answer_to(reading(0.1, 4096), 0.3, min_rate=1 << 20)
    assert isinstance(slow, ConnectionResetError), slow
    assert "server.min_send_bytes_per_second 1048576" in str(slow)
    assert 0.3 <= seconds < 10 and dropped == 1
    fast, _, dropped = whole_answer_to(reading(0, 256 << 10), 0.3, min_rate=1 << 20)
    assert fast is None and dropped is None
