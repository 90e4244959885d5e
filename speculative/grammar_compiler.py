"""Grammars compiled where they cannot take the process down, within a time limit, in a
fair order.

A request's grammar is compiled into its `Constraint` (speculative/grammar.py) by
llguidance, native code that recurses once per level of the grammar and whose time grows
with the schema's members. The schema is measured first (speculative/schema_limits.py),
so no request reaches the engine with more than `limits.schema_max_depth` levels; and the
compile itself runs here, on threads made with a stack of `STACK_BYTES` (32 times a
thread's usual 8 MiB), never on the thread of the caller. A level takes about 3 KiB of
the engine's stack (2,500 overflowed 8 MiB): the limits let through a few hundred KiB,
and even past them a 1 MiB body holds at most about 30,000 `$ref` hops, some 100 MiB
(tests/test_hostile_schemas.py compiles 20,000 here).

Each compile must finish within `limits.grammar_compile_seconds` of starting (the
engine's view of the model's vocabulary, made once per model, is not counted); one that
runs longer is answered with a 400 at once. Native code cannot be stopped midway, so
its thread finishes the compile in the background and drops the result (the schema
limits and the engine's own fuel limits bound how long that is). A compile whose caller has gone before
it started is skipped. Waiting compiles are taken in turn per client (round robin over
the clients' addresses, then over the users each names, first come first served within
one), so one client's many schemas, under as many user names as it likes, delay
another's by at most one compile each. A compile that has not started
within `limits.grammar_compile_seconds` of being asked for (the thread is still busy with
one past its limit) is refused as load (`CompilerBusy`, a 503), so no request holds its
place in the house longer than two compiles' time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from speculative.grammar import Constraint, Grammar, GrammarError, vocabulary

STACK_BYTES = 256 << 20
# How often a waiting caller looks at the clock and at its client.
POLL_SECONDS = 0.05


@dataclass
class CompileJob:
    """One grammar to compile against `tokenizer` (logit rows `width`): its result, and
    when its compile started (None: waiting, or the vocabulary still being read)."""

    grammar: Grammar
    tokenizer: Any
    width: int
    future: Future[Constraint] = field(default_factory=Future)
    started: float | None = None
    submitted: float = field(default_factory=time.monotonic)

    def overdue(self, seconds: float) -> bool:
        return self.started is not None and time.monotonic() - self.started > seconds

    def cancel(self) -> None:
        """Skip it if it has not started; otherwise its result is dropped."""
        self.future.cancel()


class _Turns:
    """Items taken round robin over their keys, first in first out within one."""

    def __init__(self) -> None:
        self.by_key: dict[str, deque[Any]] = {}
        self.turns: deque[str] = deque()

    def put(self, key: str, item: Any) -> None:
        if key not in self.by_key:
            self.by_key[key] = deque()
            self.turns.append(key)
        self.by_key[key].append(item)

    def take(self) -> Any:
        """The next key's oldest item (there is one: `bool(self)`)."""
        key = self.turns.popleft()
        items = self.by_key[key]
        item = items.popleft()
        if items:
            self.turns.append(key)
        else:
            del self.by_key[key]
        return item

    def __bool__(self) -> bool:
        return bool(self.turns)


class _FairQueue:
    """Jobs waiting, taken round robin over their clients (a connection's address), and
    within a client round robin over the users it names (OpenAI's `user` field): a client
    that names a new user with every request still has one turn in each round (users were
    clients of their own, and eight of them held every other client's compile past its
    time)."""

    def __init__(self) -> None:
        self._users: dict[str, _Turns] = {}  # per client with jobs waiting: its users'
        self._turns: deque[str] = deque()  # those clients, in turn
        self._ready = threading.Condition()
        self._closed = False

    def put(self, client: str, user: str, job: CompileJob) -> None:
        with self._ready:
            users = self._users.get(client)
            if users is None:
                users = self._users[client] = _Turns()
                self._turns.append(client)
            users.put(user, job)
            self._ready.notify()

    def get(self) -> CompileJob | None:
        """The next client's next user's oldest job; None once closed."""
        with self._ready:
            while not self._turns and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            client = self._turns.popleft()
            users = self._users[client]
            job: CompileJob = users.take()
            if users:
                self._turns.append(client)
            else:
                del self._users[client]
            return job

    def _jobs(self) -> list[CompileJob]:
        return [job for users in self._users.values() for jobs in users.by_key.values()
                for job in jobs]  # fmt: skip

    def close(self) -> None:
        with self._ready:
            self._closed = True
            for job in self._jobs():
                job.cancel()
            self._users.clear()
            self._turns.clear()
            self._ready.notify_all()

    def __len__(self) -> int:
        with self._ready:
            return len(self._jobs())


