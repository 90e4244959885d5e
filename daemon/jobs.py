"""A generation request as it crosses between the event loop and the engine's worker
thread: what is asked (`GenerationRequest`, made by `admit`, daemon/admission.py), the
events the worker posts back (`Chunk`s, then `Finished` or `Failed`), the `Job` that
carries them, and the refusals `submit` can raise before a job is queued (load, never the
request: admission refused what the request got wrong)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from modeling.text.thinking import Thinking
from speculative.generation import Chunk
from speculative.grammar import Constraint
from speculative.sampling import SamplingParams
from speculative.tool_calls import CallFormat


class QueueFullError(RuntimeError):
    """More requests are waiting than `limits.queue_size` allows (the client should retry)."""


class MemoryPressureError(RuntimeError):
    """Memory is critically short (memory.pressure): new requests wait until it is back."""


class EngineNotReady(RuntimeError):
    """The models are still loading, failed to load, or the engine is shutting down."""


class ServerShuttingDown(RuntimeError):
    """The daemon is stopping; in-flight generations end with this error."""


@dataclass
class GenerationRequest:
    """A generation as the engine serves it: the prompt's ids and every parameter settled
    (`admit` makes one from an `Ask`; tests and scripts may build one directly)."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    strategy: str | None = None  # None: the runtime's default
    budget: int | None = None  # tree budget for this request only
    tree_verification: str | None = None  # walk | rejection | auto for this request only
    ignore_eos: bool = False
    trace: bool = False  # chunks carry each round's draft tree (speculative.generation)
    # Structured output: the request's grammar state (speculative/grammar.py), made when
    # the request was admitted; one generation's own.
    constraint: Constraint | None = None
    # Tools offered: the format the answer's calls are read back in (by the HTTP layer;
    # the generation itself only follows the constraint).
    calls: CallFormat | None = None
    # A reasoning model's turn (modeling/text/thinking.py): its think block is read apart,
    # and stop strings apply after it.
    thinking: Thinking | None = None
    # The choices of one request (`n` > 1) share one: the others wait for the first one's
    # prompt and start from a copy of its KV caches (daemon/engine.py `_waits`, `_fork`).
    prompt_group: object | None = None


@dataclass
class Finished:
    """The last event of a job that completed: everything the response's usage needs."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any]


@dataclass
class Failed:
    error: BaseException


Event = Chunk | Finished | Failed


class Seat:
    """A request's place among those in flight while it is still being prepared
    (`Engine.reserve`): held until it becomes a `Job` or is given back."""

    cancelled = False  # given back explicitly, never dropped by the engine on its own


class Job:
    """One request inside the engine. `events` is read on the event loop; the worker posts
    to it with `call_soon_threadsafe`."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.submitted = time.perf_counter()
        self._cancelled = threading.Event()
        self.done = False

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def post(self, event: Event) -> None:
        if isinstance(event, Finished | Failed):
            self.done = True
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """Chunks held back by coalescing, as one event."""
    if len(chunks) == 1:
        return chunks[0]
    return Chunk(
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=chunks[-1].finish_reason,
        trace=[t for c in chunks for t in c.trace],
        logprobs=[lp for c in chunks for lp in c.logprobs],
    )
