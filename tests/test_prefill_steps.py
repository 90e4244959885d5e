"""A long prompt is prefilled one chunk per step: every strategy yields an empty round after
each chunk (the draft's catch-up included), `Generation` passes it on as an empty chunk,
and the engine serves other generations in between and drops a cancelled job before its
next chunk. Outputs do not depend on the chunk size, and no target pass carries more than
the planned largest pass, max(chunk, budget + 1)."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from daemon.engine import Engine, EngineLimits
from daemon.jobs import Finished, GenerationRequest, Job
from daemon.metrics import Metrics
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.checkpoints.checkpoint import load
from modeling.decoder import Transformer
from modeling.kv_cache import KVCache
from modeling.protocol import Segment
from speculative.drafting import ModelDrafter
from speculative.generation import Chunk, Generation
from speculative.ngram import NgramDrafter
from speculative.prefix_cache import PrefixCache
from speculative.rounds import Strategy
from speculative.sampling import SamplingParams
from speculative.session import Session
from speculative.strategies.autoregressive import Autoregressive
from speculative.strategies.linear import Linear
from speculative.strategies.tree import TreeSpeculation

GREEDY = SamplingParams(temperature=0.0)
CHUNK = 4
BUDGET = 6  # > CHUNK - 1: the tree's pass has no room for pending tokens at CHUNK
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the"
    " park with her friends. One day, she saw a big red ball under a tree."
)


class Passes:
    """Wraps a model's batched forward: records the token count and cache of every
    sequence's segment (one per pass when a generation runs alone) and the segments of
    each pass; `on_pass(n)` runs at the start of the n-th pass (on the caller's thread)."""

    def __init__(self, model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        self.caches: list[KVCache] = []
        self.passes: list[int] = []  # segments per pass
        self.on_pass: Callable[[int], None] | None = None
        real = model.forward_batch

        def forward_batch(segments: list[Segment]) -> list[torch.Tensor]:
            self.passes.append(len(segments))
            for seg in segments:
                self.sizes.append(seg.length)
                self.caches.append(seg.cache)
            if self.on_pass is not None:
                self.on_pass(len(self.passes))
            return real(segments)

        monkeypatch.setattr(model, "forward_batch", forward_batch)

    def beside(self, long: Session, short: Session) -> list[tuple[int, bool]]:
        """Each pass's (tokens of `long`'s target cache in it, whether `short` rode it)."""
        out, at = [], 0
        for count in self.passes:
            caches = self.caches[at : at + count]
            mine = [n for n, c in zip(self.sizes[at : at + count], caches, strict=True)
                    if c is long.target_cache]  # fmt: skip
            out.append((mine[0] if mine else 0, any(c is short.target_cache for c in caches)))
            at += count
        return out

    def of(self, session: Session) -> list[int]:
        """Sizes of the passes that wrote this session's target or draft cache."""
        mine = (session.target_cache, session.draft_cache)
        return [
            n for n, c in zip(self.sizes, self.caches, strict=True) if any(c is m for m in mine)
        ]


@pytest.fixture(scope="module")
def stories(stories_target: Path, stories_draft: Path):  # type: ignore[no-untyped-def]
    target, tok, _ = load(stories_target)
    draft, _, _ = load(stories_draft)
    return target, draft, tok


def build(name: str, target: Transformer, draft: Transformer, chunk: int, **kw) -> Strategy:  # type: ignore[no-untyped-def]
    no_cache = PrefixCache(0)  # each test's generations stay independent of the others'
    if name == "autoregressive":
        return Autoregressive(target, prefill_chunk=chunk)
    if name == "linear":
        return Linear(target, ModelDrafter(draft), prefill_chunk=chunk)
    if name == "linear-ngram":
        return Linear(target, NgramDrafter(target.config.vocab_size), prefill_chunk=chunk)
    if name == "tree":
        budget = kw.get("budget", BUDGET)
        return TreeSpeculation(target, draft, budget, prefix_cache=no_cache, prefill_chunk=chunk)
    assert name == "tree-ngram"
    return TreeSpeculation(target, None, BUDGET, prefix_cache=no_cache, prefill_chunk=chunk)


STRATEGIES = ["autoregressive", "linear", "linear-ngram", "tree", "tree-ngram"]


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_long_prompt_yields_between_chunks_and_the_output_is_unchanged(
    stories, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft, tok = stories
    prompt = tok.encode(STORY)
    reference = build(name, target, draft, chunk=2048)  # the whole prompt fits one chunk
    expected = Generation(
        reference, reference.new_session(256), tok, prompt, GREEDY, 12, ignore_eos=True
    ).run()

    strategy = build(name, target, draft, CHUNK)
    target_passes, draft_passes = Passes(target, monkeypatch), Passes(draft, monkeypatch)
    gen = Generation(strategy, strategy.new_session(256), tok, prompt, GREEDY, 12, ignore_eos=True)
    per_step: list[tuple[Chunk, int, int]] = []  # chunk, target and draft passes it took
    target_sizes, draft_sizes = [], []
    for chunk in gen:
        per_step.append((chunk, len(target_passes.sizes), len(draft_passes.sizes)))
        target_sizes += target_passes.sizes
        draft_sizes += draft_passes.sizes
        target_passes.sizes.clear()
        draft_passes.sizes.clear()

    assert gen.token_ids == expected.token_ids and gen.text == expected.text
    # Folding (no room at BUDGET > CHUNK - 1): every prompt token but the root in chunks.
    prefill_steps = math.ceil((len(prompt) - 1) / CHUNK)
    assert gen.stats.prefill_passes == prefill_steps
    empty = [c for c, _, _ in per_step if not (c.text or c.token_ids or c.finish_reason)]
    assert len(empty) == prefill_steps > 5
    assert [c for c, _, _ in per_step[:prefill_steps]] == empty  # all before the first token
    for _, t, d in per_step[:prefill_steps]:
        assert t == 1 and d <= 1  # one chunk per model per step
    assert gen.stats.rounds == len(per_step) - prefill_steps  # prefill steps are no rounds
    # A verification pass holds the root and the drafted tokens: K = 4 for linear.
    largest = {"autoregressive": CHUNK, "linear": 5, "linear-ngram": 5}.get(name, BUDGET + 1)
    assert max(target_sizes) <= largest and max(draft_sizes, default=0) <= largest
    assert gen.stats.first_token_seconds is not None
    assert gen.stats.first_token_seconds >= gen.stats.prefill_seconds > 0


@pytest.mark.parametrize(("chunk", "budget"), [(8, 3), (CHUNK, BUDGET), (16, 2), (3, 0)])
def test_a_tree_pass_never_exceeds_the_planned_largest_pass(
    stories, chunk: int, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pending prompt tokens are folded into the tree pass only as far as they fit:
    pending + nodes <= max(chunk, budget + 1); they used to ride in whole (up to a chunk)."""
    target, draft, tok = stories
    prompt = tok.encode(STORY)
    largest = max(chunk, budget + 1)
    strategy = build("tree", target, draft, chunk, budget=budget)
    passes = Passes(target, monkeypatch)
    gen = Generation(strategy, strategy.new_session(256), tok, prompt, GREEDY, 30, ignore_eos=True)
    gen.run()
    assert max(passes.sizes) <= largest
    fold = largest - (budget + 1)
    # Plain chunks up to the fold, then the tree pass that carries the fold, counted as the
    # prefill pass plain decoding would have spent there: as many as plain decoding's.
    plain = math.ceil((len(prompt) - 1 - fold) / chunk)
    assert gen.stats.prefill_passes == math.ceil((len(prompt) - 1) / chunk) in (plain, plain + 1)
    reference = Autoregressive(target)
    expected = Generation(reference, reference.new_session(256), tok, prompt, GREEDY, 30)
    assert gen.token_ids == expected.run().token_ids


def test_a_walk_through_the_prefix_cache_is_caught_up_in_chunks(
    stories, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repeated prompt walks through cached distributions with no target pass; the walked
    tokens and the prompt are then fed in chunks, not folded whole into the next tree."""
    target, draft, tok = stories
    prompt = tok.encode(STORY)
    strategy = TreeSpeculation(target, draft, BUDGET, prefill_chunk=CHUNK)
    Generation(strategy, strategy.new_session(256), tok, prompt, GREEDY, 20, ignore_eos=True).run()
    passes = Passes(target, monkeypatch)
    again = Generation(
        strategy, strategy.new_session(256), tok, prompt, GREEDY, 30, ignore_eos=True
    )
    chunks = list(again)
    assert chunks[0].token_ids  # the walk's tokens go out with the first prefill step
    assert max(passes.sizes) <= max(CHUNK, BUDGET + 1)
    reference = Autoregressive(target)
    expected = Generation(reference, reference.new_session(256), tok, prompt, GREEDY, 30)
    assert again.token_ids == expected.run().token_ids


# ---- the engine: interleaving and cancellation ----


@pytest.fixture(scope="module")
def plain_runtime(stories_target: Path) -> Runtime:
    return Runtime(RuntimeOptions(model=str(stories_target), device="cpu", sequences=12))


@pytest.fixture(scope="module")
def tree_runtime(stories_target: Path, stories_draft: Path) -> Runtime:
    return Runtime(
        RuntimeOptions(
            model=str(stories_target), draft=str(stories_draft), device="cpu", sequences=12
        )
    )


def small_chunk_engine(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, sessions: list[Session], chunk: int = CHUNK
) -> Engine:
    """An engine whose strategies prefill `chunk` tokens per step; `sessions` collects the
    sessions it creates, in admission order."""
    build_strategy, new_session = runtime.strategy, runtime.new_session

    def strategy(name: str | None = None, budget: int | None = None) -> Strategy:
        built = build_strategy(name, budget)
        built.prefill_chunk = chunk
        return built

    def session(strategy: Strategy) -> Session:
        sessions.append(new_session(strategy))
        return sessions[-1]

    monkeypatch.setattr(runtime, "strategy", strategy)
    monkeypatch.setattr(runtime, "new_session", session)
    engine = Engine(
        runtime.options,
        EngineLimits(stream_interval=0.0),
        Metrics(),
        runtime_factory=lambda _: runtime,
    )
    engine.start()
    assert engine.loaded.wait(30)
    return engine


def request(runtime: Runtime, text: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=runtime.tokenizer.encode(text),
        params=GREEDY,
        max_tokens=max_tokens,
        ignore_eos=True,
    )


async def events_until_finished(job: Job) -> list:
    events: list = []
    while not events or not isinstance(events[-1], Finished):
        events.append(await asyncio.wait_for(job.events.get(), 60))
    return events


def long_then_short(
    engine: Engine,
    runtime: Runtime,
    passes: Passes,
    long: GenerationRequest,
    short: GenerationRequest,
) -> tuple[list, list]:
    """`long` submitted, and `short` during its first pass (on the worker: both are then
    active); each one's events to the end."""

    async def run() -> tuple[list, list]:
        loop = asyncio.get_running_loop()
        jobs: list[Job] = []

        def submit_short(n: int) -> None:
            if n == 1:
                jobs.append(engine.submit(short, loop))

        passes.on_pass = submit_short
        long_events = await events_until_finished(engine.submit(long, loop))
        return long_events, await events_until_finished(jobs[0])

    return asyncio.run(run())


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.shutdown()


def test_other_generations_share_the_passes_of_a_long_prompts_chunks(
    plain_runtime: Runtime, monkeypatch: pytest.MonkeyPatch, engines: list[Engine]
) -> None:
    runtime = plain_runtime
    sessions: list[Session] = []
    engine = small_chunk_engine(runtime, monkeypatch, sessions)
    engines.append(engine)
    passes = Passes(runtime.target, monkeypatch)
    short_tokens = 5

    long_events, short_events = long_then_short(
        engine, runtime, passes, request(runtime, STORY, 3), request(runtime, "Lily", short_tokens)
    )
    long_session, _ = sessions
    owner = ["long" if c is long_session.target_cache else "short" for c in passes.caches]
    assert "short" in owner and set(owner) == {"long", "short"}
    # Batched passes: from the pass after the short request arrived, every target pass
    # carries both the long prompt's next chunk and the short request's next step (its
    # prefill, then one token a pass) until the short one has finished.
    short_prompt = runtime.tokenizer.encode("Lily")
    short_steps = math.ceil((len(short_prompt) - 1) / CHUNK) + short_tokens
    assert passes.passes[: 1 + short_steps] == [1] + [2] * short_steps
    assert math.ceil((len(runtime.tokenizer.encode(STORY)) - 1) / CHUNK) > short_steps + 1
    long_sizes = passes.of(long_session)
    assert long_sizes[: short_steps + 1] == [CHUNK] * (short_steps + 1)  # all prefill chunks
    # Prefill steps post nothing: every event carries text, tokens or the end.
    for events in (long_events, short_events):
        chunks = [e for e in events if isinstance(e, Chunk)]
        assert all(c.text or c.token_ids or c.finish_reason for c in chunks)
    assert [t for e in short_events if isinstance(e, Chunk) for t in e.token_ids]
    assert long_events[-1].completion_tokens == 3


def test_on_a_cpu_a_prefill_is_cut_short_while_others_wait_on_its_passes(
    plain_runtime: Runtime, monkeypatch: pytest.MonkeyPatch, engines: list[Engine]
) -> None:
    """On a CPU a pass costs its compute: a 2,048-token chunk of SmolLM2-135M on a busy
    2-core machine held another client's first token for 20 s. While another generation
    rides its passes, a prefill's pass carries what its measured rate feeds in
    SHARED_PREFILL's seconds (made 0 here: its fewest tokens), its own chunk again once it
    is alone. The answers are each one's alone."""
    from daemon import engine as engine_module

    least = 32
    monkeypatch.setattr(engine_module, "SHARED_PREFILL", (0.0, least))
    monkeypatch.setattr(engine_module, "ALONE_PREFILL", (0.0, 64))
    runtime, chunk = plain_runtime, 64
    sessions: list[Session] = []
    engine = small_chunk_engine(runtime, monkeypatch, sessions, chunk)
    engines.append(engine)
    passes = Passes(runtime.target, monkeypatch)
    long_text = " ".join([STORY] * 8)  # 433 tokens (the context holds 512)

    long_events, short_events = long_then_short(
        engine, runtime, passes, request(runtime, long_text, 3), request(runtime, "Lily", 4)
    )
    per_pass = passes.beside(*sessions)  # (long prompt's tokens, the short one rode)
    assert per_pass[0] == (chunk, False)  # alone, its own chunk
    # The short one, queued during the first pass, counts as the next pass is cut.
    assert per_pass[1] == (least, True)
    shared_sizes = [n for n, shared in per_pass[1:] if shared and n]
    assert shared_sizes and max(shared_sizes) == least  # cut short while the other rode
    alone_after = [n for n, shared in per_pass if not shared and n][1:]
    assert chunk in alone_after  # its own chunk again, alone
    expected = [
        Generation(s, runtime.new_session(s), runtime.tokenizer, req.prompt_ids, GREEDY,
                   req.max_tokens, ignore_eos=True).run().token_ids
        for s, req in ((runtime.strategy(), request(runtime, long_text, 3)),
                       (runtime.strategy(), request(runtime, "Lily", 4)))
    ]  # fmt: skip
    got = [
        [t for e in events if isinstance(e, Chunk) for t in e.token_ids]
        for events in (long_events, short_events)
    ]
    assert got == expected


@pytest.mark.parametrize("which", ["plain", "tree"])
def test_a_job_cancelled_while_prefilling_stops_within_one_chunk(
    which: str,
    plain_runtime: Runtime,
    tree_runtime: Runtime,
    monkeypatch: pytest.MonkeyPatch,
    engines: list[Engine],
) -> None:
    runtime = plain_runtime if which == "plain" else tree_runtime
    sessions: list[Session] = []
    engine = small_chunk_engine(runtime, monkeypatch, sessions)
    engines.append(engine)
    target_passes = Passes(runtime.target, monkeypatch)
    draft_passes = Passes(runtime.draft, monkeypatch) if runtime.draft is not None else None
    submitted = threading.Event()
    jobs: list[Job] = []

    def cancel_long(n: int) -> None:
        # The client goes away while the first chunk runs (on the worker thread).
        if n == 1:
            assert submitted.wait(30)
            jobs[0].cancel()

    target_passes.on_pass = cancel_long

    async def run() -> list:
        loop = asyncio.get_running_loop()
        jobs.append(engine.submit(request(runtime, STORY, 20), loop))
        submitted.set()
        follow_up = engine.submit(request(runtime, "Lily", 3), loop)
        return await events_until_finished(follow_up)

    follow_up_events = asyncio.run(run())
    long_session = sessions[0]
    prompt_chunks = math.ceil((len(runtime.tokenizer.encode(STORY)) - 1) / CHUNK)
    assert prompt_chunks > 5
    assert target_passes.of(long_session) == [CHUNK]  # the chunk running at cancel, no more
    if draft_passes is not None:
        assert len(draft_passes.of(long_session)) <= 1  # its catch-up chunk in the same step
    assert jobs[0].events.empty()  # nothing was posted for the cancelled job
    assert engine.metrics.cancelled.value == 1
    assert follow_up_events[-1].completion_tokens == 3  # the engine keeps serving


def test_a_bounded_prefill_pass_carries_what_its_measured_rate_feeds_in_time(
    stories: tuple,
) -> None:
    """`chunk_now`: the strategy's chunk where nothing bounds a pass (a GPU); bounded (a
    CPU), what the measured rate feeds in the bound's seconds, at least its fewest tokens
    and at most the chunk."""
    from speculative.prefill import ALONE_PREFILL, SHARED_PREFILL, chunk_now

    target, _, _ = stories
    session = Session(target, 64)
    session.prefill_rate = 1000.0
    assert chunk_now(session, 2048) == 2048  # unbounded
    for bound in (ALONE_PREFILL, SHARED_PREFILL):
        session.pass_bound = lambda b=bound: b  # type: ignore[misc]
        seconds, least = bound
        session.prefill_rate = 1000.0
        assert chunk_now(session, 2048) == max(least, int(1000 * seconds))
        session.prefill_rate = 0.0  # not measured yet
        assert chunk_now(session, 2048) == least
        session.prefill_rate = 1e9
        assert chunk_now(session, 2048) == 2048
        assert chunk_now(session, 4) == 4  # never past the strategy's own


def test_a_trees_fold_follows_the_cut_chunk(
    stories_target: Path,
    stories_draft: Path,
    monkeypatch: pytest.MonkeyPatch,
    engines: list[Engine],
) -> None:
    """A tree folds the prompt's last tokens into its first verification pass, as many as
    keep that pass within a chunk: computed once for the round, the fold stayed the chunk
    a prompt alone had (its verification pass carried 256 prompt tokens with another
    generation riding it). It follows each step's chunk."""
    from daemon import engine as engine_module

    monkeypatch.setattr(engine_module, "SHARED_PREFILL", (0.0, 32))
    monkeypatch.setattr(engine_module, "ALONE_PREFILL", (0.0, 256))
    runtime = Runtime(
        RuntimeOptions(model=str(stories_target), draft=str(stories_draft), device="cpu",
                       sequences=12, budget=8)
    )  # fmt: skip
    sessions: list[Session] = []
    engine = small_chunk_engine(runtime, monkeypatch, sessions, 256)
    engines.append(engine)
    passes = Passes(runtime.target, monkeypatch)

    long_text = " ".join([STORY] * 8)
    long_then_short(
        engine, runtime, passes, request(runtime, long_text, 3), request(runtime, "Lily", 4)
    )
    rode = [n for n, shared in passes.beside(*sessions) if shared and n]
    assert rode and max(rode) <= 32 + 8 + 1  # the shared chunk and the tree


def test_a_trees_folded_prompt_pass_counts_as_prefill_under_a_cpus_bound(
    tree_runtime: Runtime,
) -> None:
    """On a CPU a prefill pass is bounded (256 tokens until its rate is measured): a tree
    that fed a 300-token prompt in one such pass and folded the rest into its first
    verification pass spent as many prompt passes as plain decoding, and that pass counts
    as prefill (it was counted against 2,048-token chunks: one decode pass too many)."""
    prompt = tree_runtime.tokenizer.encode(" ".join([STORY] * 6))[:300]
    counts = {}
    for name in ("autoregressive", "tree"):
        strategy = tree_runtime.strategy(name, 8)
        session = tree_runtime.new_session(strategy)
        gen = Generation(
            strategy, session, tree_runtime.tokenizer, prompt, GREEDY, 8, ignore_eos=True
        )
        counts[name] = gen.run().stats.prefill_passes
    assert counts["tree"] == counts["autoregressive"] == 2, counts
