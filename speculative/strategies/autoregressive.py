"""Plain decoding: one target pass per token. The reference every speculative strategy
must reproduce exactly."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from modeling.protocol import Model
from speculative.grammar import MAX_FORCED, Constraint
from speculative.grammar_masks import forced_logprobs, masked
from speculative.passes import feed_pass
from speculative.prefill import PREFILL_CHUNK, prefill
from speculative.rounds import Round, RoundStats, RoundSteps
from speculative.sampling import (
    PenaltyContext,
    PositionNoise,
    SamplingParams,
    draw,
    token_logprob,
)
from speculative.session import Session


class Autoregressive:
    name = "autoregressive"
    pass_rows = 1  # the one token's

    def __init__(self, target: Model, prefill_chunk: int = PREFILL_CHUNK) -> None:
        self.target = target
        self.prefill_chunk = prefill_chunk

    def new_session(self, capacity: int) -> Session:
        return Session(self.target, capacity)

    def steps(
        self,
        session: Session,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        generator: torch.Generator,
        constraint: Constraint | None = None,
    ) -> RoundSteps:
        """One token per pass; under a grammar, the tokens it allows alone are emitted
        without a pass and ride in the next one."""
        target, cache = self.target, session.target_cache
        yield from prefill(session, prompt_ids, target, chunk=self.prefill_chunk)
        stats = RoundStats()
        penalties = (
            PenaltyContext(target.vocab_width, prompt_ids, target.device)
            if params.has_penalties
            else None
        )
        noise = PositionNoise(generator, target.vocab_width)
        sequence = list(prompt_ids)  # the cache holds all but the last (the root)
        emitted = 0
        while emitted < max_new_tokens:
            if constraint is not None:
                forced = constraint.take_forced(min(MAX_FORCED, max_new_tokens - emitted))
                if forced:
                    sequence += forced
                    emitted += len(forced)
                    if penalties is not None:
                        penalties.append(forced)
                    stats.forced_tokens += len(forced)
                    yield Round(forced, stats, logprobs=forced_logprobs(forced, params) or None)
                    stats = RoundStats()
                    if constraint.ends(forced) or emitted >= max_new_tokens:
                        return
            todo = sequence[len(session.target_tokens) :]  # the root, and forced tokens
            if cache.free < len(todo):
                return
            t0 = time.perf_counter()
            pos = len(session.target_tokens) + len(todo) - 1  # the root's
            done = yield from feed_pass(target, cache, session.target_tokens, todo)
            logits = done.logits  # (1, V) the root's
            words = constraint.words() if constraint is not None else None
            row = masked(logits, words) if words is not None else logits
            token = int(draw(row, params, penalties, noise, positions=[pos + 1])[0])
            logprobs = (
                [token_logprob(row[0], token, params.logprobs)]
                if params.logprobs is not None
                else None
            )
            del done, logits, row  # a view of the whole pass's logits: gone before the next
            if penalties is not None:
                penalties.append([token])
            if constraint is not None:
                constraint.commit([token])
            stats.target_passes += 1
            stats.verify_seconds += time.perf_counter() - t0
            sequence.append(token)
            emitted += 1
            yield Round([token], stats, logprobs=logprobs)
            stats = RoundStats()
