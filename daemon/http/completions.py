"""The completion endpoints, /v1/chat/completions and /v1/completions: the body read
against its deadline, parsed (daemon/http/openai_wire.py) and admitted against the models
(`admit`, daemon/admission.py) on a preparing thread, handed to the `Engine`, and answered
by daemon/http/streaming.py as one body or an SSE stream.

It translates; it does not think. What the engine refuses for load (a full queue, memory
pressure, the models not ready) becomes a 503 with Retry-After here; a request's own fault
is a `RequestError`, answered as a 400 at the edge (daemon/http/edge.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import TypeVar

from aiohttp import web

from daemon.admission import Settled, settle
from daemon.engine import Engine
from daemon.http.connections import client_of
from daemon.http.edge import CONFIG, DRAINING, ENGINE, ApiConfig
from daemon.http.openai_errors import ApiError, bad_request
from daemon.http.openai_responses import ResponseShape
from daemon.http.openai_wire import (
    CompletionRequest,
    parse_chat,
    parse_completion,
    parse_json_object,
)
from daemon.http.streaming import collect, stream
from daemon.jobs import EngineNotReady, GenerationRequest, MemoryPressureError, QueueFullError
from speculative.grammar_compiler import CompilerBusy, GrammarCompiler

# Requests prepared (parsed, admitted: tokenized and checked) at once; the others wait
# their turn.
PREPARING_THREADS = 2
PREPARERS = web.AppKey("preparers", ThreadPoolExecutor)
# Grammars compiled at once (speculative/grammar_compiler.py), beside the preparing threads.
COMPILING_THREADS = 1
GRAMMARS = web.AppKey("grammars", GrammarCompiler)
# How often a request being prepared looks whether its client is still there.
POLL_SECONDS = 0.05
T = TypeVar("T")

LOADING_RETRY_AFTER = "5"
QUEUE_RETRY_AFTER = "1"
# Memory comes back when the other program lets go: later than a queue drains.
PRESSURE_RETRY_AFTER = "5"


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


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def _complete(request: web.Request, *, chat: bool) -> web.StreamResponse:
    app = request.app
    config = app[CONFIG]
    raw = await read_body(request, config)
    # From here the request is admitted work: it holds a place among those in flight while
    # it is prepared, so a burst of slow preparations cannot pile up past the limits.
    engine = app[ENGINE]
    try:
        seat = engine.reserve()
    except QueueFullError as exc:
        raise _queue_full(exc) from None
    try:
        loop = asyncio.get_running_loop()
        # Parsing, validating, rendering the chat template and tokenizing take time in
        # proportion to the body (0.6 s per megabyte of text to tokenize): off the event
        # loop, on a few threads (the others wait in the executor's queue), so /health and
        # the streams in flight keep flowing meanwhile. A request whose client leaves
        # while it waits there is dropped.
        work = loop.run_in_executor(app[PREPARERS], partial(_prepare, app, raw, chat))
        engine, req, settled, user = await _unless_gone(request, work)
        most = engine.limits.max_concurrent + engine.limits.queue_size
        if req.n > most:  # (a 503 would be retried for good: no wait lets it fit)
            raise bad_request(
                f"n is {req.n}, but this daemon holds at most {most} generations at once "
                "(limits.max_concurrent + limits.queue_size): ask for fewer choices",
                "n",
            )
        admitted = settled.request
        if settled.grammar is not None:
            # Its own lane: requests without a grammar never wait behind a compile.
            runtime = engine.runtime
            assert runtime is not None
            compiler = app[GRAMMARS]
            width = runtime.target.vocab_width
            peer = (
                client_of(request.transport.get_extra_info("peername"))
                if request.transport
                else None
            )
            compiling = compiler.submit(
                settled.grammar, runtime.tokenizer, width, peer or request.remote or "", user
            )
            # Cancelling the awaited future cancels the job: skipped if it has not started.
            admitted.constraint = await _unless_gone(
                request, asyncio.wrap_future(compiling.future), partial(compiler.check, compiling)
            )
        # The other choices (n > 1) made before the first starts: each its own generation,
        # seeded after the first, its grammar's state a copy of the first's.
        if req.n > 1:  # (their prompt prefilled once, by the first)
            admitted.prompt_group = object()
        others = [_choice(admitted, i) for i in range(1, req.n)]
        jobs = [engine.submit(admitted, loop, seat)]
        try:
            for other in others:
                jobs.append(engine.submit(other, loop))
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
    except QueueFullError as exc:
        raise _queue_full(exc) from None
    except MemoryPressureError as exc:
        raise ApiError(
            503, str(exc), type="service_unavailable", code="memory_pressure",
            headers={"Retry-After": PRESSURE_RETRY_AFTER},
        ) from None  # fmt: skip
    except CompilerBusy as exc:
        raise ApiError(
            503, str(exc), type="service_unavailable", code="grammar_compiler_busy",
            headers={"Retry-After": PRESSURE_RETRY_AFTER},
        ) from None  # fmt: skip
    except EngineNotReady:
        _require_ready(app)
        raise
    finally:
        engine.release(seat)  # a no-op once the job holds its place
    piece = raw_bytes = None
    if req.params.logprobs is not None and engine.runtime is not None:
        piece = engine.runtime.tokenizer.piece  # log-probabilities name tokens as text
        raw_bytes = engine.runtime.tokenizer.raw_bytes
    shape = ResponseShape(chat=chat, model=config.model_name, piece=piece, raw_bytes=raw_bytes)
    harmony = chat and engine.runtime is not None and engine.runtime.tokenizer.harmony
    harmony_calls = req.tools is not None and req.tool_choice != "none"
    try:
        previous = admitted.prompt_ids[-1]
        if req.stream:
            return await stream(
                request, jobs, shape, req, config.keepalive_seconds, previous, admitted.calls,
                harmony, harmony_calls, admitted.thinking,
            )  # fmt: skip
        calls_only = req.tool_choice not in (None, "auto")
        return await collect(
            request, jobs, shape, previous, admitted.calls, calls_only, harmony, harmony_calls,
            admitted.thinking,
        )  # fmt: skip
    finally:
        for job in jobs:
            if not job.done:
                job.cancel()  # the client went away (or we failed): free the engine's slot


def _choice(first: GenerationRequest, index: int) -> GenerationRequest:
    """Choice `index` of a request whose first choice is `first`: seeded `index` after it
    (a seed past 2**64 - 1 wraps to 0), its grammar's state a copy of the first's."""
    seed = first.params.seed
    if seed is not None:
        seed = seed + index if seed + index < 2**64 else seed + index - 2**64
    constraint = first.constraint.twin() if first.constraint is not None else None
    return replace(first, params=replace(first.params, seed=seed), constraint=constraint)


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


def _queue_full(exc: QueueFullError) -> ApiError:
    return ApiError(
        503, str(exc), type="service_unavailable", code="queue_full",
        headers={"Retry-After": QUEUE_RETRY_AFTER},
    )  # fmt: skip


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _unless_gone(
    request: web.Request, work: asyncio.Future[T], check: Callable[[], None] | None = None
) -> T:
    """`work`'s result, or ClientGone (and `work` cancelled: dropped if it has not started)
    once the client has closed its connection; `check` runs between two looks (a limit)."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=POLL_SECONDS)
        if done:
            return work.result()
        if _client_gone(request):
            work.cancel()
            raise ClientGone()
        if check is not None:
            check()


class ClientGone(ConnectionResetError):
    """The client closed its connection while its request was prepared (the edge counts
    it as a 499, as a stream cut short)."""


def _prepare(
    app: web.Application, raw: bytes, chat: bool
) -> tuple[Engine, CompletionRequest, Settled, str]:
    """A request body → the engine, the validated request, what the engine is to serve
    (`settle`: its prompt ids, the grammar still to compile, the format its answer's tool
    calls are read in) and the user it names (OpenAI's `user` field: the grammar
    compiler's turns go round the clients' addresses, then round each one's users), or
    the error that refuses it. Runs on a preparing thread."""
    config = app[CONFIG]
    body = parse_json_object(raw)
    req = parse_chat(body, config.limits) if chat else parse_completion(body, config.limits)
    if req.model is not None and not config.serves(req.model):
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
    user = body.get("user")
    return (
        engine,
        req,
        settle(engine.runtime, req, clamp_max_tokens=clamp),
        user if isinstance(user, str) else "",
    )
