"""An answer written to a client within the send timeout (`server.send_timeout_seconds`)
and at the minimum rate (`server.min_send_bytes_per_second`): a stream's writes
(daemon/http/streaming.py) and a whole answer's pieces (`deliver`, called by the edge for
every answer it returns) each wait on the client while it keeps taking what is queued, and
the connection is dropped once it has taken nothing for the timeout or too little for the
rate. A client that stops reading held its connection and megabytes for good, and
`server.max_connections` of them locked everyone out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import sys
from collections.abc import Awaitable
from typing import Any, cast

from aiohttp import web

log = logging.getLogger("specd.api")


# A whole body is written in pieces this size, each within the send timeout.
DELIVER_PIECE_BYTES = 64 << 10


def _queued(transport: asyncio.BaseTransport) -> int:
    """Bytes of this connection that the client has not taken yet: the transport's buffer,
    and on Linux the socket's send queue (SIOCOUTQ, which is TIOCOUTQ's value); elsewhere
    the transport's buffer only."""
    size = cast(asyncio.WriteTransport, transport).get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sys.platform == "linux" and sock is not None:
        import fcntl
        import termios

        # (a socket closed meanwhile: the write's own outcome says so)
        with contextlib.suppress(OSError, ValueError):
            outq = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)
            size += struct.unpack("i", outq)[0]
    return size


# How often a write waiting on a client looks at what it has taken.
SEND_CHECK_SECONDS = 0.25


def _reset(transport: asyncio.Transport) -> None:
    """The connection ended with a reset, what is queued for it dropped: the transport's
    buffer, and (SO_LINGER of 0) the socket's send queue, which `abort` alone left the
    kernel to deliver in the background, megabytes a client outside every connection cap
    went on reading (a reviewer found 2.8 MB still queued 30 s after a drop)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def send_within(
    request: web.Request, sending: Awaitable[Any], limit: float, min_rate: int = 0
) -> None:
    """`sending` (a write of the answer) awaited while the client keeps taking what is
    queued for it: the connection is dropped (what is queued with it) and
    ConnectionResetError raised once it has taken nothing for `limit` seconds, or (with
    `min_rate`) less than `min_rate` bytes a second on average since the write began to
    wait, counted from `limit` seconds on (a client may pause for as long as it may take
    nothing). A client that stops reading held its connection, and megabytes, for good;
    one that reads a little now and then (a byte a minute, a segment every 50 s) held it
    as long as it liked. A client that reads at all normally never waits here: its
    buffers take what is written."""
    task = asyncio.ensure_future(sending)
    transport = request.transport
    loop = asyncio.get_running_loop()
    why = f"read nothing for {limit:g} s"
    try:
        # The write runs until it waits on a full socket: what it queued is counted in the
        # baseline (else the client had to take the whole piece in the first `limit`).
        await asyncio.sleep(0)
        queued = first = _queued(transport) if transport is not None else 0
        start = taken_at = loop.time()
        tick = min(limit, SEND_CHECK_SECONDS) if min_rate else limit
        while True:
            done, _ = await asyncio.wait({task}, timeout=tick)
            if done:
                task.result()  # (its exception, if it failed)
                return
            if transport is None or transport.is_closing():
                break
            now, left = loop.time(), _queued(transport)
            if left < queued:
                queued, taken_at = left, now  # it took some: the clock starts again
            elif now - taken_at >= limit - 1e-3:  # (a timer may fire a hair early)
                break
            waited = now - start
            if min_rate and first - queued < (waited - limit) * min_rate:
                why = (
                    f"took {first - queued} bytes in {waited:.1f} s "
                    f"(server.min_send_bytes_per_second {min_rate})"
                )
                break
    finally:
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()  # (retrieved: a write that failed as the connection went)
    if transport is not None:
        _reset(transport)
    log.info("dropped %s: the client %s of its answer", request.remote, why)
    raise ConnectionResetError(f"the client {why}")


async def deliver(
    request: web.Request, response: web.Response, limit: float, min_rate: int = 0
) -> web.StreamResponse:
    """`response` written here rather than by aiohttp after the handler returns, where a
    client that reads none of it held its connection and the body for good (aiohttp waits
    on a full socket without end; `max_connections` such clients locked everyone out): sent
    in pieces, each within `send_within`, as a stream's are (daemon/http/streaming.py)."""
    body = response.body
    if request.method == "HEAD" or not isinstance(body, bytes) or not body:
        return response  # nothing that can stall past the headers: aiohttp sends it
    out = web.StreamResponse(status=response.status, reason=response.reason)
    out.headers.update(response.headers)
    out.content_length = len(body)
    if response.keep_alive is False:
        out.force_close()
    await send_within(request, out.prepare(request), limit, min_rate)
    for start in range(0, len(body), DELIVER_PIECE_BYTES):
        piece = body[start : start + DELIVER_PIECE_BYTES]
        await send_within(request, out.write(piece), limit, min_rate)
    await send_within(request, out.write_eof(), limit, min_rate)
    return out
