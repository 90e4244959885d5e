"""A generation request as it crosses between the event loop and the engine's worker
thread: what is asked (`GenerationRequest`, made by `admit`, daemon/admission.py), the
events the worker posts back (`Chunk`s, then `Finished` or `Failed`), the `Job` that
carries them, the count of those in flight (`InFlight`), and the refusals `submit` can
raise before a job is queued (load, never the request: admission refused what the request
got wrong)."""

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
    # prompt and start from a copy of its KV caches (daemon/active_jobs.py).
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


class InFlight:
    """The generations in flight, counted against the house's limit: each request from
    `reserve` (its preparation) or `enter` (its job) until it leaves (given back, finished,
    failed or cancelled); at most max_concurrent + queue_size, a request's `n` choices each
    counting. Admission is counted, not left to the bound of the engine's queue: the worker
    drains that only between steps, so a bound on it alone refused requests while decode
    slots were free (three bursts of 48 with 8 + 32 allowed admitted 40, 40 and 34). Used
    from the event loop and the worker thread alike."""

    def __init__(self, max_concurrent: int, queue_size: int) -> None:
        self.max_concurrent = max_concurrent
        self.queue_size = queue_size
        self._entries: set[Job | Seat] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def figures(self) -> dict[str, int]:
        """What /health shows: the places taken, those of requests still being prepared
        among them, and the limit (a house full of slow preparations refuses requests
        while no generation is active or queued). A job whose client gave up takes none
        (`_take` drops it when the places run out)."""
        with self._lock:
            live = [e for e in self._entries if not e.cancelled]
        return {
            "taken": len(live),
            "preparing": sum(isinstance(e, Seat) for e in live),
            "limit": self.max_concurrent + self.queue_size,
        }

    def reserve(self) -> Seat:
        """A place for a request about to be prepared, or QueueFullError."""
        seat = Seat()
        with self._lock:
            self._take(seat)
        return seat

    def enter(self, job: Job, seat: Seat | None = None) -> None:
        """Count `job`: in the place `seat` still holds, else in a new one (or raise
        QueueFullError)."""
        with self._lock:
            if seat is not None and seat in self._entries:
                self._entries.discard(seat)
                self._entries.add(job)
            else:
                self._take(job)

    def leave(self, entry: Job | Seat) -> None:
        """`entry` no longer counts: a seat given back, a job finished, failed or cancelled."""
        with self._lock:
            self._entries.discard(entry)

    def _take(self, entry: Job | Seat) -> None:
        """Count `entry`, or raise QueueFullError (under the lock)."""
        most = self.max_concurrent + self.queue_size
        if len(self._entries) >= most:
            # A client that gave up (its job cancelled while it waited) holds no place:
            # the worker drops such a job when it reaches it.
            self._entries = {j for j in self._entries if not j.cancelled}
        if len(self._entries) >= most:
            raise QueueFullError(
                f"{most} generations are already in flight (a request's `n` choices each "
                f"count; {self.max_concurrent} decoding and {self.queue_size} waiting or "
                "being prepared: limits.max_concurrent and limits.queue_size); retry shortly"
            )
        self._entries.add(entry)


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
