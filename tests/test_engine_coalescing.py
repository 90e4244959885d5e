"""The engine coalesces the text of rounds that finish within `stream_interval` into one
event for the event loop (the loop's work per event holds the GIL the decoder needs). The
first token and the end are never held back, and the text is the same either way."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon.engine import Engine, EngineLimits
from daemon.jobs import Failed, Finished, GenerationRequest
from daemon.metrics import Metrics
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from speculative.generation import Chunk
from speculative.sampling import SamplingParams


@pytest.fixture(scope="module")
def runtime(stories_target: Path) -> Runtime:
    return Runtime(RuntimeOptions(model=str(stories_target), device="cpu"))


def events_for(runtime: Runtime, interval: float, max_tokens: int = 40) -> list:
    engine = Engine(
        runtime.options,
        EngineLimits(stream_interval=interval),
        Metrics(),
        runtime_factory=lambda _: runtime,
    )
    engine.start()
    assert engine.loaded.wait(30)

    async def collect() -> list:
        request = GenerationRequest(
            prompt_ids=runtime.tokenizer.encode("Once upon a time"),
            params=SamplingParams(temperature=0.0),
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        job = engine.submit(request, asyncio.get_running_loop())
        events = []
        while not events or not isinstance(events[-1], Finished):
            events.append(await asyncio.wait_for(job.events.get(), 30))
        return events

    try:
        return asyncio.run(collect())
    finally:
        engine.shutdown()


def test_a_long_interval_sends_the_first_token_then_the_rest_at_the_end(runtime: Runtime):
    events = events_for(runtime, interval=3600.0)
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert len(chunks) == 2  # the first token at once; everything else with the finish
    assert len(chunks[0].token_ids) == 1 and chunks[1].finish_reason == "length"
    per_round = [e for e in events_for(runtime, interval=0.0) if isinstance(e, Chunk)]
    assert len(per_round) == 40  # autoregressive: one round, one event per token
    assert "".join(c.text for c in chunks) == "".join(c.text for c in per_round)
    assert [t for c in chunks for t in c.token_ids] == [t for c in per_round for t in c.token_ids]


def test_a_failure_while_finishing_fails_that_job_and_the_engine_keeps_serving(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
):
    """A fault in the bookkeeping after a generation (metrics, streamer figures) must not
    kill the worker thread, or every later request would wait forever."""
    engine = Engine(runtime.options, EngineLimits(), Metrics(), runtime_factory=lambda _: runtime)
    engine.start()
    assert engine.loaded.wait(30)
    calls = {"n": 0}
    real = runtime.offload_stats

    def flaky() -> dict:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("streamer figures unavailable")
        return real()

    monkeypatch.setattr(runtime, "offload_stats", flaky)

    async def one() -> list:
        request = GenerationRequest(
            prompt_ids=runtime.tokenizer.encode("Once upon a time"),
            params=SamplingParams(temperature=0.0),
            max_tokens=5,
        )
        job = engine.submit(request, asyncio.get_running_loop())
        events = []
        while not events or not isinstance(events[-1], Finished | Failed):
            events.append(await asyncio.wait_for(job.events.get(), 30))
        return events

    try:
        first, second = asyncio.run(one()), asyncio.run(one())
    finally:
        engine.shutdown()
    assert isinstance(first[-1], Failed) and "streamer figures" in str(first[-1].error)
    assert isinstance(second[-1], Finished) and second[-1].completion_tokens == 5
