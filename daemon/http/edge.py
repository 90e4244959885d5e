"""The edge of the HTTP layer: the checks every request passes before a handler runs
(Host header and request target against DNS rebinding, CORS origins, the API key, the body
size), and the mapping of every failure to the OpenAI error shape. The requests aiohttp's
HTTP parser refuses before the application sees them, and the caps on open connections,
are daemon/http/connections.py's."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from daemon.engine import Engine
from daemon.hostname import allowed_host_names, host_name
from daemon.http.connections import parser_error
from daemon.http.openai_errors import ApiError, bad_request, loggable
from daemon.http.openai_fields import WireLimits
from daemon.http.sending import deliver
from daemon.metrics import Metrics
from modeling.errors import RequestError, rust_panic

log = logging.getLogger("specd.api")


@dataclass
class ApiConfig:
    model_name: str  # the id listed and echoed
    limits: WireLimits
    max_body_bytes: int
    keepalive_seconds: float = 5.0
    idle_timeout_seconds: float = 15.0
    request_timeout_seconds: float = 60.0
    send_timeout_seconds: float = 60.0
    min_body_bytes_per_second: int = 4096
    min_send_bytes_per_second: int = 1024
    max_connections: int = 256
    grammar_compile_seconds: float = 5.0  # limits.grammar_compile_seconds
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    # The other names a request's `model` may give (Settings.served_model_names): a GGUF
    # file's path, an Ollama model's own name…
    model_names: frozenset[str] = frozenset()
    # Paths served without the API key: /health, and the web chat's static files (the page
    # must load before it can ask for the key; the API it calls still needs it).
    public_paths: frozenset[str] = frozenset({"/health"})
    # The host names a request may name (Host header, absolute-form target), normalised.
    host_names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.host_names = allowed_host_names(self.allowed_hosts)

    def serves(self, model: str) -> bool:
        """Whether a request's `model` names the model served here."""
        return model == self.model_name or model in self.model_names


ENGINE = web.AppKey("engine", Engine)
METRICS = web.AppKey("metrics", Metrics)
CONFIG = web.AppKey("config", ApiConfig)
DRAINING = web.AppKey("draining", asyncio.Event)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """The `Expect:` header, answered before the body is read: `100-continue` as aiohttp
    does (an interim 100), any other expectation refused in the OpenAI error shape (aiohttp
    answers it with a plain-text 417 that no middleware sees)."""
    expect = request.headers.get("Expect", "")
    if request.version != (1, 1):
        return None  # (HTTP/1.0 has no interim responses: aiohttp ignores the header too)
    if expect.lower() == "100-continue":
        limit = request.app[CONFIG].max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            # The final answer instead of the interim one: the body is not wanted.
            # (No middleware sees this answer: logged and counted as the middleware does.)
            err = _too_large(limit)
            _log_refusal(request, err)
            request.app[METRICS].count_request(_endpoint(request), err.status)
            response = error_response(err)
            response.force_close()
            request.content.feed_eof()  # (nothing of it is read: no lingering for it)
            return response
        assert request.writer is not None
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (the answer's own size starts after it)
        return None
    shown = expect if len(expect) <= 60 else expect[:60] + "…"
    message = f"the Expect header {shown!r} is not supported (only 100-continue)"
    return error_response(ApiError(417, message, param="Expect", code="expectation_failed"))


def _check_host(value: str, where: str, config: ApiConfig) -> None:
    if host_name(value) not in config.host_names:
        raise ApiError(
            403,
            f"{where} {value[:200]!r} is not an allowed host (DNS rebinding protection); add "
            "the name to server.allowed_hosts to serve it",
            type="permission_error",
            code="host_not_allowed",
        )


def _check_target(request: web.Request, config: ApiConfig) -> None:
    """An absolute-form request target (`GET http://host/path HTTP/1.1`) names the host
    the client meant, and takes precedence over the Host header (RFC 9112 3.2.2): its
    authority must be allowed too."""
    target = request.raw_path
    if target.startswith("/"):
        return
    try:
        parts = urlsplit(target)
    except ValueError:
        parts = None
    if parts is None or parts.scheme.lower() not in ("http", "https") or "@" in parts.netloc:
        raise bad_request(
            "the request target must be a path (or an absolute http URL)",
            code="invalid_request_target",
        )
    _check_host(parts.netloc, "the request target's host", config)


def cors_headers(origin: str) -> dict[str, str]:
    return {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": "Authorization, Content-Type",
        "Vary": "Origin",
    }


# Refusals after which the connection closes, its body unread.
UNREAD_BODY_CODES = frozenset(
    {"host_not_allowed", "unsupported_content_encoding", "unsupported_transfer_encoding"}
)
# The `code` of an aiohttp refusal that names none of its own.
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


@web.middleware
async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Security checks, then the handler; every failure leaves in the OpenAI error shape."""
    config = request.app[CONFIG]
    endpoint = _endpoint(request)
    refused: ApiError | None = None
    try:
        response = await _guarded(request, handler, config)
    except (ConnectionError, asyncio.CancelledError):  # (aiohttp: "Connection lost")
        request.app[METRICS].count_request(endpoint, 499)  # the client closed the connection
        raise
    except ApiError as err:
        refused = err
        response = error_response(err)
        if err.code in UNREAD_BODY_CODES:
            # (a client that names a host this daemon does not serve, a DNS rebinding
            # page's, gets nothing more on this connection: its body is not read either;
            # nor is a body in an encoding specd cannot read)
            response.force_close()
            request.content.feed_eof()
    except RequestError as err:  # a domain error that is the request's fault
        refused = bad_request(str(err), err.param, err.code)
        response = error_response(refused)
    except (HttpProcessingError, RequestPayloadError) as exc:
        # The body could not be read: a bad chunk after the headers, a Content-Encoding
        # that does not decode. The request's fault; the connection cannot be reused.
        response = error_response(parser_error(400, exc))
        response.force_close()
        request.content.feed_eof()  # nothing more will be read: aiohttp need not drain it
    except web.HTTPRequestEntityTooLarge:
        # The rest of the body is not read (aiohttp would drain it to reuse the connection:
        # a 1 GiB chunked body was taken in whole after the answer): the connection closes.
        refused = _too_large(config.max_body_bytes)
        response = error_response(refused)
        response.force_close()
        request.content.feed_eof()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # (a 405 says which methods the path takes, as RFC 9110 asks)
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        code = HTTP_CODES.get(exc.status, str(exc.status))
        response = error_response(
            ApiError(exc.status, exc.reason, type="invalid_request_error", code=code,
                     headers=allow)
        )  # fmt: skip
    except BaseException as exc:  # (a library's panic too: answered, not a closed connection)
        if not isinstance(exc, Exception) and not rust_panic(exc):
            raise
        log.exception("internal error on %s", loggable(request.path))
        response = error_response(
            ApiError(500, "internal server error (see the daemon's log)", type="server_error")
        )
    if response.status == 408:
        # The body never came whole: what is left of it cannot be told from a next request.
        response.force_close()
        request.content.feed_eof()
    if refused is not None and refused.status < 500:
        _log_refusal(request, refused)
    origin = request.headers.get("Origin")
    if origin and origin in config.cors_origins and not response.prepared:
        response.headers.update(cors_headers(origin))
    if isinstance(response, web.Response) and not response.prepared:
        try:
            response = await deliver(
                request, response, config.send_timeout_seconds, config.min_send_bytes_per_second
            )
        except ConnectionResetError:  # the client read none of it: dropped
            request.app[METRICS].count_request(endpoint, 499)
            raise
    request.app[METRICS].count_request(endpoint, response.status)
    return response


def _endpoint(request: web.Request) -> str:
    """The route a request is counted under in the metrics."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "other"


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than {limit} bytes (limits.max_body_bytes)",
        type="invalid_request_error",
        code="request_too_large",
    )


