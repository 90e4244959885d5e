"""The edge of the HTTP layer: the checks every request passes before a handler runs
(Host header against DNS rebinding, CORS origins, the API key, the body size), and the
mapping of every failure to the OpenAI error shape."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from daemon.engine import Engine
from daemon.metrics import Metrics
from daemon.openai_wire import ApiError, WireLimits

log = logging.getLogger("specd.api")

LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}


@dataclass
class ApiConfig:
    model_name: str
    limits: WireLimits
    max_body_bytes: int
    keepalive_seconds: float = 5.0
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()


ENGINE = web.AppKey("engine", Engine)
METRICS = web.AppKey("metrics", Metrics)
CONFIG = web.AppKey("config", ApiConfig)
DRAINING = web.AppKey("draining", asyncio.Event)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


def _host_name(host_header: str) -> str:
    if host_header.startswith("["):  # [::1]:8080
        return host_header.split("]")[0] + "]"
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


def cors_headers(origin: str) -> dict[str, str]:
    return {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": "Authorization, Content-Type",
        "Vary": "Origin",
    }


@web.middleware
async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Security checks, then the handler; every failure leaves in the OpenAI error shape."""
    config = request.app[CONFIG]
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "other"
    try:
        response = await _guarded(request, handler, config)
    except (ConnectionResetError, asyncio.CancelledError):
        request.app[METRICS].count_request(endpoint, 499)  # the client closed the connection
        raise
    except ApiError as err:
        response = error_response(err)
    except web.HTTPRequestEntityTooLarge:
        response = error_response(
            ApiError(
                413,
                f"the request body is larger than {config.max_body_bytes} bytes "
                "(limits.max_body_bytes)",
                type="invalid_request_error",
                code="request_too_large",
            )
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(
            ApiError(exc.status, exc.reason, type="invalid_request_error", code=str(exc.status))
        )
    except Exception:
        log.exception("internal error on %s", request.path)
        response = error_response(
            ApiError(500, "internal server error (see the daemon's log)", type="server_error")
        )
    request.app[METRICS].count_request(endpoint, response.status)
    origin = request.headers.get("Origin")
    if origin and origin in config.cors_origins and not response.prepared:
        response.headers.update(cors_headers(origin))
    return response


async def _guarded(request: web.Request, handler: Handler, config: ApiConfig) -> web.StreamResponse:
    host = _host_name(request.headers.get("Host", "")).lower()
    allowed = LOOPBACK_HOSTS | {h.lower() for h in config.allowed_hosts}
    if host not in allowed and not host.endswith(".localhost"):
        raise ApiError(
            403,
            f"Host header {host!r} is not allowed (DNS rebinding protection); add it to "
            "server.allowed_hosts to serve it",
            type="permission_error",
            code="host_not_allowed",
        )
    origin = request.headers.get("Origin")
    if origin is not None and origin not in config.cors_origins:
        raise ApiError(
            403,
            f"origin {origin!r} is not allowed; add it to server.cors_origins",
            type="permission_error",
            code="origin_not_allowed",
        )
    if request.method == "OPTIONS" and origin is not None:
        return web.Response(status=204, headers=cors_headers(origin))
    if config.api_key is not None and request.path != "/health":
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {config.api_key}"
        if not secrets.compare_digest(given.encode(), expected.encode()):
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="invalid_api_key",
            )
    if request.content_length is not None and request.content_length > config.max_body_bytes:
        raise web.HTTPRequestEntityTooLarge(
            max_size=config.max_body_bytes, actual_size=request.content_length
        )
    return await handler(request)
