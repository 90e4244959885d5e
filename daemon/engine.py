"""The engine: one worker thread owns the models; HTTP handlers hand it jobs through a
bounded queue and read results from a per-job asyncio queue.

A job's life: `submit` queues a request that admission settled (daemon/admission.py), or
refuses it for load (memory pressure, a full house); between steps the worker relieves
memory pressure (`_relieve`), lets queued jobs in (`_admit`, `_begin`: a strategy, a
session, a `Generation`) and runs a step.
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

Past ~400 lines, knowingly: this is one idea, a job's life on the worker thread, whose
pass scheduling is speculative/batching.py and whose relief steps are daemon/relief.py;
what is left here of memory pressure (`_watch_memory`, `_relieve`) is the wiring of
those into the loop, and could move into a watcher object of its own.
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
from collections.abc import Generator as PyGenerator
from dataclasses import dataclass, field, replace

from daemon.jobs import (
    EngineNotReady,
    Failed,
    Finished,
    GenerationRequest,
    Job,
    MemoryPressureError,
    QueueFullError,
    Seat,
    ServerShuttingDown,
    merge_chunks,
)
from daemon.metrics import Metrics
from daemon.options import RuntimeOptions
from daemon.pools import SessionPool, StrategyPool
from daemon.pressure import PressureMonitor, PressureThresholds, cuda_probe, host_probe, settled
from daemon.relief import Relief, relief_steps
from daemon.runtime import Runtime
from modeling.errors import RequestError, rust_panic
from speculative.batching import PassScheduler
from speculative.generation import Chunk, Generation
from speculative.passes import Allot, Forward, PassRequest
from speculative.prefill import ALONE_PREFILL, SHARED_PREFILL
from speculative.rounds import GenerationStats, Strategy
from speculative.session import Session, common_prefix_len

log = logging.getLogger("specd.engine")


@dataclass(eq=False)
class _Active:
    """An active job: its generation, and what the pass scheduler reads and keeps of it
    (speculative.batching.Scheduled)."""

    job: Job
    generation: Generation
    steps: PyGenerator[Chunk | PassRequest, None, None]
    session: Session
    pool_key: str
    first_token_seen: bool = False
    held: list[Chunk] = field(default_factory=list)  # coalesced, not yet posted
    last_post: float = 0.0
    pass_request: PassRequest | None = None  # the pass (or the tree nodes) it waits for
    chunks: int = 0  # chunks taken (rounds and prefill steps)
    target_passes: int = 0  # target passes it rode in
    pass_generations: int = 0  # generations in those passes, summed
    shared_passes: int = 0  # those that also carried another generation's work
    grown: int = 0  # tree nodes granted to this round so far (rows of the coming pass)

    @property
    def pass_rows(self) -> int:
        return self.generation.strategy.pass_rows

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled


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
        # Jobs waiting for a slot. Admission is counted, not left to the queue's bound: the
        # worker drains the queue only between steps, so a bound on it alone refused
        # requests while decode slots were free (three bursts of 48 with 8 + 32 allowed
        # admitted 40, 40 and 34). `_in_flight` counts every request from `reserve` (its
        # preparation) or `submit` until it leaves (given back, finished, failed or
        # cancelled); at most max_concurrent + queue_size.
        self._queue: queue.Queue[Job] = queue.Queue()
        self._in_flight: set[Job | Seat] = set()
        self._admission = threading.Lock()
        # A pass's bounds (set once the runtime's plan is known): tokens, and logit rows.
        self.max_pass_tokens = limits.max_pass_tokens or 0
        self.max_pass_rows = 0
        self._active: deque[_Active] = deque()
        self._waiting: list[Job] = []  # choices waiting for their first one's prompt
        self._passes: PassScheduler[_Active]  # made once the models are loaded
        self._idle = SessionPool(limits.cached_sessions)
        self._strategies = StrategyPool()
        self._compiled_seen = 0  # compiled models ready when the strategies were built
        self._stopping = threading.Event()
        self.loaded = threading.Event()  # set once loading finished, successfully or not
        self.loading_note: str | None = None  # what loading is doing, while it takes long
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="specd-engine", daemon=True)
        self._pressure_thresholds = pressure
        self.device_probe = device_probe  # set before start() to replace CUDA's count
        self.pressure: PressureMonitor | None = None  # watching once the models are loaded
        self.relief = Relief([])
        self._pressure_recorded: tuple[object, int] | None = None

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
        seat = Seat()
        with self._admission:
            self._take_place(seat)
        return seat

    def release(self, seat: Seat) -> None:
        with self._admission:
            self._in_flight.discard(seat)

    def _take_place(self, entry: Job | Seat) -> None:
        """Count `entry` in flight, or raise QueueFullError (under `_admission`)."""
        most = self.limits.max_concurrent + self.limits.queue_size
        if len(self._in_flight) >= most:
            # A client that gave up (its job cancelled while it waited) holds no slot:
            # the worker drops such a job when it reaches it.
            self._in_flight = {j for j in self._in_flight if not j.cancelled}
        if len(self._in_flight) >= most:
            raise QueueFullError(
                f"{most} generations are already in flight (a request's `n` choices each "
                f"count; {self.limits.max_concurrent} decoding and {self.limits.queue_size} "
                "waiting or being prepared: limits.max_concurrent and limits.queue_size); "
                "retry shortly"
            )
        self._in_flight.add(entry)

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
            if self.pressure is not None and self.pressure.level == "critical":
                raise MemoryPressureError(
                    "free memory is below the critical line (memory.pressure): requests in "
                    "flight finish, new ones are refused until it is back; retry shortly"
                )
            job = Job(request, loop)
            with self._admission:
                if seat is not None and seat in self._in_flight:
                    self._in_flight.discard(seat)
                    self._in_flight.add(job)
                else:
                    self._take_place(job)
                self._queue.put_nowait(job)
        finally:
            if seat is not None:
                self.release(seat)
        if self._stopping.is_set():  # shutdown drained the queue meanwhile: not served
            self._leave(job)
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
        if self.pressure is not None:
            self.pressure.stop()

    def _loading(self, note: str) -> None:
        self.loading_note = note

    # ---- introspection (tests, /health) ----

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def idle_sessions(self) -> int:
        return len(self._idle)

    @property
    def queued(self) -> int:
        """Generations not begun: queued, and choices waiting for their first's prompt."""
        return self._queue.qsize() + len(self._waiting)

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
                out_of_memory=self._out_of_memory,
            )
            log.info("models loaded: %s", self.options.model)
            self.metrics.set_draft(self.runtime.draft_kind, self.runtime.substitute_bits)
            # Compiled passes warm on their own thread: requests run eager until then. A
            # runtime whose owner decided already (`specd bench`) keeps its choice.
            if self.runtime.compilation is None:
                self.runtime.compile(serving=True).warm_in_background()
            self._watch_memory()
        except BaseException as exc:  # reported by /health and every request
            self.load_error = exc
            log.error("loading the models failed: %s", exc)
            return
        finally:
            self.loaded.set()
        while not self._stopping.is_set():
            self._relieve()
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

    def _watch_memory(self) -> None:
        """Start the memory monitor, its auto lines settled from what is available now the
        models are loaded and from the margin the plan left on the device."""
        thresholds = self._pressure_thresholds
        if thresholds is None or not thresholds.enabled:
            return
        assert self.runtime is not None
        gpu = self.runtime.device.type == "cuda"
        probe = self.device_probe
        if probe is None and gpu:
            probe = cuda_probe(self.runtime.device)
        plan = self.runtime.plan
        margin = plan.budget.device_bytes - plan.device_bytes if probe is not None else None
        thresholds = settled(thresholds, host_probe()[0], margin)
        steps = relief_steps(
            self.runtime,
            self._idle,
            self._strategies,
            self,
            device_watched=probe is not None,
            host_floor=thresholds.tight_host_free or 0,
        )
        self.relief = Relief(steps)
        self.pressure = PressureMonitor(thresholds, device_free=probe)
        self.pressure.start()

    def _relieve(self) -> None:
        """Follow the memory monitor's level with the relief steps (between passes, on
        this thread: the steps free what the passes use). A step that fails is logged and
        the engine serves on."""
        if self.pressure is None:
            return
        taken = self.relief.taken
        try:
            self.relief.follow(self.pressure.level, self.pressure.thresholds, self.pressure.short)
            if self.relief.taken > taken:
                self._return_device_memory()
        except Exception as exc:
            log.error("a memory relief step failed; serving on without it", exc_info=exc)
        seen = (self.pressure.sample, self.relief.taken)
        if seen != self._pressure_recorded:  # a new sample or step, not every pass
            self._pressure_recorded = seen
            self.metrics.record_pressure(self.pressure, self.relief)

    def _return_device_memory(self) -> None:
        """Hand what the steps freed back to the driver: PyTorch's allocator keeps freed
        blocks for reuse, where neither the monitor nor other programs see them."""
        if self.runtime is not None and self.runtime.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

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
            self._leave(job)
            return
        if self._waits(job):
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

    def _sibling(self, request: GenerationRequest) -> _Active | None:
        """The active generation of another choice of `request`'s (its first), if any."""
        group = request.prompt_group
        if group is None:
            return None
        return next((a for a in self._active if a.job.request.prompt_group is group), None)

    def _waits(self, job: Job) -> bool:
        """Whether `job` waits for the first choice of its request to have fed their prompt:
        then it starts from a copy of that one's caches, and the prompt is prefilled once
        (it was once a choice: 16 choices of a long prompt, 16 prefills)."""
        first = self._sibling(job.request)
        if first is None:
            return False
        prompt, fed = job.request.prompt_ids, first.session.target_tokens
        # (the length first: the prefix is compared once, not at every step of a 32k prompt)
        return len(fed) < len(prompt) - 1 or common_prefix_len(fed, prompt) < len(prompt) - 1

    def _begin(self, job: Job) -> _Active:
        assert self.runtime is not None
        req = job.request
        strategy = self._strategy(req.strategy, req.budget, req.tree_verification)
        pool_key = strategy.name
        # (a choice's first sibling holds the whole prompt: before any idle session, which
        # may share none of it and was taken first, a whole prefill again)
        session = (
            self._fork(req, pool_key)
            or self._idle.take(pool_key, req.prompt_ids)
            or self.runtime.new_session(strategy)
        )
        if self.runtime.device.type == "cpu":
            # A pass costs its compute there: a prefill's passes are kept shorter still
            # while others wait on them (speculative/prefill.py, `chunk_now`).
            session.pass_bound = self._prefill_bound
        gen = Generation(
            strategy,
            session,
            self.runtime.tokenizer,
            req.prompt_ids,
            req.params,
            max_tokens=req.max_tokens,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            trace=req.trace,
            constraint=req.constraint,
            call_lead=req.calls.lead if req.calls is not None else None,
            thinking=req.thinking,
        )
        return _Active(job, gen, gen.steps(), session, pool_key)

    def _fork(self, request: GenerationRequest, pool_key: str) -> Session | None:
        """A copy of the session of a choice of the same request that has fed its prompt
        (`_waits`), None where there is none."""
        first = self._sibling(request)
        if first is None or first.pool_key != pool_key:
            return None
        return first.session.fork()

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
                self._leave(active.job)
        if not self._active:
            return
        if not self.limits.batch_passes:
            active = self._active[0]
            self._active.rotate(-1)
            self._passes.step_alone(active)
            return
        self._active.rotate(-1)  # whoever waited behind the bound goes first next time
        self._passes.step(self._active)

    def _rode(self, riders: list[_Active], tokens: int) -> None:
        """They rode one target pass of `tokens` tokens together: the metrics, and each
        one's batching figures."""
        self.metrics.record_pass(len(riders), tokens)
        for active in riders:
            active.target_passes += 1
            active.pass_generations += len(riders)
            active.shared_passes += int(len(riders) > 1)

    def _out_of_memory(self) -> None:
        """A pass ran out of memory (and was rolled back): the next relief step that frees
        the memory that ran out, before it runs again."""
        gpu = self.runtime is not None and self.runtime.device.type == "cuda"
        self.relief.climb("out of memory in a pass", frozenset({"device" if gpu else "host"}))
        self._return_device_memory()

    def _advance(self, active: _Active) -> None:
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

    def _take(self, active: _Active, chunk: Chunk) -> bool:
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

    def _fail(self, active: _Active, exc: BaseException) -> None:
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

    def _finish(self, active: _Active) -> None:
        if active in self._active:
            self._active.remove(active)
        active.steps.close()
        gen = active.generation
        stats: GenerationStats = gen.stats
        assert self.runtime is not None
        passes = active.target_passes
        stats.extra["batch_size"] = active.pass_generations / passes if passes else None
        stats.extra["shared_passes"] = active.shared_passes
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
            self._leave(job)

    def _leave(self, job: Job) -> None:
        """A job no longer counts against admission (finished, failed or cancelled)."""
        with self._admission:
            self._in_flight.discard(job)

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
