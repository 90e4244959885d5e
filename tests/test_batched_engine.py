"""The batched engine (one target pass per step for every active generation) on the real
small pair: outputs equal each request run alone, greedy and seeded, whatever ran beside
it; concurrent generations share target passes; an arrival, a cancellation or a fault
touches its own generation only; the metrics count the passes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from daemon.engine import Engine, EngineLimits
from daemon.jobs import Failed, Finished, GenerationRequest, Job
from daemon.metrics import Metrics
from daemon.options import RuntimeOptions
from daemon.runtime import STRATEGY_BUILDERS, Runtime
from modeling.decoder import Transformer
from modeling.kv_cache import KVCache
from modeling.protocol import Segment
from speculative.generation import Chunk, Generation
from speculative.ngram import NgramDrafter
from speculative.prefill import PREFILL_CHUNK
from speculative.prefix_cache import PrefixCache
from speculative.rounds import Round, RoundSteps, Strategy
from speculative.sampling import SamplingParams
from speculative.session import Session
from speculative.strategies.linear import Linear
from speculative.strategies.tree import TreeSpeculation

GREEDY = SamplingParams(temperature=0.0)
BUDGET = 8  # the n-gram tree's node budget
CHUNK = 4  # prefill chunk where a long prompt must take many passes
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the"
    " park with her friends. One day, she saw a big red ball under a tree."
)


@dataclass
class Spec:
    strategy: str
    prompt: str
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


# Every strategy, short and long prompts, stop strings, different lengths.
MIX = [
    Spec("tree", STORY, 24),
    Spec("autoregressive", "Lily", 10),
    Spec("linear", "Tom was sad because", 16, ["."]),
    Spec("tree-ngram", "The dog ran. The dog ran. The dog", 20),
    Spec("linear-ngram", "Once upon a time, there was a big", 14, ignore_eos=True),
    Spec("tree", "One day, Sue went to the park", 18, ["!", "park"]),
    Spec("linear", STORY, 12),
    Spec("autoregressive", "Ben had a toy", 20, ["."]),
]


@pytest.fixture(scope="module")
def runtime(stories_target: Path, stories_draft: Path) -> Runtime:
    # sequences: one KV cache per concurrent generation, or the plan's logit rows would
    # bound the batch. No prefix cache: each run's passes stay its own (the tree strategy
    # would otherwise walk rows another test verified).
    return Runtime(
        RuntimeOptions(
            model=str(stories_target),
            draft=str(stories_draft),
            device="cpu",
            sequences=12,
            prefix_cache=0,
        )
    )


class Faulty:
    """A real strategy whose rounds raise once it has committed `rounds` rounds of tokens."""

    def __init__(self, inner: Strategy, rounds: int = 2) -> None:
        self.inner, self.rounds = inner, rounds
        self.name, self.target = "faulty", inner.target
        self.prefill_chunk, self.pass_rows = inner.prefill_chunk, inner.pass_rows

    def new_session(self, capacity: int) -> Session:
        return self.inner.new_session(capacity)

    def steps(
        self,
        session: Session,
        prompt_ids: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        generator: torch.Generator,
    ) -> RoundSteps:
        done = 0
        for item in self.inner.steps(session, prompt_ids, params, max_new_tokens, generator):
            yield item
            if isinstance(item, Round) and item.tokens:
                done += 1
                if done == self.rounds:
                    raise RuntimeError("the strategy broke after its second round")


def build_strategy(
    runtime: Runtime, name: str, chunk: int = PREFILL_CHUNK, budget: int | None = None
) -> Strategy:
    """A fresh strategy: the runtime's builders (with `budget`, or the configured one),
    plus n-gram variants and a faulty one."""
    target, vocab = runtime.target, runtime.target.config.vocab_size
    strategy: Strategy
    if name == "linear-ngram":
        strategy = Linear(target, NgramDrafter(vocab))
    elif name == "tree-ngram":
        strategy = TreeSpeculation(target, None, BUDGET, prefix_cache=PrefixCache(0))
    elif name == "tree-16":  # a fixed budget: every round grows a tree
        strategy = TreeSpeculation(target, runtime.draft, 16, prefix_cache=PrefixCache(0))
    elif name == "faulty":
        strategy = Faulty(build_strategy(runtime, "linear"))
    else:
        tree_budget = runtime.options.budget if budget is None else budget
        strategy = STRATEGY_BUILDERS[name](runtime, tree_budget, runtime.options.tree_verification)
    strategy.prefill_chunk = chunk
    return strategy


class Passes:
    """Wraps a model's batched forward: the caches of each pass's segments, in order;
    `on_pass(n)` runs on the worker at the start of the n-th pass."""

    def __init__(self, model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.caches: list[list[KVCache]] = []
        self.tokens: list[int] = []  # tokens of each pass, over all its segments
        self.rows: list[int] = []  # logit rows of each pass
        self.on_pass: Callable[[int], None] | None = None
        real = model.forward_batch

        def forward_batch(segments: list[Segment]) -> list[torch.Tensor]:
            self.caches.append([seg.cache for seg in segments])
            self.tokens.append(sum(seg.length for seg in segments))
            self.rows.append(sum(seg.logit_rows for seg in segments))
            if self.on_pass is not None:
                self.on_pass(len(self.caches))
            return real(segments)

        monkeypatch.setattr(model, "forward_batch", forward_batch)

    def carrying(self, cache: KVCache) -> list[int]:
        """Indices of the passes that carried a segment of this cache."""
        return [i for i, caches in enumerate(self.caches) if any(c is cache for c in caches)]


@dataclass
class Outcome:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: dict
    error: BaseException | None = None


def alone(runtime: Runtime, spec: Spec, params: SamplingParams) -> Outcome:
    """The request run on its own, with a freshly built strategy and session."""
    strategy = build_strategy(runtime, spec.strategy)
    gen = Generation(
        strategy,
        strategy.new_session(runtime.context),
        runtime.tokenizer,
        runtime.tokenizer.encode(spec.prompt),
        params,
        spec.max_tokens,
        stop=spec.stop,
        ignore_eos=spec.ignore_eos,
    ).run()
    return Outcome(gen.token_ids, gen.text, gen.finish_reason, gen.stats.to_dict())


def request(runtime: Runtime, spec: Spec, params: SamplingParams) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=runtime.tokenizer.encode(spec.prompt),
        params=params,
        max_tokens=spec.max_tokens,
        stop=spec.stop,
        strategy=spec.strategy,
        ignore_eos=spec.ignore_eos,
    )


async def outcome(job: Job) -> Outcome:
    events = []
    while not events or not isinstance(events[-1], Finished | Failed):
        events.append(await asyncio.wait_for(job.events.get(), 60))
    chunks = [e for e in events if isinstance(e, Chunk)]
    token_ids = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    last = events[-1]
    if isinstance(last, Failed):
        return Outcome(token_ids, text, None, {}, last.error)
    assert chunks[-1].finish_reason == last.finish_reason
    return Outcome(token_ids, text, last.finish_reason, last.stats)


def assert_same(got: Outcome, expected: Outcome) -> None:
    """The same tokens, text and finish reason, and no error."""
    assert got.error is None, got.error
    assert (got.token_ids, got.text, got.finish_reason) == (
        expected.token_ids,
        expected.text,
        expected.finish_reason,
    )


@pytest.fixture
def make_engine(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[Engine, list[Session]]]]:
    """`make_engine(chunk=, batch_passes=, max_pass_tokens=)` → a started engine over the module's
    runtime and the list of sessions it creates, in admission order."""
    started: list[Engine] = []

    def make(
        chunk: int = PREFILL_CHUNK,
        batch_passes: bool = True,
        max_pass_tokens: int | None = None,
        cached_sessions: int = 0,
    ) -> tuple[Engine, list[Session]]:
        sessions: list[Session] = []
        new_session = runtime.new_session

        def session(strategy: Strategy) -> Session:
            sessions.append(new_session(strategy))
            return sessions[-1]

        def strategy(name: str | None = None, budget: int | None = None) -> Strategy:
            return build_strategy(runtime, name or runtime.default_strategy, chunk, budget)

        monkeypatch.setattr(runtime, "strategy", strategy)
        monkeypatch.setattr(runtime, "new_session", session)
        limits = EngineLimits(
            stream_interval=0.0,
            cached_sessions=cached_sessions,
            max_concurrent=10,
            batch_passes=batch_passes,
            max_pass_tokens=max_pass_tokens,
        )
        engine = Engine(runtime.options, limits, Metrics(), runtime_factory=lambda _: runtime)
        engine.start()
        started.append(engine)
        assert engine.loaded.wait(30) and engine.ready
        return engine, sessions

    yield make
    for engine in started:
        engine.shutdown()


async def run_together(
    engine: Engine, passes: Passes, requests: list[GenerationRequest]
) -> tuple[list[Job], list[Outcome]]:
    """Submit the first request, then the others from the worker during its first target
    pass: all are admitted at the next step and run side by side from there."""
    loop = asyncio.get_running_loop()
    jobs = [engine.submit(requests[0], loop)]

    def submit_the_rest(n: int) -> None:
        if n == 1:
            jobs.extend(engine.submit(r, loop) for r in requests[1:])

    passes.on_pass = submit_the_rest
    first = await outcome(jobs[0])  # its first pass (and the submissions) came before
    assert len(jobs) == len(requests)
    return jobs, [first, *[await outcome(job) for job in jobs[1:]]]


SEEDED = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(len(MIX))]


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_concurrent_outputs_equal_each_request_alone(
    n: int,
    sampling: str,
    runtime: Runtime,
    make_engine: Callable,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    specs = MIX[:n]
    params = [GREEDY] * n if sampling == "greedy" else SEEDED[:n]
    expected = [alone(runtime, s, p) for s, p in zip(specs, params, strict=True)]
    engine, _ = make_engine()
    passes = Passes(runtime.target, monkeypatch)
    requests = [request(runtime, s, p) for s, p in zip(specs, params, strict=True)]
    _, got = asyncio.run(run_together(engine, passes, requests))
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)
    if n == 1:
        assert got[0].stats["batch_size"] == 1 and got[0].stats["shared_passes"] == 0
        return
    for g in got:  # each rode in passes that carried others' work
        assert g.stats["batch_size"] > 1 and g.stats["shared_passes"] > 0
    assert max(len(p) for p in passes.caches) == n
    metrics = engine.metrics
    per_pass = metrics.generations_per_pass
    assert per_pass.observations == metrics.passes.value == len(passes.caches)
    assert per_pass.total / per_pass.observations > 1
    assert per_pass.total == sum(len(p) for p in passes.caches)
    rendered = metrics.render()
    assert f"specd_passes_total {len(passes.caches)}" in rendered
    assert "specd_generations_per_pass_count" in rendered
    assert "specd_tokens_per_pass_sum" in rendered


def test_two_tree_generations_take_about_the_passes_of_one(
    runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = [Spec("tree", STORY, 60, ignore_eos=True)] * 2
    expected = alone(runtime, specs[0], GREEDY)
    engine, _ = make_engine()
    passes = Passes(runtime.target, monkeypatch)
    requests = [request(runtime, s, GREEDY) for s in specs]
    _, got = asyncio.run(run_together(engine, passes, requests))
    for g in got:
        assert_same(g, expected)
    own = [g.stats["target_passes"] for g in got]
    assert min(own) >= 6  # enough passes for the count to mean something
    # One pass serves both: the engine ran about the passes of one, not of two.
    assert engine.metrics.passes.value == len(passes.caches)
    assert engine.metrics.passes.value <= 0.6 * sum(own), (engine.metrics.passes.value, own)
    assert all(g.stats["shared_passes"] > 0 for g in got)
    assert engine.metrics.generations_per_pass.total == sum(own)


def test_a_long_prompt_arriving_never_stalls_the_streams(
    runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    streams = [
        Spec("autoregressive", "Lily", 16, ignore_eos=True),
        Spec("linear", "Tom", 16, ignore_eos=True),
        Spec("tree", "Sue", 16, ignore_eos=True),
        Spec("tree-ngram", "Ben", 16, ignore_eos=True),
    ]
    late = Spec("tree", f"{STORY} {STORY}", 4, ignore_eos=True)
    expected = [alone(runtime, s, GREEDY) for s in [*streams, late]]
    engine, sessions = make_engine(chunk=CHUNK)
    passes = Passes(runtime.target, monkeypatch)
    arrival = 3  # the long prompt is submitted during this target pass

    async def run() -> list[Outcome]:
        loop = asyncio.get_running_loop()
        jobs = [engine.submit(request(runtime, streams[0], GREEDY), loop)]

        def submit(n: int) -> None:
            if n == 1:
                jobs.extend(engine.submit(request(runtime, s, GREEDY), loop) for s in streams[1:])
            if n == arrival:
                jobs.append(engine.submit(request(runtime, late, GREEDY), loop))

        passes.on_pass = submit
        first = await outcome(jobs[0])  # it streams past the arrival: all are submitted
        assert len(jobs) == 5
        return [first, *[await outcome(job) for job in jobs[1:]]]

    got = asyncio.run(run())
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)
    *stream_sessions, long_session = sessions
    prefill_chunks = -(-(len(runtime.tokenizer.encode(late.prompt)) - 1) // CHUNK)
    carried = [passes.carrying(s.target_cache) for s in stream_sessions]
    first = passes.carrying(long_session.target_cache)[0]
    assert first == arrival  # admitted at the step after it arrived (passes count from 0)
    for mine in carried:
        assert mine[-1] > first  # still streaming when the long prompt came in
        # From the arrival to its end, the stream rode in every target pass.
        assert [i for i in mine if i >= first] == list(range(first, mine[-1] + 1))
    end = max(mine[-1] for mine in carried)
    # The prompt's chunks went on meanwhile, one per pass, beside the streams.
    assert passes.carrying(long_session.target_cache)[: end - first + 1] == list(
        range(first, end + 1)
    )
    assert prefill_chunks > end - first + 1  # the prefill was still running when they ended


def test_a_cancelled_generation_leaves_the_batch_and_the_others_finish(
    runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = [
        Spec("tree", STORY, 24, ignore_eos=True),
        Spec("linear", "Tom was sad because", 24, ignore_eos=True),
        Spec("autoregressive", "Lily", 20, ignore_eos=True),
    ]
    expected = [alone(runtime, s, GREEDY) for s in specs]
    engine, sessions = make_engine()
    passes = Passes(runtime.target, monkeypatch)
    cancel_at = 5  # target pass during which the client goes away
    posted: list[tuple[bool, object]] = []  # (cancelled by then, event) for the victim
    jobs: list[Job] = []

    async def run() -> list[Outcome]:
        loop = asyncio.get_running_loop()
        jobs.append(engine.submit(request(runtime, specs[0], GREEDY), loop))

        def on_pass(n: int) -> None:
            if n == 1:
                jobs.extend(engine.submit(request(runtime, s, GREEDY), loop) for s in specs[1:])
                post = jobs[1].post

                def record(event: object) -> None:
                    posted.append((jobs[1].cancelled, event))
                    post(event)  # type: ignore[arg-type]

                jobs[1].post = record  # type: ignore[method-assign]
            if n == cancel_at:
                jobs[1].cancel()

        passes.on_pass = on_pass
        first = await outcome(jobs[0])
        return [first, await outcome(jobs[2])]

    got = asyncio.run(run())
    assert_same(got[0], expected[0])
    assert_same(got[1], expected[2])
    assert engine.metrics.cancelled.value == 1
    victim = sessions[1]
    # Its last pass is the one in flight when it was cancelled; it left before the next.
    assert passes.carrying(victim.target_cache)[-1] == cancel_at - 1
    # Nothing was posted once it was cancelled, not even the round of the pass in flight.
    assert posted and not any(cancelled for cancelled, _ in posted), posted
    assert not any(isinstance(e, Finished | Failed) for _, e in posted)
    assert len(passes.caches) > cancel_at + 3  # the others went on for a while
    assert engine.active_count == 0


GOOD = [
    Spec("tree", STORY, 24, ignore_eos=True),
    Spec("autoregressive", "Lily", 20, ignore_eos=True),
]
AFTER = Spec("linear-ngram", "Once upon a time, there was a big", 14)


def run_beside_good_ones(
    runtime: Runtime, engine: Engine, passes: Passes, victim: Spec
) -> tuple[list[Outcome], Outcome]:
    """The victim runs between the two good requests; then one more request, alone."""
    requests = [request(runtime, s, GREEDY) for s in (GOOD[0], victim, GOOD[1])]

    async def run() -> tuple[list[Outcome], Outcome]:
        _, got = await run_together(engine, passes, requests)
        after = engine.submit(request(runtime, AFTER, GREEDY), asyncio.get_running_loop())
        return got, await outcome(after)

    return asyncio.run(run())


def test_a_faulty_strategy_fails_its_own_request_only(
    runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = [alone(runtime, s, GREEDY) for s in [*GOOD, AFTER]]
    engine, _ = make_engine()
    passes = Passes(runtime.target, monkeypatch)
    victim = Spec("faulty", "Tom was sad because", 24, ignore_eos=True)
    (first, broken, second), after = run_beside_good_ones(runtime, engine, passes, victim)
    assert isinstance(broken.error, RuntimeError), broken
    assert "second round" in str(broken.error)
    assert broken.token_ids  # its first two rounds were streamed before it broke
    assert_same(first, expected[0])
    assert_same(second, expected[1])
    assert first.stats["shared_passes"] > 0 and second.stats["shared_passes"] > 0
    assert engine.metrics.failed.value == 1
    assert_same(after, expected[2])  # the engine serves on
    assert engine.active_count == 0


@pytest.mark.parametrize("where", ["before", "head"])
def test_a_fault_in_the_batched_pass_fails_its_own_request_only(
    where: str, runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target pass that raises whenever it carries one generation's segment (from that
    generation's 4th pass on): the batched pass is rerun one generation at a time, the
    culprit fails, the others go on as if nothing happened. "before": it raises before the
    layers touch any cache; "head": in the head, after the layers wrote and committed
    every segment's keys and values (where a GPU runs out of memory for the logits)."""
    expected = [alone(runtime, s, GREEDY) for s in [*GOOD, AFTER]]
    engine, sessions = make_engine()
    passes = Passes(runtime.target, monkeypatch)
    victim = Spec("linear", "Tom was sad because", 24, ignore_eos=True)
    aboard = [0]  # passes that carried the culprit's segment

    def fault(caches: list[KVCache]) -> None:
        if len(sessions) > 1 and any(c is sessions[1].target_cache for c in caches):
            aboard[0] += 1
            if aboard[0] >= 4:
                raise RuntimeError("the pass broke on this generation's segment")

    if where == "before":
        recorded = runtime.target.forward_batch  # Passes' wrapper

        def forward_batch(segments: list[Segment]) -> list[torch.Tensor]:
            fault([seg.cache for seg in segments])
            return recorded(segments)

        monkeypatch.setattr(runtime.target, "forward_batch", forward_batch)
    else:
        real_head = runtime.target._to_vocab_width

        def to_vocab_width(head: torch.Tensor) -> torch.Tensor:
            fault(passes.caches[-1])  # the pass in progress
            return real_head(head)

        monkeypatch.setattr(runtime.target, "_to_vocab_width", to_vocab_width)
    (first, broken, second), after = run_beside_good_ones(runtime, engine, passes, victim)
    assert isinstance(broken.error, RuntimeError), broken
    assert "broke on this generation" in str(broken.error)
    assert aboard[0] == 5  # the batched pass, then the culprit's own
    assert_same(first, expected[0])
    assert_same(second, expected[1])
    # Each cache holds exactly its committed tokens: the rerun appended nothing twice
    # (a duplicated key is one more vote in attention; the tiny model's greedy text
    # happens to survive it, a real model's need not).
    for session in (sessions[0], sessions[2]):
        assert session.target_cache.length == len(session.target_tokens)
    assert engine.metrics.failed.value == 1
    assert_same(after, expected[2])
    assert engine.active_count == 0


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_interleaved_passes_give_the_same_outputs(
    sampling: str, runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = [GREEDY] * len(MIX) if sampling == "greedy" else SEEDED
    expected = [alone(runtime, s, p) for s, p in zip(MIX, params, strict=True)]
    engine, sessions = make_engine(batch_passes=False)
    passes = Passes(runtime.target, monkeypatch)
    requests = [request(runtime, s, p) for s, p in zip(MIX, params, strict=True)]
    _, got = asyncio.run(run_together(engine, passes, requests))
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)
        assert g.stats["batch_size"] == 1 and g.stats["shared_passes"] == 0
    assert {len(p) for p in passes.caches} == {1}  # every pass its own
    mine = passes.carrying(sessions[0].target_cache)
    assert mine != list(range(mine[0], mine[-1] + 1))  # the others' rounds came between
    assert engine.metrics.passes.value == len(passes.caches)
    assert engine.metrics.generations_per_pass.total == len(passes.caches)


