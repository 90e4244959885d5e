"""The engine's strategy table: per-request tree budgets must not grow it without bound
(each strategy keeps what it learned), and every tree strategy shares the runtime's one
prefix cache."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon.engine import Engine, EngineLimits
from daemon.jobs import Finished, GenerationRequest, QueueFullError
from daemon.metrics import Metrics
from daemon.options import RuntimeOptions
from daemon.pools import REQUEST_BUDGET_STRATEGIES
from daemon.runtime import Runtime
from speculative.sampling import SamplingParams


def _engine(target: Path, draft: Path) -> tuple[Runtime, Engine]:
    """A fresh runtime and an engine over it whose worker thread is not started: tests
    call its methods directly."""
    runtime = Runtime(RuntimeOptions(model=str(target), draft=str(draft), device="cpu"))
    engine = Engine(runtime.options, EngineLimits(), Metrics(), runtime_factory=lambda _: runtime)
    engine.runtime = runtime
    return runtime, engine


def test_per_request_budgets_are_bounded_and_reused(
    stories_target: Path, stories_draft: Path
) -> None:
    runtime, engine = _engine(stories_target, stories_draft)
    default = engine._strategy(None, None)
    first = engine._strategy("tree", 3)
    assert engine._strategy("tree", 3) is first  # built once, then reused
    for budget in range(10, 60):
        strategy = engine._strategy("tree", budget)
        assert strategy.planner.next_shape().budget == budget  # type: ignore[attr-defined]
    held = engine._strategies.held()
    assert len(held) <= 1 + REQUEST_BUDGET_STRATEGIES, len(held)
    assert all(s is not first for s in held)  # the least recently used went first
    assert engine._strategy(None, None) is default  # the configured strategy stays
    caches = {id(s.prefix_cache) for s in [*held, first]}  # type: ignore[attr-defined]
    assert caches == {id(runtime.prefix_cache)}


def test_a_budget_on_a_strategy_without_trees_reuses_the_configured_one(
    stories_target: Path, stories_draft: Path
) -> None:
    _, engine = _engine(stories_target, stories_draft)
    linear = engine._strategy("linear", None)
    assert engine._strategy("linear", 7) is linear and engine._strategy("linear", 9) is linear
    assert len(engine._strategies.held()) == 1


def test_strategies_are_rebuilt_when_compiled_passes_become_ready(
    stories_target: Path, stories_draft: Path
) -> None:
    """What `auto` measured before a model's compiled passes were attached (eager passes,
    slowed by the compiler working beside them) is forgotten: new requests get new
    strategies; active ones keep theirs."""
    runtime, engine = _engine(stories_target, stories_draft)
    compilation = runtime.compile(serving=True)  # "off" for a runtime built directly
    before = engine._strategy("tree", None)
    assert engine._strategy("tree", None) is before
    compilation.ready_count += 1  # what Compilation.warm does when a model is ready
    after = engine._strategy("tree", None)
    assert after is not before and engine._strategy("tree", None) is after


def test_admission_is_exact_while_the_worker_is_busy(
    stories_target: Path, stories_draft: Path
) -> None:
    """Up to max_concurrent + queue_size requests are in flight at every instant, whatever
    the worker has drained so far (here: nothing, it is mid-step); the next is refused
    with QueueFullError (the API's 503 + Retry-After), and a job that leaves frees a slot."""
    runtime = Runtime(RuntimeOptions(model=str(stories_target), draft=str(stories_draft)))
    limits = EngineLimits(max_concurrent=2, queue_size=4)
    engine = Engine(runtime.options, limits, Metrics(), runtime_factory=lambda _: runtime)
    engine.runtime = runtime
    loop = asyncio.new_event_loop()
    try:
        request = GenerationRequest([1, 2, 3], SamplingParams(), 4)
        jobs = [engine.submit(request, loop) for _ in range(6)]
        with pytest.raises(QueueFullError, match="6 generations are already in flight"):
            engine.submit(request, loop)
        engine._end(jobs[0], Finished("stop", 3, 1, {}))
        engine.submit(request, loop)  # its slot is free again
        with pytest.raises(QueueFullError):
            engine.submit(request, loop)
    finally:
        loop.close()
