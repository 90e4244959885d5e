"""Linear speculation (Leviathan et al. 2023; Chen et al. 2023): the drafter proposes a
chain t_1..t_k, the target scores [x_L, t_1..t_k] in one pass, and rejection sampling keeps
the longest prefix the target agrees with plus one token of its own.

The rule, with p_i the target's and q_i the drafter's FINAL sampling distributions (after
penalties, temperature, top-k/top-p/min-p; the penalty counts grow along the chain):
accept t_i with probability min(1, p_i(t_i) / q_i(t_i)); at the first rejection emit a
sample of norm(max(0, p_i - q_i)) and stop; if all k are accepted, emit a bonus sample of
p_{k+1}. Every emitted token is then distributed exactly as the target's. Greedy is the
special case of one-hot p and q: accept while the target's argmax equals the draft token,
then emit the target's argmax.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from modeling.protocol import Model
from speculative.drafting import Drafter
from speculative.grammar import MAX_FORCED, Constraint
from speculative.grammar_masks import forced_logprobs, mask_rows_
from speculative.passes import forward
from speculative.prefill import PREFILL_CHUNK, prefill
from speculative.rounds import Round, RoundStats, RoundSteps
from speculative.sampling import (
    PenaltyContext,
    SamplingParams,
    path_counts,
    probabilities,
    residual_distribution,
    sample,
    token_logprob,
)
from speculative.session import Session


class Linear:
    name = "linear"

    def __init__(
        self,
        target: Model,
        drafter: Drafter,
        spec_length: int = 4,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        if spec_length < 1:
            raise ValueError(f"--spec-length must be at least 1, got {spec_length}")
        self.target = target
        self.drafter = drafter
        self.spec_length = spec_length
        self.pass_rows = spec_length + 1  # the root and the chain
        self.prefill_chunk = prefill_chunk

    def new_session(self, capacity: int) -> Session:
        return self.drafter.new_session(self.target, capacity)

    def correction_distribution(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """What a rejected position emits (the residual; tests swap it for a wrong one)."""
        return residual_distribution(p, q)

    def verify(
        self,
        p: torch.Tensor,  # (k+1, V) target distributions after x_L, t_1, .., t_k
        q: torch.Tensor,  # (k, V) drafter distributions t_1..t_k were drawn from
        drafted: Sequence[int],
        generator: torch.Generator,
    ) -> tuple[int, int]:
        """Rejection sampling: (number of drafted tokens accepted, the target's own token)."""
        k = len(drafted)
        accepted = k
        if k:
            rows = torch.arange(k, device=p.device)
            tokens = torch.tensor(list(drafted), dtype=torch.long, device=p.device)
            pt, qt = p[rows, tokens], q[rows, tokens]  # (k,)
            u = torch.rand(k, generator=generator, device=p.device)  # (k,)
            # u < p/q holds with probability min(1, p/q); strict, so p(t) = 0 never passes.
            # Each t_i was drawn from q_i, so q_i(t_i) > 0; a token drawn where q_i is 0 (a
            # sampler's fault) is rejected, not let through by p/0 = inf or 0/0 = nan.
            rejected = torch.nonzero(~((u * qt < pt) & (qt > 0)))
            if len(rejected):
                accepted = int(rejected[0, 0])
        if accepted < k:
            dist = self.correction_distribution(p[accepted], q[accepted])
        else:
            dist = p[k]  # every draft token accepted: a bonus token from the last row
        return accepted, int(sample(dist[None], generator)[0])

    def steps(
        self,
        session: Session,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        generator: torch.Generator,
        constraint: Constraint | None = None,
    ) -> RoundSteps:
        """Rounds of a drafted chain and its verification; under a grammar the drafter
        proposes only allowed tokens, each position's target row is masked by the state
        after the chain's tokens before it, and the tokens the grammar allows alone are
        emitted without a pass (riding in the next one)."""
        target, cache = self.target, session.target_cache
        vocab = target.vocab_width
        # The draft model (if any) catches up on the prompt in the same steps; its
        # first proposal then feeds at most one chunk together with the root.
        yield from prefill(
            session, prompt_ids, target, self.drafter.draft, chunk=self.prefill_chunk
        )
        stats = RoundStats()
        penalties = PenaltyContext(vocab, prompt_ids, target.device)
        sequence = list(prompt_ids)  # x_1..x_L; the target cache holds all but x_L
        emitted = 0
        while emitted < max_new_tokens:
            if constraint is not None:
                forced = constraint.take_forced(min(MAX_FORCED, max_new_tokens - emitted))
                if forced:
                    sequence.extend(forced)
                    penalties.append(forced)
                    emitted += len(forced)
                    stats.forced_tokens += len(forced)
                    yield Round(forced, stats, logprobs=forced_logprobs(forced, params) or None)
                    stats = RoundStats()
                    if constraint.ends(forced) or emitted >= max_new_tokens:
                        return
            pending = sequence[len(session.target_tokens) : -1]  # forced tokens, unfed
            if cache.free < len(pending) + 1:
                return  # the context is full: Generation reports "length"
            # The block [pending, x_L, t_1..t_k] must fit the cache, and emitting more
            # than k + 1 tokens is never useful; at k = 0 this is one plain step.
            k = min(self.spec_length, cache.free - len(pending) - 1, max_new_tokens - emitted - 1)
            target.prefetch()  # a streamed target's first layers copy while the draft works
            proposal = yield from self.drafter.propose(
                session, sequence, k, params, penalties, generator, constraint
            )
            drafted = proposal.tokens
            stats.draft_passes += proposal.passes
            stats.draft_seconds += proposal.seconds
            stats.drafted += len(drafted)

            t0 = time.perf_counter()
            block = [*pending, sequence[-1], *drafted]
            start = len(session.target_tokens)
            done = yield from forward(
                target,
                torch.tensor(block, dtype=torch.long, device=target.device),
                torch.arange(start, start + len(block), device=target.device),
                cache,
                logits_from=len(pending),
            )
            logits = done.logits  # (k+1, V)
            if constraint is not None:  # row j: the state after t_1..t_j
                words = constraint.masks([drafted[:j] for j in range(len(drafted) + 1)])
                logits = logits.clone()  # one copy; masked row by row, no wider temporary
                mask_rows_(logits, words)
            counts = path_counts(drafted, vocab, target.device)  # (k+1, V)
            p = probabilities(logits, params, penalties.rows(counts))  # (k+1, V)
            accepted, token = self.verify(p, proposal.q, drafted, generator)
            emitted_tokens = [*drafted[:accepted], token]  # row j is where token j was drawn
            logprobs = (
                [token_logprob(logits[j], t, params.logprobs) for j, t in enumerate(emitted_tokens)]
                if params.logprobs is not None
                else None
            )
            del done, logits, p, proposal  # (k+1, V) rows: gone before the next pass

            # Roll the target back to x_1..x_L, t_1..t_a; the new token is the next root.
            fed = len(pending) + 1 + accepted
            cache.truncate(start + fed)
            session.target_tokens.extend(block[:fed])
            new = [*drafted[:accepted], token]
            sequence.extend(new)
            self.drafter.rollback(session, len(sequence) - 1)
            penalties.append(new)
            if constraint is not None:
                constraint.commit(new)
            stats.target_passes += 1
            stats.accepted += accepted
            stats.verify_seconds += time.perf_counter() - t0
            emitted += len(new)
            yield Round(new, stats, logprobs=logprobs)
            stats = RoundStats()