@pytest.mark.parametrize("bound", ["tokens", "rows"])
def test_a_pass_stays_within_its_bounds_and_outputs_are_unchanged(
    bound: str, runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that do not fit a pass's tokens wait for the next one (the first in line
    always goes, whatever its size); the trees share the logit rows (`passes.allot`)."""
    limit = 12
    expected = [alone(runtime, s, GREEDY) for s in MIX]
    engine, _ = make_engine(max_pass_tokens=limit if bound == "tokens" else None)
    if bound == "rows":
        engine.max_pass_rows = 3 * limit  # the worker reads it at its next step
    passes = Passes(runtime.target, monkeypatch)
    requests = [request(runtime, s, GREEDY) for s in MIX]
    _, got = asyncio.run(run_together(engine, passes, requests))
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)
    sizes = passes.tokens if bound == "tokens" else passes.rows
    bound_value = limit if bound == "tokens" else 3 * limit
    shared = [n for n, caches in zip(sizes, passes.caches, strict=True) if len(caches) > 1]
    assert shared and max(shared) <= bound_value
    assert max(len(caches) for caches in passes.caches) > 1
    if bound == "tokens":  # some requests waited: fewer in a pass than were active
        assert max(len(caches) for caches in passes.caches) < len(MIX)


def test_mixed_strategies_keep_sharing_every_pass(
    runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trees beside linear chains (k + 1 rows each): the trees' nodes are granted within
    what the other requests leave of the pass's rows, so after the first passes every
    target pass carries every generation still running; nothing is deferred into passes
    of one (a review found trees granted the whole forest beside a waiting chain, and
    passes of one generation from then on)."""
    mix = [
        Spec("tree-16", "Once upon a time, there was a big", 24, ignore_eos=True),
        Spec("tree-16", "One day, Sue went to the park", 24, ignore_eos=True),
        Spec("tree-16", "Tom was sad because", 24, ignore_eos=True),
        Spec("linear", "Ben had a toy", 24, ignore_eos=True),
    ]
    engine, sessions = make_engine()
    engine.max_pass_rows = 20  # a small tree's rows (the worker reads it at each step)
    passes = Passes(runtime.target, monkeypatch)
    requests = [request(runtime, s, GREEDY) for s in mix]
    _, got = asyncio.run(run_together(engine, passes, requests))
    for g, spec in zip(got, mix, strict=True):
        assert_same(g, alone(runtime, spec, GREEDY))
    caches = [s.target_cache for s in sessions]
    last_pass = {id(c): max(passes.carrying(c)) for c in caches}
    short = [
        i
        for i, carried in enumerate(passes.caches)
        if i > 2  # the first pass (the others were submitted during it) and admission
        and len(carried) < sum(1 for c in caches if last_pass[id(c)] >= i)
    ]
    assert short == [], short
    assert max(passes.rows) <= 20


