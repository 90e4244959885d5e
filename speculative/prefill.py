"""Prefill: bringing a session's caches up to a prompt, a chunk per model per step.

A strategy's first rounds are prefill steps (`prefill`), so that a long prompt on a streamed
target is fed a chunk at a time and the engine serves other generations in between.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from modeling.kv_cache import KVCache
from modeling.protocol import Model
from speculative.passes import Steps, feed_pass, run_alone
from speculative.rounds import Round, RoundStats, RoundSteps
from speculative.session import Session

PREFILL_CHUNK = 2048  # prompt tokens per prefill pass: bounds activation memory
# How long a prefill pass may take, where the driver bounds it by time (a CPU: there a pass
# costs its compute), and the fewest tokens it then carries: alone, about a second (on a
# 2-core CPU SmolLM2-135M prefills 225 tokens a second in 256-token passes against 133 in
# 2,048-token ones, and a request that arrives waits for the pass under way); while other
# generations ride its passes, a quarter of one.
ALONE_PREFILL = (1.0, 256)
SHARED_PREFILL = (0.25, 32)


def chunk_now(session: Session, chunk: int) -> int:
    """The prompt tokens this session's next prefill pass may carry: `chunk`, or where the
    driver bounds its passes by time (`Session.pass_bound`), what its measured rate feeds
    in that time, at least the bound's fewest and at most `chunk` (a 2,048-token chunk of
    SmolLM2-135M on a busy 2-core CPU held another client's first token 20 s)."""
    bound = session.pass_bound()
    if bound is None:
        return chunk
    seconds, least = bound
    return max(1, min(chunk, max(least, int(session.prefill_rate * seconds))))


def feed_steps(
    model: Model,
    cache: KVCache,
    fed: list[int],
    tokens: Sequence[int],
    chunk: int = PREFILL_CHUNK,
) -> Steps[int]:
    """Feed `tokens` after what the cache holds (positions continue from `len(fed)`), in
    chunks, one requested pass each; returns the number of passes. Logits are not needed,
    so only the last row's head is computed."""
    passes = 0
    for i in range(0, len(tokens), chunk):
        yield from feed_pass(model, cache, fed, tokens[i : i + chunk])
        passes += 1
    return passes


def feed(
    model: Model,
    cache: KVCache,
    fed: list[int],
    tokens: Sequence[int],
    chunk: int = PREFILL_CHUNK,
) -> int:
    """`feed_steps` run alone: one pass per chunk, now."""
    return run_alone(feed_steps(model, cache, fed, tokens, chunk))


def prefill(
    session: Session,
    sequence: Sequence[int],
    target: Model,
    draft: Model | None = None,
    *,
    fold: int = 0,
    fold_reserve: int | None = None,
    chunk: int = PREFILL_CHUNK,
) -> RoundSteps:
    """Bring the caches up to the committed `sequence` x_1..x_L (reusing what they hold),
    ONE chunk per model per step, yielding a Round with no tokens after each step. A
    streamed 70B spends seconds on a chunk: fed in one go, a long prompt froze every
    other generation and could not be cancelled; between steps the engine serves the
    others and drops a cancelled job.

    The target stops `fold` tokens short of x_{L-1}: the caller's next pass carries them
    with the root (and a tree's nodes), which saves a streamed pass. With `fold_reserve`
    (the tokens that pass carries besides them), at most as many as keep it within this
    step's chunk, and `fold` at most: the fold follows the chunk as it shrinks. Each pass carries
    `chunk_now` tokens: `chunk`, or fewer where the driver bounds a pass's time (a CPU). The draft stops
    that many less one short: its first drafting pass takes them with the root, so no
    draft pass exceeds a chunk either. A step runs both models' chunks: the draft is
    resident and small, so its chunk costs a fraction of a streamed target chunk, and
    pairing them keeps the steps as few as the target's chunks (the draft alone only
    when the target already holds the prompt). `draft` None leaves the draft cache as it
    is (no draft model, or the caller will not draft yet)."""
    if chunk < 1:
        raise ValueError(f"a prefill chunk holds at least one token, got {chunk}")
    draft_cache = session.draft_cache if draft is not None else None
    while True:
        stats = RoundStats()
        t0 = time.perf_counter()
        step = chunk_now(session, chunk)
        folded = fold if fold_reserve is None else min(fold, max(step - fold_reserve, 0))
        end = max(len(sequence) - 1 - folded, 0)
        done = len(session.target_tokens)
        todo = list(sequence[done : min(end, done + step)])
        if todo:
            n = yield from feed_steps(
                target, session.target_cache, session.target_tokens, todo, step
            )
            stats.prefill_passes = stats.target_passes = n
            stats.prefill_seconds = time.perf_counter() - t0
            # (a pass shared with others took their work's time too: a rate measured
            # there is low, so only a higher one is taken)
            rate = len(todo) / max(stats.prefill_seconds, 1e-6)
            session.prefill_rate = max(session.prefill_rate, rate)
        draft_todo: list[int] = []
        if draft is not None and draft_cache is not None:
            t1 = time.perf_counter()
            draft_end = max(len(sequence) - step, 0)
            fed_draft = len(session.draft_tokens)
            draft_todo = list(sequence[fed_draft : min(draft_end, fed_draft + step)])
            if draft_todo:
                fed = session.draft_tokens
                stats.draft_passes = yield from feed_steps(
                    draft, draft_cache, fed, draft_todo, step
                )
                stats.draft_seconds = time.perf_counter() - t1
        if not todo and not draft_todo:
            return
        yield Round([], stats)