# threading.stack_size is process-wide for threads started after it: set, start, restore.
_STACK_LOCK = threading.Lock()


class GrammarCompiler:
    """Compiles grammars into Constraints on `threads` threads of its own (started at
    once, each with a stack of STACK_BYTES). `seconds`: limits.grammar_compile_seconds."""

    def __init__(self, seconds: float, threads: int = 1) -> None:
        self.seconds = seconds
        self._queue = _FairQueue()
        self._threads = []
        self.started = 0  # compiles begun (a skipped one never begins)
        self._running = 0
        self._count = threading.Lock()
        with _STACK_LOCK:
            previous = threading.stack_size(STACK_BYTES)
            try:
                for i in range(threads):
                    thread = threading.Thread(
                        target=self._work, name=f"specd-grammar-{i}", daemon=True
                    )
                    thread.start()
                    self._threads.append(thread)
            finally:
                threading.stack_size(previous)

    def submit(
        self, grammar: Grammar, tokenizer: Any, width: int, client: str = "", user: str = ""
    ) -> CompileJob:
        """Queue the compile of `grammar` against `tokenizer` (logit rows `width`), in the
        turn of `client` (its address) and `user` (the user it names)."""
        job = CompileJob(grammar, tokenizer, width)
        self._queue.put(client, user, job)
        return job

    def constraint(self, grammar: Grammar, tokenizer: Any, width: int) -> Constraint:
        """The grammar's Constraint, waiting for it here (the command line's door, and
        tests); raises GrammarError as the compile does, or for its time limit."""
        job = self.submit(grammar, tokenizer, width)
        while True:
            try:
                return job.future.result(timeout=POLL_SECONDS)
            except TimeoutError:
                self.check(job)

    def check(self, job: CompileJob) -> None:
        """Between two looks at a job: raise (and cancel the job) if it is past its time,
        waiting (`CompilerBusy`) or compiling (GrammarError)."""
        if job.future.done():
            return
        if not job.future.running() and time.monotonic() - job.submitted > self.seconds:
            # Still waiting after a whole compile's time: what is ahead of it (a compile
            # past its limit, finishing in the background) is not this request's doing.
            job.cancel()
            raise CompilerBusy(
                "the grammar compiler is busy with earlier grammars (each may take up to "
                f"limits.grammar_compile_seconds, {self.seconds:g} s); retry shortly"
            )
        if job.overdue(self.seconds):
            job.cancel()
            field = job.grammar.field
            raise GrammarError(
                f"{field} took longer than limits.grammar_compile_seconds "
                f"({self.seconds:g} s) to compile: simplify the schema",
                field,
                "grammar_too_slow",
            )

    @property
    def busy(self) -> bool:
        """A compile is running or waiting (one abandoned midway still runs)."""
        return self._running > 0 or len(self._queue) > 0

    def close(self) -> None:
        """Cancel what waits; the threads end after the compile they are in."""
        self._queue.close()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue  # its caller went away while it waited
            with self._count:
                self.started += 1
                self._running += 1
            try:
                # The engine's view of the vocabulary, made once per model (seconds at a
                # 128k vocabulary): not the request's doing, so not on its clock.
                vocabulary(job.tokenizer, job.grammar.field)
                job.started = time.monotonic()
                result = Constraint(job.grammar, job.tokenizer, job.width)
            except BaseException as exc:  # handed to the caller, who reports it
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
            finally:
                with self._count:
                    self._running -= 1


class CompilerBusy(Exception):
    """A grammar waited a whole compile's time without starting: load, not the request's
    fault (the HTTP layer answers 503 with Retry-After)."""