def test_a_failure_outside_any_generation_fails_its_step_and_the_engine_keeps_serving(
    runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the step itself (here the node grant) fails the generations of that step
    with the error and is logged; the worker thread survives and serves the next
    request (a review found the thread died and every request hung)."""
    from speculative import batching

    real = batching.allot
    calls = {"n": 0}

    def broken_once(requests, budget):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in the step")
        return real(requests, budget)

    monkeypatch.setattr(batching, "allot", broken_once)
    engine, _ = make_engine()
    spec = Spec("tree-16", "Once upon a time, there was a big", 8, ignore_eos=True)

    async def run() -> tuple[Outcome, Outcome]:
        loop = asyncio.get_running_loop()
        first = await outcome(engine.submit(request(runtime, spec, GREEDY), loop))
        return first, await outcome(engine.submit(request(runtime, spec, GREEDY), loop))

    failed, served = asyncio.run(run())
    assert isinstance(failed.error, RuntimeError) and "a bug in the step" in str(failed.error)
    assert_same(served, alone(runtime, spec, GREEDY))
    assert engine.ready and engine._thread.is_alive()
    assert engine.metrics.failed.value == 1


@pytest.mark.parametrize("batch_passes", [True, False])
def test_lowered_pass_rows_bound_every_tree(
    runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch, batch_passes: bool
) -> None:
    """Memory pressure's pass_size step lowers the rows a pass may carry: a tree stays
    within them in the batched and the interleaved engine alike, with the same output."""
    spec = Spec("tree-16", "Once upon a time, there was a big", 24, ignore_eos=True)
    engine, _ = make_engine(batch_passes=batch_passes)
    engine.max_pass_rows = 6
    passes = Passes(runtime.target, monkeypatch)
    _, got = asyncio.run(run_together(engine, passes, [request(runtime, spec, GREEDY)]))
    rows = list(passes.rows)  # (before the reference run below adds its own)
    assert rows and max(rows) <= 6, rows
    assert_same(got[0], alone(runtime, spec, GREEDY))


@pytest.mark.parametrize("strategy", ["tree", "tree-ngram", "linear", "autoregressive"])
def test_the_choices_of_one_request_prefill_their_prompt_once(
    strategy: str, runtime: Runtime, make_engine: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`n` choices (one prompt group): the others wait for the first one's prompt, then
    start from a copy of its caches (the model draft's too), so the prompt's tokens go
    through the target once, where each choice prefilled them (16 choices of a long
    prompt: 16 prefills). Each choice is still exactly its seed's answer alone."""
    from dataclasses import replace

    spec = Spec(strategy, STORY, 12)
    seeds = [SamplingParams(temperature=1.0, seed=7 + i) for i in range(3)]
    expected = [alone(runtime, spec, p) for p in seeds]
    engine, sessions = make_engine(chunk=CHUNK, cached_sessions=4)
    group = object()
    requests = [replace(request(runtime, spec, p), prompt_group=group) for p in seeds]
    # Two other conversations first, whose sessions stay idle: a choice took one of those
    # (sharing nothing of the prompt) before its sibling's copy, and prefilled it all.
    others = [request(runtime, Spec(strategy, text, 4), GREEDY) for text in ("Lily", "Tom")]
    loop = asyncio.new_event_loop()

    async def run() -> list[Outcome]:
        running = [engine.submit(other, asyncio.get_running_loop()) for other in others]
        for job in running:  # (side by side: a session each, both idle after)
            await outcome(job)
        jobs = [engine.submit(r, asyncio.get_running_loop()) for r in requests]
        return [await outcome(job) for job in jobs]

    passes = Passes(runtime.target, monkeypatch)
    got = loop.run_until_complete(run())
    loop.close()
    for g, e in zip(got, expected, strict=True):
        assert_same(g, e)
    prompt = len(runtime.tokenizer.encode(STORY))
    cached = [g.stats["cached_prompt_tokens"] for g in got]
    assert cached[1:] == [prompt - 1, prompt - 1], cached
    assert len(sessions) == 2  # (the two others'; the choices' are an idle one and copies)
    # Every pass after the first choice's prompt carries the three choices side by side.
    assert max(len(p) for p in passes.caches) == 3


def test_choices_waiting_for_their_first_count_as_queued(runtime: Runtime) -> None:
    """/health's `queued` and the queue-depth metric count the choices that wait for their
    first one's prompt (they showed as neither active nor queued). (An engine not started:
    no worker takes the list meanwhile.)"""
    engine = Engine(runtime.options, EngineLimits(), Metrics(), runtime_factory=lambda _: runtime)
    assert engine.queued == 0
    waiting = Job(None, None)  # type: ignore[arg-type]  # (a choice waiting)
    engine._waiting.append(waiting)
    assert engine.queued == 1
    waiting.cancel()  # (its client left: it holds no place)
    assert engine.queued == 0
