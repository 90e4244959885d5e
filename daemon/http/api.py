"""The HTTP layer (aiohttp): routes, handlers, SSE streaming (security checks: edge.py).

It translates; it does not think. Requests are parsed by `openai_wire`, admitted against
the models by `admit` (daemon/admission.py: tokenized, checked, settled) and handed to the
`Engine`; engine events become JSON bodies or SSE chunks. Domain errors are mapped to the
OpenAI error shape here, at the edge.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from aiohttp import web

from daemon.admission import admit
from daemon.engine import Engine
from daemon.http.edge import (
    CONFIG,
    DRAINING,
    ENGINE,
    METRICS,
    ApiConfig,
    cors_headers,
    edge_middleware,
)
from daemon.http.openai_responses import SSE_DONE, SSE_KEEPALIVE, ResponseShape, sse, usage
from daemon.http.openai_wire import (
    ApiError,
    CompletionRequest,
    bad_request,
    parse_chat,
    parse_completion,
    parse_json_object,
)
from daemon.jobs import (
    EngineNotReady,
    Failed,
    Finished,
    GenerationRequest,
    Job,
    MemoryPressureError,
    QueueFullError,
    ServerShuttingDown,
)
from daemon.metrics import Metrics
from speculative.errors import RequestError
from speculative.generation import Chunk
from speculative.sampling import TokenLogprob
from speculative.tool_calls import CallFormat, CallStream, read_answer

log = logging.getLogger("specd.api")

# Requests prepared (parsed, validated, tokenized) at once; the others wait their turn.
PREPARING_THREADS = 2
PREPARERS = web.AppKey("preparers", ThreadPoolExecutor)

LOADING_RETRY_AFTER = "5"
QUEUE_RETRY_AFTER = "1"
# Memory comes back when the other program lets go: later than a queue drains.
PRESSURE_RETRY_AFTER = "5"
DISCONNECT_POLL_SECONDS = 0.25


def _require_ready(app: web.Application) -> Engine:
    engine = app[ENGINE]
    if app[DRAINING].is_set() or engine.state == "stopping":
        raise ApiError(
            503,
            "the server is shutting down",
            type="service_unavailable",
            code="shutting_down",
            headers={"Retry-After": LOADING_RETRY_AFTER},
        )
    if engine.state == "failed":
        raise ApiError(500, f"the models failed to load: {engine.load_error}", type="server_error")
    if engine.runtime is None:
        raise ApiError(
            503,
            "the models are still loading; retry shortly",
            type="service_unavailable",
            code="model_loading",
            headers={"Retry-After": LOADING_RETRY_AFTER},
        )
    return engine


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    state = "stopping" if request.app[DRAINING].is_set() else engine.state
    body = {
        "status": state,
        "model": request.app[CONFIG].model_name,
        "active": engine.active_count,
        "queued": engine.queued,
        # ok | tight | critical (off: not watched); at critical new requests get 503.
        "memory_pressure": engine.pressure.level if engine.pressure is not None else "off",
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


async def models(request: web.Request) -> web.Response:
    name = request.app[CONFIG].model_name
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "specd"}],
        }
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def _complete(request: web.Request, *, chat: bool) -> web.StreamResponse:
    app = request.app
    config = app[CONFIG]
    raw = await read_body(request, config)
    # Parsing, validating, rendering the chat template and tokenizing take time in
    # proportion to the body (0.6 s per megabyte of text to tokenize): off the event loop,
    # on a few threads (the others wait in the executor's queue), so /health and the
    # streams in flight keep flowing meanwhile.
    loop = asyncio.get_running_loop()
    engine, req, admitted = await loop.run_in_executor(
        app[PREPARERS], partial(_prepare, app, raw, chat)
    )
    try:
        job = engine.submit(admitted, loop)
    except QueueFullError as exc:
        raise ApiError(
            503, str(exc), type="service_unavailable", code="queue_full",
            headers={"Retry-After": QUEUE_RETRY_AFTER},
        ) from None  # fmt: skip
    except MemoryPressureError as exc:
        raise ApiError(
            503, str(exc), type="service_unavailable", code="memory_pressure",
            headers={"Retry-After": PRESSURE_RETRY_AFTER},
        ) from None  # fmt: skip
    except EngineNotReady:
        _require_ready(app)
        raise
    piece = None
    if req.params.logprobs is not None and engine.runtime is not None:
        piece = engine.runtime.tokenizer.piece  # log-probabilities name tokens as text
    shape = ResponseShape(chat=chat, model=config.model_name, piece=piece)
    try:
        previous = admitted.prompt_ids[-1]
        if req.stream:
            return await _stream(
                request, job, shape, req, config.keepalive_seconds, previous, admitted.calls
            )
        calls_only = req.tool_choice not in (None, "auto")
        return await _collect(request, job, shape, previous, admitted.calls, calls_only)
    finally:
        if not job.done:
            job.cancel()  # the client went away (or we failed): free the engine's slot


# The body's first second is not held to the minimum rate (a connection's slow start).
RATE_GRACE_SECONDS = 1.0
# How often a body that is arriving is looked at against its deadline and rate.
BODY_CHECK_SECONDS = 0.25


async def read_body(request: web.Request, config: ApiConfig) -> bytes:
    """The request body, within the deadline and at the minimum rate (ApiConfig): a client
    that trickles a body, or sends half of one and stops, gets 408 and the connection is
    closed, instead of holding it for good. Larger than max_body_bytes: 413."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    parts: list[bytes] = []
    received = 0
    while True:
        elapsed = loop.time() - start
        floor = (elapsed - RATE_GRACE_SECONDS) * config.min_body_bytes_per_second
        if elapsed > config.request_timeout_seconds or received < floor:
            raise ApiError(
                408,
                f"the request body did not arrive in time ({received} bytes in "
                f"{elapsed:.1f} s; server.request_timeout_seconds "
                f"{config.request_timeout_seconds:g}, server.min_body_bytes_per_second "
                f"{config.min_body_bytes_per_second})",
                type="invalid_request_error",
                code="request_timeout",
            )
        wait = min(BODY_CHECK_SECONDS, config.request_timeout_seconds - elapsed)
        try:
            chunk = await asyncio.wait_for(request.content.readany(), max(wait, 0.0))
        except asyncio.TimeoutError:
            continue
        if not chunk:
            return b"".join(parts)
        received += len(chunk)
        if received > config.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=config.max_body_bytes, actual_size=received
            )
        parts.append(chunk)


