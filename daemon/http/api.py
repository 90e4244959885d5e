"""The HTTP API's routes (aiohttp): `create_app` puts them together, with the small
endpoints (/health, /metrics, /v1/models). The completions are handled in
daemon/http/completions.py, their answers written in daemon/http/streaming.py; the checks
every request passes first, and the mapping of failures to the OpenAI error shape, are in
daemon/http/edge.py; the web chat's routes in daemon/http/webchat.py.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from daemon.engine import Engine
from daemon.http.completions import (
    COMPILING_THREADS,
    GRAMMARS,
    LOADING_RETRY_AFTER,
    PREPARERS,
    PREPARING_THREADS,
    chat_completions,
    completions,
)
from daemon.http.edge import (
    CONFIG,
    DRAINING,
    ENGINE,
    METRICS,
    ApiConfig,
    edge_middleware,
    expect_handler,
)
from daemon.http.openai_errors import ApiError
from daemon.metrics import Metrics
from speculative.grammar_compiler import GrammarCompiler


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    state = "stopping" if request.app[DRAINING].is_set() else engine.state
    body = {
        "status": state,
        "model": request.app[CONFIG].model_name,
        "active": engine.active_count,
        "queued": engine.queued,
        "in_flight": engine.in_flight,  # places taken of the limit, being prepared included
        # ok | tight | critical (off: not watched); at critical new requests get 503.
        "memory_pressure": engine.pressure.level if engine.pressure is not None else "off",
        "pid": os.getpid(),  # (`specd start` checks that the daemon answering is its own)
    }
    if state == "ready":
        return web.json_response(body)
    if state == "loading" and engine.loading_note:
        body["loading"] = engine.loading_note  # e.g. the substitute draft's build, layer by layer
    message = {
        "loading": "the models are still loading",
        "failed": f"the models failed to load: {engine.load_error}",
        "stopping": "the server is shutting down",
    }[state]
    body["error"] = {
        "message": message,
        "type": "service_unavailable",
        "param": None,
        "code": state,
    }
    return web.json_response(body, status=503, headers={"Retry-After": LOADING_RETRY_AFTER})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        text=request.app[METRICS].render(), content_type="text/plain", charset="utf-8"
    )


def _model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "specd"}


async def models(request: web.Request) -> web.Response:
    name = request.app[CONFIG].model_name
    return web.json_response({"object": "list", "data": [_model_object(name)]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id} (the official client's `models.retrieve`): the model served here
    under any of its names, or a 404 `model_not_found`."""
    config = request.app[CONFIG]
    asked = request.match_info["model"]
    if not config.serves(asked):
        raise ApiError(
            404,
            f"model {asked[:200]!r} is not served here; this daemon serves {config.model_name!r}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    return web.json_response(_model_object(config.model_name))


def create_app(engine: Engine, metrics_: Metrics, config: ApiConfig) -> web.Application:
    app = web.Application(middlewares=[edge_middleware], client_max_size=config.max_body_bytes)
    app[ENGINE] = engine
    app[METRICS] = metrics_
    app[CONFIG] = config
    app[DRAINING] = asyncio.Event()
    app[PREPARERS] = ThreadPoolExecutor(PREPARING_THREADS, thread_name_prefix="specd-prepare")
    app[GRAMMARS] = GrammarCompiler(config.grammar_compile_seconds, COMPILING_THREADS)

    async def stop_preparers(app: web.Application) -> None:
        app[PREPARERS].shutdown(wait=False, cancel_futures=True)
        app[GRAMMARS].close()

    app.on_cleanup.append(stop_preparers)
    app.router.add_get("/health", health, expect_handler=expect_handler)
    app.router.add_get("/metrics", metrics, expect_handler=expect_handler)
    app.router.add_get("/v1/models", models, expect_handler=expect_handler)
    # (a model's id may hold slashes: a hub id, an Ollama name, a GGUF file's path)
    app.router.add_get("/v1/models/{model:.+}", model, expect_handler=expect_handler)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_handler)
    app.router.add_post("/v1/completions", completions, expect_handler=expect_handler)
    # CORS preflights (OPTIONS with an allowed Origin) are answered by the middleware.
    return app
