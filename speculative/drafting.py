"""Where linear speculation's guesses come from: the `Drafter` interface, and drafting with a
resident draft model (`ModelDrafter`). Prompt lookup's drafter is `NgramDrafter`, with the
rest of n-gram drafting in speculative/ngram.py.

A drafter proposes up to `k` tokens after the committed sequence x_1..x_L together with the
distribution q_i each token was drawn from. Rejection sampling needs q only at the proposed
token and, on rejection, the whole row; a deterministic proposal (n-gram lookup) is the
point mass q_i = one_hot(t_i), for which the same rule stays exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from modeling.protocol import Model
from speculative.grammar import Constraint
from speculative.grammar_masks import masked
from speculative.passes import Steps, feed_pass
from speculative.sampling import (
    PenaltyContext,
    SamplingParams,
    path_counts,
    probabilities,
    sample,
)
from speculative.session import Session


@dataclass
class Proposal:
    tokens: list[int]  # t_1..t_k, k may be 0 (nothing to propose)
    q: torch.Tensor  # (k, V) the final distribution each t_i was drawn from
    passes: int  # draft model forward passes spent
    seconds: float


class Drafter(Protocol):
    # The draft model whose cache the session holds (None: nothing to prefill), so the
    # strategy's `prefill` steps can feed it a long prompt chunk by chunk.
    draft: Model | None

    def new_session(self, target: Model, capacity: int) -> Session: ...

    def propose(
        self,
        session: Session,
        sequence: Sequence[int],  # x_1..x_L; x_L (the root) is fed to no model yet
        k: int,
        params: SamplingParams,
        penalties: PenaltyContext,
        generator: torch.Generator,
        constraint: Constraint | None = None,  # the request's grammar, at x_L
    ) -> Steps[Proposal]:
        """Step-wise (`yield from` it): the draft model's passes are requested, not run."""
        ...

    def rollback(self, session: Session, committed: int) -> None:
        """Forget draft state beyond the first `committed` tokens of the sequence."""
        ...


def check_draft_width(draft: Model, target: Model) -> None:
    """A draft's distributions meet the target's id for id, so it must speak the target's
    width; unequal embedding sizes are adapted by `Transformer.set_vocab_width` once the
    tokenizers are known to agree (daemon/runtime.py does both)."""
    if draft.vocab_width != target.vocab_width:
        raise ValueError(
            f"the draft speaks {draft.vocab_width} token ids, the target {target.vocab_width}: "
            "call draft.set_vocab_width(target.vocab_width) after checking both share one "
            "tokenizer"
        )


class ModelDrafter:
    """Samples t_i ~ q_i autoregressively from a small resident model. Its cache is filled
    lazily: whatever part of the sequence it does not hold yet (the prompt's last chunk on
    the first round, the last accepted draft token after a fully accepted round) goes in
    with the first drafting pass. The strategy's `prefill` feeds a longer prompt before,
    one chunk per step, so that pass never exceeds a chunk."""

    def __init__(self, draft: Model, shared_cache: bool = False) -> None:
        """`shared_cache`: `draft` is the target's substitute (modeling/substitute.py),
        which drafts in the target's KV cache past the committed rows and keeps none:
        then there is no draft cache to prefill (`self.draft` is None)."""
        self.model = draft
        self.shared_cache = shared_cache
        self.draft: Model | None = None if shared_cache else draft

    def new_session(self, target: Model, capacity: int) -> Session:
        check_draft_width(self.model, target)
        return Session(target, capacity, self.draft)

    def propose(
        self,
        session: Session,
        sequence: Sequence[int],
        k: int,
        params: SamplingParams,
        penalties: PenaltyContext,
        generator: torch.Generator,
        constraint: Constraint | None = None,
    ) -> Steps[Proposal]:
        t0 = time.perf_counter()
        draft = self.model
        if self.shared_cache:
            # The target's cache holds x_1..x_{L-1}; the proposal's rows go after them and
            # are dropped before the target's pass writes its own there.
            cache, fed = session.target_cache, list(session.target_tokens)
            committed = cache.length
        else:
            own, fed = session.draft_cache, session.draft_tokens
            assert own is not None, "a ModelDrafter session with its own draft has its cache"
            cache = own
        # The target's width (`Transformer.set_vocab_width`): q meets the target's p and
        # the penalty context, both sized by the target, and gives ids the draft has no
        # row for, or the target lacks, zero probability.
        vocab = draft.vocab_width
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        passes = 0
        pending = list(sequence[len(fed) :])  # always holds at least the root
        for _ in range(k):
            done = yield from feed_pass(draft, cache, fed, pending)
            logits = done.logits  # (1, V)
            if constraint is not None:  # the grammar's state after the chain so far
                logits = masked(logits, constraint.masks([tokens]))
            passes += 1
            drafted = path_counts(tokens, vocab, draft.device)[-1:]  # (1, V) drafted so far
            q = probabilities(logits, params, penalties.rows(drafted))  # (1, V)
            del done, logits  # a view of the whole pass's logits: gone before the next pass
            token = int(sample(q, generator)[0])
            tokens.append(token)
            rows.append(q[0])
            if constraint is not None and token in constraint.vocab.eos_tokens:
                break  # the grammar is complete: nothing can follow an end of sequence
            pending = [token]  # t_k itself is fed next round, and only if it is accepted
        if self.shared_cache:
            cache.truncate(committed)
        q_all = torch.stack(rows) if rows else torch.empty(0, vocab, device=draft.device)
        return Proposal(tokens, q_all, passes, time.perf_counter() - t0)

    def rollback(self, session: Session, committed: int) -> None:
        if self.shared_cache:
            return  # the target's own commit is the only state
        assert session.draft_cache is not None
        keep = min(committed, len(session.draft_tokens))
        session.draft_cache.truncate(keep)
        del session.draft_tokens[keep:]
