"""What a decoding strategy is and what its rounds yield: the `Strategy` interface, a
`Round` of committed tokens, and the statistics a round and a whole generation record.

The round invariant (see DESIGN.md): at the start of a round both caches hold the committed
sequence x_1..x_{L-1}; the last token x_L is known but not yet fed to either model.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from modeling.protocol import Model
from speculative.grammar import Constraint
from speculative.passes import PassRequest
from speculative.sampling import SamplingParams, TokenLogprob
from speculative.session import Session


@dataclass
class RoundStats:
    """What one round cost and bought. Strategies fill what applies to them."""

    target_passes: int = 0
    prefill_passes: int = 0
    draft_passes: int = 0
    drafted: int = 0  # tokens proposed by the draft (linear) or tree nodes besides the root
    accepted: int = 0  # drafted tokens the target agreed with
    tree_nodes: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    budget: int | None = None
    budget_reason: str | None = None  # why the planner chose the budget (tree strategy)
    prefix_cache_hits: int = 0  # tokens drawn from cached target logits (no target pass)
    prefix_cache_misses: int = 0  # look-ups that found nothing
    tree_verification: str | None = None  # walk | rejection (tree strategy)
    # The tokens per round that verification's learned acceptance predicted for the tree.
    acceptance_estimate: float | None = None
    forced_tokens: int = 0  # emitted without a pass: the grammar allowed them alone


@dataclass
class DraftedTree:
    """One round's draft tree as the target's walk saw it (host lists, for a trace)."""

    tokens: list[int]  # node tokens, the root first; a parent comes before its children
    parents: list[int]  # each node's parent index (-1 for the root)
    path: list[int]  # the accepted nodes, root to leaf (the root itself not included)


@dataclass
class Round:
    tokens: list[int]  # emitted this round, in order; each is an exact target sample
    # (none after a prefill step: see speculative/prefill.py)
    stats: RoundStats
    tree: DraftedTree | None = None  # the tree strategy's draft, when the round had one
    # With params.logprobs set: one entry per token, in order (sampling.token_logprob).
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationStats:
    strategy: str = ""
    max_tokens: int = 0  # the effective limit: the request's, cut to the room left
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # reused from the session's KV cache, not prefilled
    generated_tokens: int = 0
    rounds: int = 0
    target_passes: int = 0
    prefill_passes: int = 0
    draft_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    tree_nodes_total: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    first_token_seconds: float | None = None
    budget: int | None = None
    budget_reason: str | None = None  # the last round's
    prefix_cache_hits: int = 0
    prefix_cache_misses: int = 0
    tree_verification: str | None = None  # the last tree round's (walk | rejection)
    acceptance_estimate: float | None = None  # the tokens per round it predicted
    verification_rounds: dict[str, int] = field(default_factory=dict)  # rounds per kind
    forced_tokens: int = 0  # emitted without a pass: the grammar allowed them alone
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the streamer's figures

    def add(self, r: RoundStats, decoded: bool = True) -> None:
        """`decoded` False: a prefill step, which is not a round (`tree_nodes` averages
        over rounds)."""
        self.rounds += int(decoded)
        self.target_passes += r.target_passes
        self.prefill_passes += r.prefill_passes
        self.draft_passes += r.draft_passes
        self.drafted += r.drafted
        self.accepted += r.accepted
        self.tree_nodes_total += r.tree_nodes
        self.draft_seconds += r.draft_seconds
        self.verify_seconds += r.verify_seconds
        self.prefill_seconds += r.prefill_seconds
        self.prefix_cache_hits += r.prefix_cache_hits
        self.prefix_cache_misses += r.prefix_cache_misses
        self.forced_tokens += r.forced_tokens
        if r.budget is not None:
            self.budget = r.budget
        if r.budget_reason is not None:
            self.budget_reason = r.budget_reason
        if r.tree_verification is not None:
            self.tree_verification = r.tree_verification
            self.acceptance_estimate = r.acceptance_estimate
            kind = r.tree_verification
            self.verification_rounds[kind] = self.verification_rounds.get(kind, 0) + 1

    @property
    def decode_passes(self) -> int:
        return self.target_passes - self.prefill_passes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        decode_seconds = self.total_seconds - self.prefill_seconds
        d.update(
            # (None where no decode pass ran: every token replayed from the prefix cache, or
            # forced by a grammar; its tokens were no pass's)
            tokens_per_target_pass=self.generated_tokens / self.decode_passes
            if self.decode_passes > 0
            else None,
            acceptance_rate=(self.accepted / self.drafted) if self.drafted else None,
            tree_nodes=(self.tree_nodes_total / self.rounds) if self.tree_nodes_total else 0.0,
            tokens_per_second=self.generated_tokens / decode_seconds
            if decode_seconds > 0
            else None,
        )
        d.update(extra)
        return d


# A strategy's rounds, step-wise: it yields a `Forward` wherever it needs a model pass (and
# takes the result from it when resumed), a `Round` when tokens are committed. See
# speculative/passes.py for who runs the passes.
RoundSteps = Generator[Round | PassRequest, None, None]


class Strategy(Protocol):
    """A decoding strategy: rounds of exact target samples. Autoregressive, linear and tree
    speculation all implement this; `Generation` applies stopping rules on top."""

    name: str
    target: Model
    prefill_chunk: int  # prompt tokens per prefill step (PREFILL_CHUNK; tests use tiny ones)
    # Logit rows its target pass returns besides a tree's nodes (which the engine grants
    # from the pass's rows): the engine reserves them before any tree grows.
    pass_rows: int

    def new_session(self, capacity: int) -> Session: ...

    def steps(
        self,
        session: Session,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        generator: torch.Generator,
        constraint: Constraint | None = None,
    ) -> RoundSteps:
        """Rounds of exact samples of the target's distribution, masked by `constraint`'s
        grammar where one is given (speculative/grammar.py)."""
        ...
