"""An answer written to a client within the send timeout (`server.send_timeout_seconds`):
a stream's writes (daemon/http/streaming.py) and a whole answer's pieces (`deliver`, called
by the edge for every answer it returns) each wait on the client for as long as it takes
any of what is queued, and the connection is dropped once it has taken nothing for the
timeout. A client that stops reading held its connection and megabytes for good, and
`server.max_connections` of them locked everyone out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
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


async def send_within(request: web.Request, sending: Awaitable[Any], limit: float) -> None:
    """`sending` (a write of the answer) awaited for as long as the client takes any of what
    is queued for it: once it has taken nothing for `limit` seconds, the connection is
    dropped (what is queued with it) and ConnectionResetError raised. A client that stops
    reading held its connection, and megabytes, for good; one that reads slowly is not
    dropped (a write waits until 48 KiB have gone: at 60 s, a client taking less than
    800 bytes a second would have been)."""
    task = asyncio.ensure_future(sending)
    transport = request.transport
    try:
        # The write runs until it waits on a full socket: what it queued is counted in the
        # baseline (else the client had to take the whole piece in the first `limit`).
        await asyncio.sleep(0)
        queued = _queued(transport) if transport is not None else 0
        while True:
            done, _ = await asyncio.wait({task}, timeout=limit)
            if done:
                task.result()  # (its exception, if it failed)
                return
            if transport is None or transport.is_closing():
                break
            now = _queued(transport)
            if now >= queued:
                break
            queued = now  # it took some: the clock starts again
    finally:
        if not task.done():
            task.cancel()
    if transport is not None:
        transport.abort()  # (what is queued is dropped, not flushed)
    log.info("dropped %s: the client read nothing of its answer for %g s", request.remote, limit)
    raise ConnectionResetError(f"the client read nothing for {limit:g} s")


async def deliver(request: web.Request, response: web.Response, limit: float) -> web.StreamResponse:
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
    await send_within(request, out.prepare(request), limit)
    for start in range(0, len(body), DELIVER_PIECE_BYTES):
        await send_within(request, out.write(body[start : start + DELIVER_PIECE_BYTES]), limit)
    await send_within(request, out.write_eof(), limit)
    return out
