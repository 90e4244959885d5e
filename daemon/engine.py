"""The engine: one worker thread owns the models; HTTP handlers hand it jobs through a
bounded queue and read results from a per-job asyncio queue.

A job's life: `submit` queues a request that admission settled (daemon/admission.py), or
refuses it for load (memory pressure, a full house); between steps the worker follows
memory pressure (`MemoryWatch.follow`), lets queued jobs in (`_admit`, `_begin`: a
strategy, a session, a `Generation`) and runs a step.
A generation is a step-wise generator (`Generation.steps`): the engine runs it on to its next
pass request (`_advance`), posting the chunks it makes on the way (`_take`, coalesced for
`stream_interval`), and the `PassScheduler` (speculative/batching.py) answers the requests of
every active generation together, one batched pass per model, and hands the results back
(docs/architecture.md, "Many requests, one pass"). A cancelled job leaves before the next
step and its KV cache is freed; a fault fails its own job only. A finished generation posts
its statistics and gives its session back to the pool.

`batch_passes` False restores the interleaved engine (one generation's round at a time,
each pass its own) for side-by-side measurement (scripts/bench_concurrency.py).

Conversation reuse: finished sessions are kept in a small LRU pool; a new request takes the
idle session holding the longest common prefix with its prompt, so only the new suffix is
prefilled (`Generation` reports it as `stats.cached_prompt_tokens`).

What the job's life leans on lives apart: the count of requests in flight (`InFlight`,
daemon/jobs.py), the record of a running job and the choices of one request that share
their prompt (`ActiveJob`, daemon/active_jobs.py), memory pressure (`MemoryWatch`,
daemon/memory_watch.py, with the relief steps of daemon/relief.py) and the pass
scheduling (speculative/batching.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from daemon.active_jobs import ActiveJob, prompt_fork, waits_for_prompt
from daemon.jobs import (
    EngineNotReady,
    Failed,
    Finished,
    GenerationRequest,
    InFlight,
    Job,
    MemoryPressureError,
    Seat,
    ServerShuttingDown,
    merge_chunks,
)
from daemon.memory_watch import MemoryWatch
from daemon.metrics import Metrics
from daemon.options import RuntimeOptions
from daemon.pools import SessionPool, StrategyPool
from daemon.pressure import PressureMonitor, PressureThresholds
from daemon.relief import Relief
from daemon.runtime import Runtime
from modeling.errors import RequestError, rust_panic
from speculative.batching import PassScheduler
from speculative.generation import Chunk
from speculative.passes import Allot, Forward
from speculative.prefill import ALONE_PREFILL, SHARED_PREFILL
from speculative.rounds import GenerationStats, Strategy

log = logging.getLogger("specd.engine")


@dataclass
class EngineLimits:
    queue_size: int = 32
    max_concurrent: int = 8
    cached_sessions: int = 4
    # Seconds of text coalesced into one event for the event loop (first token and the end
    # go at once). Each event costs the loop thread some Python work, and that work holds
    # the GIL the decoder needs: one event per round would slow a fast decoder down.
    stream_interval: float = 0.02
    # One pass per model per step for every active generation (False: the interleaved
    # engine, one generation's round at a time, kept for measurement).
    batch_passes: bool = True
    # Tokens one batched pass may carry; None: the plan's largest pass.
    max_pass_tokens: int | None = None


class Engine:
    """Owns the runtime on its worker thread. `start()` loads the models in that thread so
    the HTTP server can answer /health (503) while they load."""

    def __init__(
        self,
        options: RuntimeOptions,
        limits: EngineLimits,
        metrics: Metrics,
        runtime_factory: Callable[[RuntimeOptions], Runtime] = Runtime,
        pressure: PressureThresholds | None = None,
        device_probe: Callable[[], int] | None = None,
    ) -> None:
        """`pressure`: watch memory while serving (daemon/pressure.py); None: do not.
        `device_probe`: free device bytes, in place of CUDA's count (tests)."""
        self.options = options
        self.limits = limits
        self.metrics = metrics
        self._runtime_factory = runtime_factory
        self.runtime: Runtime | None = None
        self.load_error: BaseException | None = None
        self._queue: queue.Queue[Job] = queue.Queue()  # jobs waiting for a slot
        self._in_flight = InFlight(limits.max_concurrent, limits.queue_size)
        # A pass's bounds (set once the runtime's plan is known): tokens, and logit rows.
        self.max_pass_tokens = limits.max_pass_tokens or 0
        self.max_pass_rows = 0
        self._active: deque[ActiveJob] = deque()
        self._waiting: list[Job] = []  # choices waiting for their first one's prompt
        self._passes: PassScheduler[ActiveJob]  # made once the models are loaded
        self._idle = SessionPool(limits.cached_sessions)
        self._strategies = StrategyPool()
        self._compiled_seen = 0  # compiled models ready when the strategies were built
        self._stopping = threading.Event()
        self.loaded = threading.Event()  # set once loading finished, successfully or not
        self.loading_note: str | None = None  # what loading is doing, while it takes long
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="specd-engine", daemon=True)
        self._memory = MemoryWatch(pressure, metrics)
        self.device_probe = device_probe  # set before start() to replace CUDA's count

    # ---- called from the event loop ----

    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.runtime is not None and not self._stopping.is_set()

    @property
    def state(self) -> str:
        if self._stopping.is_set():
            return "stopping"
        if self.load_error is not None:
            return "failed"
        return "ready" if self.runtime is not None else "loading"

    def reserve(self) -> Seat:
        """A place among the requests in flight for one about to be prepared (parsed,
        tokenized, its grammar compiled): preparing is admitted work, counted from here,
        so a burst of slow preparations cannot pile up beyond the limits. `submit` turns
        it into the job; `release` gives it back if the request never gets there."""
        return self._in_flight.reserve()

    def release(self, seat: Seat) -> None:
        self._in_flight.leave(seat)

    def submit(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, seat: Seat | None = None
    ) -> Job:
        """Queue `request`, as `admit` (daemon/admission.py) settled it: what is refused
        here is load (not ready, memory pressure, a full house), never the request.
        `seat`: the place `reserve` gave it while it was prepared (then it is not counted
        again, and is given back if the request is refused here)."""
        try:
            if not self.ready:
                raise EngineNotReady(f"the engine is {self.state}")
            if self._memory.critical:
                raise MemoryPressureError(
                    "free memory is below the critical line (memory.pressure): requests in "
                    "flight finish, new ones are refused until it is back; retry shortly"
                )
            job = Job(request, loop)
            self._in_flight.enter(job, seat)
            self._queue.put_nowait(job)
        finally:
            if seat is not None:
                self.release(seat)
        if self._stopping.is_set():  # shutdown drained the queue meanwhile: not served
            self._in_flight.leave(job)
            raise EngineNotReady(f"the engine is {self.state}")
        self.metrics.queue_depth.set(self.queued)
        with self._wake:
            self._wake.notify()
        return job

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker: queued and active jobs end with `ServerShuttingDown`."""
        self._stopping.set()
        with self._wake:
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._memory.stop()

    def _loading(self, note: str) -> None:
        self.loading_note = note

    # ---- introspection (tests, /health) ----

    @property
    def pressure(self) -> PressureMonitor | None:
        """The memory monitor, once the models are loaded; None: memory is not watched."""
        return self._memory.monitor

    @property
    def relief(self) -> Relief:
        """The relief steps memory pressure can take, and those in force."""
        return self._memory.relief

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def idle_sessions(self) -> int:
        return len(self._idle)

    @property
    def in_flight(self) -> dict[str, int]:
        """The places taken against limits.max_concurrent + limits.queue_size (`InFlight`)."""
        return self._in_flight.figures()

    @property
    def queued(self) -> int:
        """Generations not begun: queued, and choices waiting for their first's prompt; a
        job whose client gave up is none, though the worker drops it only as it reaches it
        (which a busy engine does only when a slot frees)."""
        with self._queue.mutex:
            queued = sum(not job.cancelled for job in self._queue.queue)
        return queued + sum(not job.cancelled for job in list(self._waiting))

    # ---- the worker thread ----

    def _work(self) -> None:
        try:
            self.runtime = self._runtime_factory(replace(self.options, on_progress=self._loading))
            self.max_pass_tokens = self.limits.max_pass_tokens or self.runtime.max_pass_tokens
            self.max_pass_rows = self.runtime.max_pass_rows
            self._passes = PassScheduler(
                self.runtime.target,
                self,
                advance=self._advance,
                fail=self._fail,
                rode=self._rode,
                out_of_memory=self._memory.out_of_memory,
            )
            log.info("models loaded: %s", self.options.model)
            self.metrics.set_draft(self.runtime.draft_kind, self.runtime.substitute_bits)
            # Compiled passes warm on their own thread: requests run eager until then. A
            # runtime whose owner decided already (`specd bench`) keeps its choice.
            if self.runtime.compilation is None:
                self.runtime.compile(serving=True).warm_in_background()
            self._memory.start(self.runtime, self._idle, self._strategies, self, self.device_probe)
        except BaseException as exc:  # reported by /health and every request
            self.load_error = exc
            log.error("loading the models failed: %s", exc)
            return
        finally:
            self.loaded.set()
        while not self._stopping.is_set():
            self._memory.follow()
            self._admit()
            if not self._active:
                with self._wake:
                    if self._queue.empty() and not self._stopping.is_set():
                        self._wake.wait(timeout=0.5)
                continue
            try:
                self._step()
            except BaseException as exc:  # a bug outside any one generation: never stop serving
                if not isinstance(exc, Exception) and not rust_panic(exc):
                    raise
                log.error("an engine step failed; its generations fail with it", exc_info=exc)
                for active in list(self._active):
                    self._fail(active, exc)
        self._fail_everything(ServerShuttingDown("the server is shutting down"))
        self.runtime.save_learned()  # for the next start (daemon/learned_store.py)

    def _admit(self) -> None:
        waiting, self._waiting = self._waiting, []
        for job in waiting:  # (the choices whose first one was still reading their prompt)
            self._start(job)
        while len(self._active) + len(self._waiting) < self.limits.max_concurrent:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            self._start(job)
        self.metrics.queue_depth.set(self.queued)

    def _start(self, job: Job) -> None:
        """Begin `job`, or keep it waiting for its request's first choice's prompt."""
        if job.cancelled:
            self.metrics.cancelled.inc()
            self._in_flight.leave(job)
            return
        if waits_for_prompt(job.request, self._active):
            self._waiting.append(job)
            return
        try:
            self._active.append(self._begin(job))
        except BaseException as exc:  # a bad request that got past validation, or a bug
            if not isinstance(exc, Exception) and not rust_panic(exc):
                raise
            if not isinstance(exc, RequestError):
                log.error("starting a generation failed", exc_info=exc)
            self._end(job, Failed(exc))

    def _begin(self, job: Job) -> ActiveJob:
        assert self.runtime is not None
        req = job.request
        strategy = self._strategy(req.strategy, req.budget, req.tree_verification)
        pool_key = strategy.name
        # (a choice's first sibling holds the whole prompt: before any idle session, which
        # may share none of it and was taken first, a whole prefill again)
        session = (
            prompt_fork(req, pool_key, self._active)
            or self._idle.take(pool_key, req.prompt_ids)
            or self.runtime.new_session(strategy)
        )
        if self.runtime.device.type == "cpu":
            # A pass costs its compute there: a prefill's passes are kept shorter still
            # while others wait on them (speculative/prefill.py, `chunk_now`).
            session.pass_bound = self._prefill_bound
        return ActiveJob.begin(job, strategy, session, self.runtime.tokenizer)

    def _prefill_bound(self) -> tuple[float, int]:
        """A CPU prefill pass's bound: shared while it serves (or holds up) more than one
        generation, asked as the pass is cut, so a job queued during the last pass
        counts already."""
        shared = len(self._active) > 1 or not self._queue.empty()
        return SHARED_PREFILL if shared else ALONE_PREFILL

    def _strategy(
        self, name: str | None, budget: int | None, verification: str | None = None
    ) -> Strategy:
        assert self.runtime is not None
        compilation = self.runtime.compilation
        if compilation is not None and compilation.ready_count != self._compiled_seen:
            # A model's passes now run compiled: the costs `auto` measured before (eager,
            # and slowed by the compiler's own work meanwhile) no longer hold.
            self._compiled_seen = compilation.ready_count
            self._strategies.clear()
        return self._strategies.get(self.runtime, name, budget, verification)

    def _step(self) -> None:
        """One step: cancelled jobs leave, then either one batched pass per model for every
        active generation, or (interleaved) one round of the generation at the head of the
        line, which then goes to the back (speculative/batching.py)."""
        for active in list(self._active):
            if active.job.cancelled:
                self._active.remove(active)
                with contextlib.suppress(Exception):  # the session and its KV cache go too
                    active.steps.close()
                self.metrics.cancelled.inc()
                self._in_flight.leave(active.job)
        if not self._active:
            return
        if not self.limits.batch_passes:
            active = self._active[0]
            self._active.rotate(-1)
            self._passes.step_alone(active)
            return
        self._active.rotate(-1)  # whoever waited behind the bound goes first next time
        self._passes.step(self._active)

    def _rode(self, riders: list[ActiveJob], tokens: int) -> None:
        """They rode one target pass of `tokens` tokens together: the metrics, and each
        one's batching figures."""
        self.metrics.record_pass(len(riders), tokens)
        for active in riders:
            active.rode(len(riders))

    def _advance(self, active: ActiveJob) -> None:
        """Run a generation on to its next pass request, posting the chunks it makes on the
        way. Whatever fails fails this job only: the worker keeps serving the others."""
        try:
            while True:
                try:
                    item = next(active.steps)
                except StopIteration:
                    self._finish(active)
                    return
                if isinstance(item, Forward | Allot):
                    active.pass_request = item
                    return
                if self._take(active, item):
                    return
        except BaseException as exc:  # (a library's panic too: this job fails, not the thread)
            if not isinstance(exc, Exception) and not rust_panic(exc):
                raise
            self._fail(active, exc)

    def _take(self, active: ActiveJob, chunk: Chunk) -> bool:
        """Post (or hold) a chunk; True when it ended the generation."""
        job = active.job
        active.chunks += 1
        now = time.perf_counter()
        # An empty chunk is progress only (a prefill chunk ran): nothing to add, but text
        # held back from earlier rounds must not wait for the rest of a long prefill.
        first = not active.first_token_seen and bool(chunk.token_ids)
        if first:
            active.first_token_seen = True
            self.metrics.time_to_first_token.observe(now - job.submitted)
        if chunk.text or chunk.token_ids or chunk.finish_reason is not None:
            active.held.append(chunk)
        due = now - active.last_post >= self.limits.stream_interval
        if active.held and (first or due or chunk.finish_reason is not None):
            job.post(merge_chunks(active.held))
            active.held = []
            active.last_post = now
        if chunk.finish_reason is not None:
            self._finish(active)
            return True
        return False

    def _fail(self, active: ActiveJob, exc: BaseException) -> None:
        if isinstance(exc, RequestError):
            # The request's fault found while it ran (a grammar the vocabulary cannot
            # spell further on): one line, as the edge logs a refusal.
            log.warning("generation refused: %s", str(exc)[:240].replace("\n", " "))
        else:
            log.error("generation failed", exc_info=exc)
        self.metrics.failed.inc()
        if active in self._active:
            self._active.remove(active)
        with contextlib.suppress(Exception):
            active.steps.close()
        self._end(active.job, Failed(exc))

    def _finish(self, active: ActiveJob) -> None:
        if active in self._active:
            self._active.remove(active)
        active.steps.close()
        gen = active.generation
        stats: GenerationStats = gen.stats
        assert self.runtime is not None
        stats.extra.update(active.batching())
        # The streamer counts since its last report; with interleaved generations the
        # figures are shared among them, but the totals in /metrics stay exact.
        stats.extra.update(self.runtime.offload_stats())
        stats.extra.update(self.runtime.draft_stats())
        self.metrics.record_generation(stats, gen.completion_tokens)
        self._end(
            active.job,
            Finished(
                finish_reason=gen.finish_reason or "length",
                prompt_tokens=len(gen.prompt_ids),
                completion_tokens=gen.completion_tokens,
                stats=stats.to_dict(),
            ),
        )
        self._idle.release(active.pool_key, active.session)
        self.runtime.save_learned(force=False)  # now and then: a crash loses little

    def _end(self, job: Job, event: Finished | Failed) -> None:
        """The job's last event: it leaves the engine."""
        try:
            job.post(event)
        finally:
            self._in_flight.leave(job)

    def _fail_everything(self, error: BaseException) -> None:
        while self._active:
            self._end(self._active.popleft().job, Failed(error))
        waiting, self._waiting = self._waiting, []
        for job in waiting:
            self._end(job, Failed(error))
        while True:
            try:
                self._end(self._queue.get_nowait(), Failed(error))
            except queue.Empty:
                break
        self._idle.clear()
        self.metrics.queue_depth.set(0)
