"""Plain decoding: one target pass per token. The reference every speculative strategy
must reproduce exactly."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from speculative.generation import (
    PREFILL_CHUNK,
    Round,
    RoundStats,
    RoundSteps,
    Session,
    prefill,
)
from speculative.model import Transformer
from speculative.passes import forward
from speculative.sampling import (
    PenaltyContext,
    PositionNoise,
    SamplingParams,
    draw,
    token_logprob,
)


class Autoregressive:
    name = "autoregressive"
    pass_rows = 1  # the one token's

    def __init__(self, target: Transformer, prefill_chunk: int = PREFILL_CHUNK) -> None:
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
    ) -> RoundSteps:
        target, cache = self.target, session.target_cache
        yield from prefill(session, prompt_ids, target, chunk=self.prefill_chunk)
        stats = RoundStats()
        penalties = (
            PenaltyContext(target.config.vocab_size, prompt_ids, target.device)
            if params.has_penalties
            else None
        )
        noise = PositionNoise(generator, target.config.vocab_size)
        root = prompt_ids[-1]
        for _ in range(max_new_tokens):
            if cache.free < 1:
                return
            t0 = time.perf_counter()
            pos = len(session.target_tokens)
            done = yield from forward(
                target,
                torch.tensor([root], device=target.device),
                torch.tensor([pos], device=target.device),
                cache,
            )
            logits = done.logits  # (1, V)
            session.target_tokens.append(root)
            token = int(draw(logits, params, penalties, noise, positions=[pos + 1])[0])
            logprobs = (
                [token_logprob(logits[0], token, params.logprobs)]
                if params.logprobs is not None
                else None
            )
            del done, logits  # a view of the whole pass's logits: gone before the next pass
            if penalties is not None:
                penalties.append([token])
            stats.target_passes += 1
            stats.verify_seconds += time.perf_counter() - t0
            yield Round([token], stats, logprobs=logprobs)
            stats = RoundStats()
            root = token