def _prepare(
    app: web.Application, raw: bytes, chat: bool
) -> tuple[Engine, CompletionRequest, GenerationRequest]:
    """A request body → the engine, the validated request and what the engine is to serve
    (`admit`: its prompt ids, its grammar state, the format its answer's tool calls are read
    in), or the error that refuses it. Runs on a preparing thread."""
    config = app[CONFIG]
    body = parse_json_object(raw)
    req = parse_chat(body, config.limits) if chat else parse_completion(body, config.limits)
    if req.model is not None and req.model != config.model_name:
        raise ApiError(
            404,
            f"model {req.model!r} is not served here; this daemon serves {config.model_name!r}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    engine = _require_ready(app)
    assert engine.runtime is not None
    clamp = config.limits.clamp_max_tokens
    return engine, req, admit(engine.runtime, req, clamp_max_tokens=clamp)


async def _next_event(job: Job, request: web.Request, timeout: float):  # type: ignore[no-untyped-def]
    """The job's next event, or None after `timeout` seconds without one."""
    if not job.events.empty():
        return job.events.get_nowait()
    try:
        return await asyncio.wait_for(job.events.get(), timeout)
    except asyncio.TimeoutError:
        return None


def _failure(error: BaseException) -> ApiError:
    """The answer to a job the engine failed. Only a `RequestError` is the request's fault;
    anything else is ours (the engine logged its traceback)."""
    if isinstance(error, ServerShuttingDown):
        return ApiError(503, str(error), type="service_unavailable", code="shutting_down")
    if isinstance(error, RequestError):
        return bad_request(str(error), error.param, error.code)
    return ApiError(
        500,
        f"generation failed: {type(error).__name__}: {error} (see the daemon's log)",
        type="server_error",
    )


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _collect(
    request: web.Request,
    job: Job,
    shape: ResponseShape,
    previous: int,
    calls: CallFormat | None = None,  # the answer is read as tool calls in this format
    calls_only: bool = False,  # tool_choice required or named
) -> web.Response:
    """The whole answer in one body. Nothing is written before the end, so a client that
    left is not noticed by a failed write as a stream's is: its connection is looked at
    after every event and every `DISCONNECT_POLL_SECONDS`, and the job cancelled."""
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    while True:
        event = await _next_event(job, request, DISCONNECT_POLL_SECONDS)
        if _client_gone(request):
            job.cancel()
            log.debug("%s: the client disconnected; generation cancelled", shape.id)
            raise ConnectionResetError("client disconnected")
        if event is None:
            continue
        if isinstance(event, Chunk):
            text.append(event.text)
            logprobs += event.logprobs
        elif isinstance(event, Finished):
            cached = int(event.stats.get("cached_prompt_tokens", 0))
            u = usage(event.prompt_tokens, event.completion_tokens, cached)
            answer, made = "".join(text), None
            if calls:  # read as a stream of it is read: the two always agree
                answer, made = read_answer(answer, calls, calls_only)
            reason = "tool_calls" if made and event.finish_reason == "stop" else event.finish_reason
            body = shape.full(
                answer, reason, u, event.stats, logprobs, previous,
                tool_calls=[c.as_openai() for c in made] if made else None,
            )  # fmt: skip
            return web.json_response(body)
        elif isinstance(event, Failed):
            raise _failure(event.error)


async def _stream(
    request: web.Request,
    job: Job,
    shape: ResponseShape,
    req: CompletionRequest,
    keepalive: float,
    previous: int,  # the prompt's last token (log-probabilities name tokens in context)
    call_format: CallFormat | None = None,  # the answer is read as tool calls in this format
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    origin = request.headers.get("Origin")
    if origin and origin in request.app[CONFIG].cors_origins:
        response.headers.update(cors_headers(origin))
    await response.prepare(request)
    first = True
    offset = 0  # characters of text sent so far (the completions' text_offset)
    calls_only = req.tool_choice not in (None, "auto")
    calls = CallStream(call_format, calls_only) if call_format is not None else None
    if shape.chat:  # the role arrives before any text, as OpenAI's own stream does
        await response.write(sse(shape.chunk("", first=True)))
        first = False
    try:
        while True:
            event = await _next_event(job, request, keepalive)
            if event is None:
                # SSE comment: keeps proxies and clients from timing out during a long pass.
                await response.write(SSE_KEEPALIVE)
                continue
            # Take whatever else already arrived: when rounds outpace the client, one write
            # carries several rounds' text instead of one write per round.
            batch = [event]
            while not job.events.empty():
                batch.append(job.events.get_nowait())
            for trace in (t for e in batch if isinstance(e, Chunk) for t in e.trace):
                await response.write(sse(shape.trace_chunk(trace)))
            text = "".join(e.text for e in batch if isinstance(e, Chunk))
            logprobs = [lp for e in batch if isinstance(e, Chunk) for lp in e.logprobs]
            if calls is not None:
                events = calls.feed(text)
                if isinstance(batch[-1], Finished):
                    events += calls.finish()
                text = "".join(e[1] for e in events if e[0] == "content")
                deltas = [e for e in events if e[0] != "content"]
                if deltas:
                    await response.write(sse(shape.tool_chunk(deltas)))
                if calls.index >= 0:
                    logprobs = []  # a call's tokens are not content
            if text or logprobs:
                chunk = shape.chunk(
                    text, first=first, logprobs=logprobs, offset=offset, previous=previous
                )
                await response.write(sse(chunk))
                first = False
                offset += len(text)
                previous = logprobs[-1].token if logprobs else previous
            event = batch[-1]
            if isinstance(event, Finished):
                reason = event.finish_reason
                if calls is not None and calls.index >= 0 and reason == "stop":
                    reason = "tool_calls"
                await response.write(sse(shape.chunk("", finish_reason=reason, stats=event.stats)))
                if req.include_usage:
                    cached = int(event.stats.get("cached_prompt_tokens", 0))
                    u = usage(event.prompt_tokens, event.completion_tokens, cached)
                    await response.write(sse(shape.usage_chunk(u, event.stats)))
                break
            elif isinstance(event, Failed):
                await response.write(sse(_failure(event.error).body()))
                break
        await response.write(SSE_DONE)
        await response.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        # Normal operation (the client hung up): one debug line, the job cancelled.
        job.cancel()
        log.debug("%s: the client disconnected mid-stream; generation cancelled", shape.id)
        raise
    return response


def create_app(engine: Engine, metrics_: Metrics, config: ApiConfig) -> web.Application:
    app = web.Application(middlewares=[edge_middleware], client_max_size=config.max_body_bytes)
    app[ENGINE] = engine
    app[METRICS] = metrics_
    app[CONFIG] = config
    app[DRAINING] = asyncio.Event()
    app[PREPARERS] = ThreadPoolExecutor(PREPARING_THREADS, thread_name_prefix="specd-prepare")

    async def stop_preparers(app: web.Application) -> None:
        app[PREPARERS].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_preparers)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    # CORS preflights (OPTIONS with an allowed Origin) are answered by the middleware.
    return app