# The most of a refusal's message the log line keeps (a message may quote the request).
LOGGED_MESSAGE = 240


def _log_refusal(request: web.Request, err: ApiError) -> None:
    """One WARNING line per refused request: what was refused and why, never the body."""
    message = err.message if len(err.message) <= LOGGED_MESSAGE else err.message[:LOGGED_MESSAGE]
    log.warning(
        "refused %s %s from %s: %d %s (param %s): %s",
        loggable(request.method), loggable(request.path[:100]), request.remote, err.status,
        err.code or err.type, loggable(str(err.param)), loggable(message),
    )  # fmt: skip


# What a request body may be sent in: aiohttp decodes these itself. It read any other
# Content-Encoding (`x-unknown`, `gzip, gzip`) as plain bytes, and one it lacks a library
# for (br, zstd) as an error telling the client which package to install.
BODY_ENCODINGS = frozenset({"identity", "gzip", "x-gzip", "deflate"})


def _check_encodings(request: web.Request) -> None:
    """A body's Content-Encoding is one that is decoded (a 415 otherwise), and its
    Transfer-Encoding, if any, chunked alone (a 400: `gzip, chunked` was read as chunked)."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding and encoding not in BODY_ENCODINGS:
        raise ApiError(
            415,
            f"Content-Encoding {encoding[:40]!r} is not supported: send the body as is, or "
            "gzip or deflate it",
            type="invalid_request_error",
            code="unsupported_content_encoding",
        )
    transfer = request.headers.get("Transfer-Encoding", "").strip().lower()
    if transfer and transfer != "chunked":
        raise ApiError(
            400,
            f"Transfer-Encoding {transfer[:40]!r} is not supported: only chunked",
            code="unsupported_transfer_encoding",
        )


async def _guarded(request: web.Request, handler: Handler, config: ApiConfig) -> web.StreamResponse:
    # (aiohttp's parser refuses an HTTP/1.1 request with no Host header or with two.)
    _check_host(request.headers.get("Host", ""), "Host header", config)
    _check_target(request, config)
    origin = request.headers.get("Origin")
    # A browser sends Origin on a same-origin POST too (the web chat at /): the Host header
    # it names was allowed above, so that origin is this daemon's own.
    same_origin = origin == f"http://{request.headers.get('Host', '')}"
    if origin is not None and origin not in config.cors_origins and not same_origin:
        raise ApiError(
            403,
            f"origin {origin!r} is not allowed; add it to server.cors_origins",
            type="permission_error",
            code="origin_not_allowed",
        )
    if request.method == "OPTIONS" and origin is not None:
        return web.Response(status=204, headers=cors_headers(origin))
    if config.api_key is not None and request.path not in config.public_paths:
        # The scheme is case-insensitive (RFC 9110 11.1: "bearer" is "Bearer"); the key
        # is compared in constant time. Header bytes that are not UTF-8 arrive as surrogate
        # escapes: compared as the bytes they were (a latin-1 key is a wrong key, not a 500).
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        given_bytes = given.strip(" ").encode("utf-8", "surrogateescape")
        right_key = secrets.compare_digest(given_bytes, config.api_key.encode())
        if scheme.lower() != "bearer" or not right_key:
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="invalid_api_key",
            )
    _check_encodings(request)
    if request.content_length is not None and request.content_length > config.max_body_bytes:
        raise web.HTTPRequestEntityTooLarge(
            max_size=config.max_body_bytes, actual_size=request.content_length
        )
    return await handler(request)
