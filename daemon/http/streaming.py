"""A job's events written to its client: the whole answer in one JSON body (`collect`) or
as they come, in server-sent events (`stream`), with tool calls read back from the text in
the request's call format and a failure in the OpenAI error shape. The bodies and chunks
themselves are shaped by daemon/http/openai_responses.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from daemon.http.edge import CONFIG, cors_headers
from daemon.http.openai_errors import ApiError, bad_request
from daemon.http.openai_responses import SSE_DONE, SSE_KEEPALIVE, ResponseShape, sse, usage
from daemon.http.openai_wire import CompletionRequest
from daemon.http.sending import send_within
from daemon.jobs import Failed, Finished, Job, ServerShuttingDown
from modeling.errors import RequestError
from modeling.text.thinking import Thinking
from offload.storage import LayerReadError
from speculative.generation import Chunk
from speculative.harmony import HarmonyReader, read_turn
from speculative.sampling import TokenLogprob
from speculative.thinking import ThinkReader
from speculative.tool_calls import CallFormat, CallStream, read_answer

log = logging.getLogger("specd.api")

DISCONNECT_POLL_SECONDS = 0.25


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
    if isinstance(error, LayerReadError):  # (the weight file changed or went: not our bug)
        return ApiError(
            503, f"the model's weights could not be read: {error}",
            type="service_unavailable", code="model_file_unreadable",
        )  # fmt: skip
    return ApiError(
        500,
        f"generation failed: {type(error).__name__}: {error} (see the daemon's log)",
        type="server_error",
    )


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def collect(
    request: web.Request,
    jobs: list[Job],
    shape: ResponseShape,
    previous: int,
    calls: CallFormat | None = None,  # the answer is read as tool calls in this format
    calls_only: bool = False,  # tool_choice required or named
    harmony: bool = False,  # a harmony model's turn: its answer and reasoning read apart
    harmony_calls: bool = False,  # ... and its calls (tools offered, tool_choice not none)
    thinking: Thinking | None = None,  # a reasoning model's turn: its think block read apart
) -> web.Response:
    """The whole answer in one body, a choice per job (`n` > 1: their tokens summed in
    the usage, the first's figures in `specd`). Nothing is written before the end, so a
    client that left is not noticed by a failed write as a stream's is: its connection is
    looked at after every event and every `DISCONNECT_POLL_SECONDS`, and the jobs
    cancelled."""
    tasks = []
    for i, job in enumerate(jobs):
        answer = _collect_choice(
            request, job, replace(shape, index=i), previous, calls, calls_only, harmony,
            harmony_calls, thinking,
        )  # fmt: skip
        tasks.append(asyncio.ensure_future(answer))
    try:
        bodies = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    body = bodies[0]
    if len(bodies) > 1:
        body["choices"] = [b["choices"][0] for b in bodies]
        made = sum(b["usage"]["completion_tokens"] for b in bodies)
        body["usage"]["completion_tokens"] = made
        body["usage"]["total_tokens"] = body["usage"]["prompt_tokens"] + made
    return web.json_response(body)


async def _collect_choice(
    request: web.Request,
    job: Job,
    shape: ResponseShape,
    previous: int,
    calls: CallFormat | None,
    calls_only: bool,
    harmony: bool,
    harmony_calls: bool,
    thinking: Thinking | None,
) -> dict[str, Any]:
    """One job's whole answer, as the body of a response with one choice."""
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
            answer, made, reasoning = "".join(text), None, ""
            if harmony:  # its answer, reasoning and calls, read back from its text
                answer, reasoning, made = read_turn(answer, harmony_calls)
            reader = None
            if thinking is not None:  # its reasoning apart; the calls after it
                reader = ThinkReader(thinking)
                read = reader.feed(answer) + reader.finish()
                answer = "".join(e[1] for e in read if e[0] == "content")
                reasoning = "".join(e[1] for e in read if e[0] == "reasoning")
            if calls:  # read as a stream of it is read: the two always agree
                began = calls_only or answer.startswith(calls.lead)
                answer, made = read_answer(answer, calls, calls_only)
                if began:  # a call's tokens, even one cut in its head, are not content
                    logprobs = _before_answer(logprobs, reader)
            reason = "tool_calls" if made and event.finish_reason == "stop" else event.finish_reason
            return shape.full(
                answer, reason, u, event.stats, logprobs, previous,
                tool_calls=[c.as_openai() for c in made] if made else None,
                reasoning=reasoning,
            )  # fmt: skip
        elif isinstance(event, Failed):
            raise _failure(event.error)


def _before_answer(logprobs: list[TokenLogprob], reader: ThinkReader | None) -> list[TokenLogprob]:
    """Of an answer that calls, the log-probabilities of its think block's tokens (those
    whose text begins before the answer): the call's own are not content, the reasoning's
    are given as a turn without calls gives them."""
    if reader is None:
        return []
    if reader.answer_at is None:  # (the answer has not begun: all of it is reasoning)
        return list(logprobs)
    at = reader.answer_at
    return [lp for lp in logprobs if lp.start is not None and lp.start < at]


Send = Callable[[bytes | None], Awaitable[None]]


class _ChoiceFailed(Exception):
    """A choice's generation failed; its error event was sent."""


async def stream(
    request: web.Request,
    jobs: list[Job],
    shape: ResponseShape,
    req: CompletionRequest,
    keepalive: float,
    previous: int,  # the prompt's last token (log-probabilities name tokens in context)
    call_format: CallFormat | None = None,  # the answer is read as tool calls in this format
    harmony: bool = False,  # a harmony model's turn: its answer and reasoning read apart
    harmony_calls: bool = False,  # ... and its calls (tools offered, tool_choice not none)
    thinking: Thinking | None = None,  # a reasoning model's turn: its think block read apart
) -> web.StreamResponse:
    """The jobs' answers as one SSE stream, each under its choice's index (`n` > 1: the
    choices' chunks interleave as they come), then the usage (all choices' tokens) and
    [DONE]. A choice that fails sends its error and ends the stream, the others
    cancelled."""
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
    limit = request.app[CONFIG].send_timeout_seconds
    min_rate = request.app[CONFIG].min_send_bytes_per_second
    writing = asyncio.Lock()  # (one write at a time: the choices' chunks never interleave)

    async def send(data: bytes | None) -> None:
        """`data` written (None: the body's end), or the connection dropped where the
        client has taken none of what is queued for `limit` seconds, or too little of it
        (`send_within`)."""
        async with writing:
            sent = response.write(data) if data is not None else response.write_eof()
            await send_within(request, sent, limit, min_rate)

    tasks = []
    for i, job in enumerate(jobs):
        choice = _stream_choice(
            request, job, replace(shape, index=i), req, keepalive, previous, send,
            call_format, harmony, harmony_calls, thinking,
        )  # fmt: skip
        tasks.append(asyncio.ensure_future(choice))
    try:
        try:
            ends: list[Finished] | None = list(await asyncio.gather(*tasks))
        except _ChoiceFailed:
            ends = None
        finally:
            for task in tasks:
                task.cancel()
        if ends is None:
            for job in jobs:
                job.cancel()
        elif req.include_usage:
            cached = int(ends[0].stats.get("cached_prompt_tokens", 0))
            made = sum(e.completion_tokens for e in ends)
            u = usage(ends[0].prompt_tokens, made, cached)
            await send(sse(shape.usage_chunk(u, ends[0].stats)))
        await send(SSE_DONE)
        try:
            await send(None)  # the end of the body
        except ConnectionError:
            # An SSE client stops reading at [DONE] and may close before the body's last
            # bytes: it had the whole answer (a 200; it was counted a 499, a newcomer saw).
            log.debug("%s: the client closed after [DONE]", shape.id)
    except (ConnectionError, asyncio.CancelledError):  # (a drain: "Connection lost")
        # Normal operation (the client hung up): one debug line, the jobs cancelled.
        for job in jobs:
            job.cancel()
        log.debug("%s: the client disconnected mid-stream; generation cancelled", shape.id)
        raise
    return response


async def _stream_choice(
    request: web.Request,
    job: Job,
    shape: ResponseShape,  # this choice's (its index)
    req: CompletionRequest,
    keepalive: float,
    previous: int,
    send: Send,
    call_format: CallFormat | None,
    harmony: bool,
    harmony_calls: bool,
    thinking: Thinking | None,
) -> Finished:
    """One choice's chunks, sent as its job's events come, up to its finish chunk; its
    Finished event. A failure is sent as the stream's error (`_ChoiceFailed`)."""
    first = True
    offset = 0  # characters of text sent so far (the completions' text_offset)
    calls_only = req.tool_choice not in (None, "auto")
    calls = CallStream(call_format, calls_only) if call_format is not None else None
    held: list[TokenLogprob] = []  # log-probabilities of text that may still be a call's
    turn: HarmonyReader | ThinkReader | None = None
    if harmony:
        turn = HarmonyReader(harmony_calls)
    elif thinking is not None:
        turn = ThinkReader(thinking)
    if shape.chat:  # the role arrives before any text, as OpenAI's own stream does
        await send(sse(shape.chunk("", first=True)))
        first = False
    while True:
        event = await _next_event(job, request, keepalive)
        if event is None:
            # SSE comment: keeps proxies and clients from timing out during a long pass.
            await send(SSE_KEEPALIVE)
            continue
        # Take whatever else already arrived: when rounds outpace the client, one write
        # carries several rounds' text instead of one write per round.
        batch = [event]
        while not job.events.empty():
            batch.append(job.events.get_nowait())
        if _client_gone(request):
            # (a stream that has nothing to write, its text held back by a stop string's
            # prefix, is told of a client that left by no failed write)
            raise ConnectionResetError("client disconnected")
        for trace in (t for e in batch if isinstance(e, Chunk) for t in e.trace):
            await send(sse(shape.trace_chunk(trace)))
        text = "".join(e.text for e in batch if isinstance(e, Chunk))
        logprobs = [lp for e in batch if isinstance(e, Chunk) for lp in e.logprobs]
        reasoning = ""
        if turn is not None:
            read = turn.feed(text)
            if isinstance(batch[-1], Finished):
                read += turn.finish()
            text = "".join(e[1] for e in read if e[0] == "content")
            reasoning = "".join(e[1] for e in read if e[0] == "reasoning")
            call_deltas = [e for e in read if e[0] in ("call", "arguments")]
        else:
            call_deltas = []
        if calls is not None:
            events = calls.feed(text)
            if isinstance(batch[-1], Finished):
                events += calls.finish()
            text = "".join(e[1] for e in events if e[0] == "content")
            call_deltas += [e for e in events if e[0] != "content"]
            ended = isinstance(batch[-1], Finished)
            thought = turn if isinstance(turn, ThinkReader) else None
            if calls.state not in ("undecided", "text"):
                # A call begun: its tokens are not content (the think block's before it
                # keep theirs).
                logprobs, held = _before_answer(held + logprobs, thought), []
            elif calls.state == "undecided" and not ended:  # its text is held: so are they
                logprobs, held = [], held + logprobs
            elif calls.calls_only:  # (ended before a call began: no content either)
                logprobs, held = _before_answer(held + logprobs, thought), []
            else:
                logprobs, held = held + logprobs, []
        if text or logprobs or reasoning:
            chunk = shape.chunk(
                text, first=first, logprobs=logprobs, offset=offset, previous=previous,
                reasoning=reasoning,
            )  # fmt: skip
            await send(sse(chunk))
            first = False
            offset += len(text)
            previous = logprobs[-1].token if logprobs else previous
        if call_deltas:  # after the reasoning and text that came before them
            await send(sse(shape.tool_chunk(call_deltas)))
        event = batch[-1]
        if isinstance(event, Finished):
            reason = event.finish_reason
            called = (calls is not None and calls.index >= 0) or (turn and turn.calls)
            if called and reason == "stop":
                reason = "tool_calls"
            await send(sse(shape.chunk("", finish_reason=reason, stats=event.stats)))
            return event
        if isinstance(event, Failed):
            await send(sse(_failure(event.error).body()))
            raise _ChoiceFailed
