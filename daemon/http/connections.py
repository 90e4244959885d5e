"""The daemon's connections, below the application: aiohttp's connection protocol with its
parser errors answered in the OpenAI error shape (`handle_error`), and the caps on open
connections (`server.max_connections` in all, `server.max_connections_per_client` from one
address), each past its cap refused with a clean 503 before anything is read."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections import Counter
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    ContentEncodingError,
    HttpProcessingError,
    LineTooLong,
)
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo
from aiohttp.web_request import BaseRequest

from daemon.http.openai_errors import ApiError, loggable

log = logging.getLogger("specd.api")


def parser_error(status: int, exc: BaseException | None) -> ApiError:
    if isinstance(exc, RequestPayloadError) and exc.__cause__ is not None:
        exc = exc.__cause__  # aiohttp's wrapper around a body's decoding error
    if isinstance(exc, ContentEncodingError) and "install" in str(exc.message):
        # An encoding aiohttp has no library for (br, zstd): its message said which
        # package to install. (A gzip body that does not decode is a 400 as below.)
        return ApiError(
            415,
            "the body's Content-Encoding is not supported: send it as is, or gzip or deflate it",
            code="unsupported_content_encoding",
        )
    if isinstance(exc, HttpProcessingError):
        # aiohttp's message, first line only (the rest is a caret under the bad byte).
        detail = exc.message.strip().splitlines()
        reason = detail[0].rstrip(":") if detail else type(exc).__name__
        code = {BadHttpMethod: "invalid_method", LineTooLong: "line_too_long"}.get(
            type(exc), "malformed_request"
        )
        return ApiError(status, f"malformed HTTP request: {reason}", code=code)
    if status == 504:
        return ApiError(504, "the request timed out", type="server_error")
    if status < 500:  # the request's fault, whatever aiohttp wrapped it in
        return ApiError(status, "malformed HTTP request", code="malformed_request")
    return ApiError(status, "internal server error (see the daemon's log)", type="server_error")


def client_of(peername: Any) -> str | None:
    """The client a connection is counted under for `server.max_connections_per_client`: its
    IPv4 address, or its IPv6 address's /64 (one host's usual allotment, from which it may
    take a new address per connection); an IPv4-mapped IPv6 address is the IPv4 one. None
    where the transport has no IP peer (nothing to count it under)."""
    if not isinstance(peername, tuple) or not peername or not isinstance(peername[0], str):
        return None
    try:
        address = ipaddress.ip_address(peername[0].partition("%")[0])  # (less a zone id)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _refuse(transport: asyncio.BaseTransport, message: str) -> None:
    """A 503 `too_many_connections` (Retry-After: 1) written to a connection that is then
    closed, before anything of it is read."""
    err = ApiError(
        503,
        message,
        type="service_unavailable",
        code="too_many_connections",
        headers={"Retry-After": "1"},
    )
    body = json.dumps(err.body()).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    cast(asyncio.Transport, transport).write(head.encode() + body)


class OpenAIErrorRequestHandler(RequestHandler):
    """aiohttp's connection protocol, with `handle_error` answering in the OpenAI error shape
    and the connection caps applied as a connection is made.

    aiohttp calls `handle_error` for what happens outside the application: a request its
    parser refused (bad method, over-long request line or header, too many headers,
    Content-Length with Transfer-Encoding, a bad chunk size while the headers are being
    read) and an exception escaping the application (which `edge_middleware` prevents).
    No middleware sees these; the status stays aiohttp's (400 for parser errors) and the
    connection is closed, as aiohttp does."""

    __slots__ = ("_client",)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._client: str | None = None
        server = cast(_OpenAIErrorServer, self._manager)
        if not isinstance(server, _OpenAIErrorServer):
            return
        limit, per_client = server.max_connections, server.max_connections_per_client
        if limit is not None and len(server.connections) > limit:
            # One connection too many: a clean refusal before anything is read, so that
            # stalled clients cannot hold every socket the daemon has.
            log.warning("refused a connection: %d are open (server.max_connections)", limit)
            _refuse(
                transport,
                f"the daemon has {limit} connections open (server.max_connections); retry",
            )
            self.force_close()
            return
        client = client_of(transport.get_extra_info("peername"))
        if client is None:
            return
        if per_client is not None and server.per_client[client] >= per_client:
            # One address holding its share: the others keep theirs (a stranger that
            # reconnects as fast as its connections time out held every socket).
            log.warning(
                "refused a connection from %s: it has %d open (server.max_connections_per_client)",
                client,
                per_client,
            )
            _refuse(
                transport,
                f"this client has {per_client} connections open "
                "(server.max_connections_per_client); close one or retry",
            )
            self.force_close()
            return
        server.per_client[client] += 1
        self._client = client

    def connection_lost(self, exc: BaseException | None) -> None:
        server, client = self._manager, getattr(self, "_client", None)
        if client is not None and isinstance(server, _OpenAIErrorServer):
            server.per_client[client] -= 1
            if server.per_client[client] <= 0:
                del server.per_client[client]  # (the counter holds open clients only)
            self._client = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            # A response was already started: there is no sending another (aiohttp's rule).
            raise ConnectionError("a response was already sent; cannot send the error")
        if isinstance(exc, HttpProcessingError):
            # Routine on any port a stranger can reach: one line, no traceback.
            reason = loggable(str(exc.message))
            log.info("refused a malformed HTTP request from %s: %s", request.remote, reason)
        elif isinstance(exc, ConnectionError):  # the client left mid-request: nobody to tell
            log.debug("client %s disconnected: %s", request.remote, exc)
        else:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        err = parser_error(status, exc)
        response = web.json_response(err.body(), status=err.status, headers=err.headers)
        response.force_close()
        return response

    def data_received(self, data: bytes) -> None:
        # (aiohttp internals: the parsed-message queue, the request being handled and the
        # record of a parse error; tests/test_hostile_input.py checks this on upgrades.)
        queued = len(self._messages)
        super().data_received(data)
        # A parse error in the body of a request the application is already reading (a bad
        # chunk size after the headers) is queued by aiohttp as the *next* request, and the
        # body being read never ends: the handler would wait until the client hangs up.
        # End that body with the error instead, so that the handler answers a 400.
        request = self._current_request
        if request is None or len(self._messages) <= queued:
            return
        error = self._messages[-1][0]
        if isinstance(error, _ErrInfo) and not request.content.is_eof():
            request.content.set_exception(error.exc)


class _OpenAIErrorServer(web.Server):
    max_connections: int | None = None  # set by AppRunner
    max_connections_per_client: int | None = None
    per_client: Counter[str]  # open connections by `client_of`, counted ones only

    def __call__(self) -> RequestHandler:
        return OpenAIErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class AppRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer parser errors in the OpenAI error shape, at
    most `max_connections` of them open and `max_connections_per_client` from one client
    (`client_of`); one more is refused with a 503."""

    def __init__(
        self,
        app: web.Application,
        *,
        max_connections: int | None = None,
        max_connections_per_client: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp has no option for the protocol class; the server it built for the app
        # (handler, request factory, settings) stays as it is and only makes our protocol.
        server.__class__ = _OpenAIErrorServer
        made = cast(_OpenAIErrorServer, server)
        made.max_connections = self.max_connections
        made.max_connections_per_client = self.max_connections_per_client
        made.per_client = Counter()
        return server
