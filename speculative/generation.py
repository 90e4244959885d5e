"""What every decoding strategy shares: the per-sequence session, round statistics, the
strategy interface, and `Generation`, which turns rounds of token ids into text with
EOS, stop strings and `max_tokens` applied.

The round invariant (see DESIGN.md): at the start of a round both caches hold the committed
sequence x_1..x_{L-1}; the last token x_L is known but not yet fed to either model.
"""

from __future__ import annotations

import time
from collections.abc import Generator as PyGenerator
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from speculative.detok import IncrementalDetokenizer, StopMatcher
from speculative.errors import RequestError
from speculative.grammar import Constraint
from speculative.kv_cache import KVCache
from speculative.model import Transformer
from speculative.passes import (
    Allot,
    Forward,
    Request,
    Steps,
    feed_pass,
    run_alone,
    serve_alone,
)
from speculative.sampling import SamplingParams, TokenLogprob, make_generator

PREFILL_CHUNK = 2048  # prompt tokens per prefill pass: bounds activation memory

R = TypeVar("R")


class ContextFullError(RequestError):
    """The prompt does not fit the context (a request error, never silently truncated)."""


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
    # (none after a prefill step: see `prefill`)
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
            tokens_per_target_pass=self.generated_tokens / max(self.decode_passes, 1),
            acceptance_rate=(self.accepted / self.drafted) if self.drafted else None,
            tree_nodes=(self.tree_nodes_total / self.rounds) if self.tree_nodes_total else 0.0,
            tokens_per_second=self.generated_tokens / decode_seconds
            if decode_seconds > 0
            else None,
        )
        d.update(extra)
        return d


class Session:
    """One sequence's state on the models: each model's KV cache and the token ids whose
    entries it holds. A conversation keeps its session so the next request prefills only
    what is new."""

    def __init__(self, target: Transformer, capacity: int, draft: Transformer | None = None):
        self.capacity = capacity
        self.target_cache: KVCache = target.new_cache(capacity)
        self.target_tokens: list[int] = []
        self.draft_cache: KVCache | None = draft.new_cache(capacity) if draft is not None else None
        self.draft_tokens: list[int] = []

    def reuse_prefix(self, prompt_ids: Sequence[int]) -> int:
        """Roll both caches back to their longest common prefix with `prompt_ids`, keeping at
        least the last prompt token unfed (it is the first round's root). Returns how many
        prompt tokens the target cache still holds."""
        limit = max(len(prompt_ids) - 1, 0)
        kept = common_prefix_len(self.target_tokens, prompt_ids, limit)
        self.target_cache.truncate(kept)
        del self.target_tokens[kept:]
        if self.draft_cache is not None:
            d = common_prefix_len(self.draft_tokens, prompt_ids, limit)
            self.draft_cache.truncate(d)
            del self.draft_tokens[d:]
        return kept


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens `a` and `b` share, at most `limit` (None: no limit)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if (limit is not None and n >= limit) or x != y:
            break
        n += 1
    return n


def feed_steps(
    model: Transformer,
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
    model: Transformer,
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
    target: Transformer,
    draft: Transformer | None = None,
    *,
    fold: int = 0,
    chunk: int = PREFILL_CHUNK,
) -> RoundSteps:
    """Bring the caches up to the committed `sequence` x_1..x_L (reusing what they hold),
    ONE chunk per model per step, yielding a Round with no tokens after each step. A
    streamed 70B spends seconds on a chunk: fed in one go, a long prompt froze every
    other generation and could not be cancelled; between steps the engine serves the
    others and drops a cancelled job.

    The target stops `fold` tokens short of x_{L-1}: the caller's next pass carries them
    with the root (and a tree's nodes), which saves a streamed pass. The draft stops
    `chunk - 1` tokens short: its first drafting pass takes them with the root, so no
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
        end = max(len(sequence) - 1 - fold, 0)
        done = len(session.target_tokens)
        todo = list(sequence[done : min(end, done + chunk)])
        if todo:
            n = yield from feed_steps(
                target, session.target_cache, session.target_tokens, todo, chunk
            )
            stats.prefill_passes = stats.target_passes = n
            stats.prefill_seconds = time.perf_counter() - t0
        draft_todo: list[int] = []
        if draft is not None and draft_cache is not None:
            t1 = time.perf_counter()
            draft_end = max(len(sequence) - chunk, 0)
            fed_draft = len(session.draft_tokens)
            draft_todo = list(sequence[fed_draft : min(draft_end, fed_draft + chunk)])
            if draft_todo:
                fed = session.draft_tokens
                stats.draft_passes = yield from feed_steps(
                    draft, draft_cache, fed, draft_todo, chunk
                )
                stats.draft_seconds = time.perf_counter() - t1
        if not todo and not draft_todo:
            return
        yield Round([], stats)


# A strategy's rounds, step-wise: it yields a `Forward` wherever it needs a model pass (and
# takes the result from it when resumed), a `Round` when tokens are committed. See
# speculative/passes.py for who runs the passes.
RoundSteps = PyGenerator[Round | Request, None, None]


class Strategy(Protocol):
    """A decoding strategy: rounds of exact target samples. Autoregressive, linear and tree
    speculation all implement this; `Generation` applies stopping rules on top."""

    name: str
    target: Transformer
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


def alone(steps: PyGenerator[Request | R, None, None]) -> Iterator[R]:
    """Drive a step-wise generator on its own: each request is served at once as if no
    other generation existed (`serve_alone`), everything else is passed on (a strategy's
    Rounds, a Generation's Chunks)."""
    try:
        for item in steps:
            if isinstance(item, Forward | Allot):
                serve_alone(item)
            else:
                yield item
    finally:
        steps.close()


@dataclass
class Chunk:
    """Text and tokens a round added; both empty after a prefill step (progress only)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # With Generation(trace=True): one entry per round that drafted a tree (`trace_round`).
    trace: list[dict[str, Any]] = field(default_factory=list)
    # With params.logprobs set: one entry per token of `token_ids`.
    logprobs: list[TokenLogprob] = field(default_factory=list)


# A trace stays small whatever the budget and the answer's length: the first nodes of each
# tree (a prefix of the node order is a tree: parents come first), the first rounds.
TRACE_MAX_NODES = 64
TRACE_MAX_ROUNDS = 128


def trace_round(number: int, rnd: Round, tree: DraftedTree, tokenizer: Any) -> dict[str, Any]:
    """One round's tree for a person to read: node tokens as text, parents, the accepted
    path, and the tokens the round emitted (cached ones first, then the walk's)."""
    kept = min(len(tree.tokens), TRACE_MAX_NODES)

    def text(token: int, after: int | None = None) -> str:
        # A token's text after the one before it: decoded alone, a SentencePiece token
        # loses its leading space.
        if after is None:
            return tokenizer.decode([token], skip_special_tokens=False)
        before = tokenizer.decode([after], skip_special_tokens=False)
        return tokenizer.decode([after, token], skip_special_tokens=False)[len(before) :]

    nodes = tree.tokens[:kept]
    parents = tree.parents[:kept]
    # What came before this round's first token: the root, unless the round began with
    # tokens from the prefix cache (the root is the last of those).
    first_after = tree.tokens[0] if rnd.stats.prefix_cache_hits == 0 else None
    emitted = [first_after, *rnd.tokens]
    return {
        "round": number,
        "nodes": len(tree.tokens) - 1,  # drafted, besides the root
        "tokens": [
            text(t, nodes[p] if p >= 0 else None) for t, p in zip(nodes, parents, strict=True)
        ],
        "parents": parents,
        "accepted": [v for v in tree.path if v < kept],
        "accepted_count": len(tree.path),
        "emitted": [text(t, emitted[i]) for i, t in enumerate(rnd.tokens)],
        "prefix_cache_hits": rnd.stats.prefix_cache_hits,
        "truncated": kept < len(tree.tokens),
    }


class Generation:
    """Iterate for text chunks as rounds complete; afterwards `token_ids`, `text`,
    `finish_reason` and `stats` describe the whole generation."""

    def __init__(
        self,
        strategy: Strategy,
        session: Session,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        trace: bool = False,
        constraint: Constraint | None = None,
    ) -> None:
        """`constraint`: the request's grammar (speculative/grammar.py); its end of
        sequence always stops the generation, `ignore_eos` or not."""
        if not prompt_ids:
            raise ContextFullError("the prompt is empty: at least one token is needed")
        room = session.capacity - len(prompt_ids)
        if room < 1:
            raise ContextFullError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {session.capacity}"
                " (prompt plus at least one new token must fit)"
            )
        self.strategy, self.session, self.tokenizer = strategy, session, tokenizer
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.max_tokens = min(max_tokens, room)
        self.stop = list(stop)
        eos = tuple(stop_token_ids) if stop_token_ids is not None else tokenizer.eos_token_ids
        self.stop_token_ids = set() if ignore_eos else set(eos)
        self.constraint = constraint
        if constraint is not None:
            self.stop_token_ids |= set(constraint.vocab.eos_tokens)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stopped_by_token = False
        self.stats = GenerationStats(
            strategy=strategy.name, max_tokens=self.max_tokens, prompt_tokens=len(self.prompt_ids)
        )
        self.trace = trace
        self.traced_rounds = 0

    @property
    def completion_tokens(self) -> int:
        """Tokens the model produced, including the stop token that is not shown."""
        return len(self.token_ids) + int(self.stopped_by_token)

    def __iter__(self) -> Iterator[Chunk]:
        """The generation on its own: every pass it needs runs at once."""
        return alone(self.steps())

    def steps(self) -> PyGenerator[Chunk | Request, None, None]:
        """The generation step-wise: the passes it needs (and its trees' requests for
        nodes) are yielded for the driver to serve (the engine batches them with other
        generations'); a Chunk after each round."""
        t0 = time.perf_counter()
        self.stats.cached_prompt_tokens = self.session.reuse_prefix(self.prompt_ids)
        detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        stops = StopMatcher(self.stop)
        generator = make_generator(self.params.seed, self.strategy.target.device)
        rounds = (
            self.strategy.steps(
                self.session, self.prompt_ids, self.params, self.max_tokens, generator
            )
            if self.constraint is None
            else self.strategy.steps(
                self.session, self.prompt_ids, self.params, self.max_tokens, generator,
                self.constraint,
            )
        )  # fmt: skip
        try:
            for item in rounds:
                if isinstance(item, Forward | Allot):
                    yield item  # the driver serves it; the strategy takes the result
                    continue
                rnd = item
                self.stats.add(rnd.stats, decoded=bool(rnd.tokens))
                if self.stats.first_token_seconds is None and rnd.tokens:
                    self.stats.first_token_seconds = time.perf_counter() - t0
                taken: list[int] = []
                text = ""
                for tok in rnd.tokens:
                    if tok in self.stop_token_ids:
                        self.finish_reason, self.stopped_by_token = "stop", True
                        break
                    taken.append(tok)
                    text += stops.push(detok.push([tok]))
                    if stops.stopped:
                        self.finish_reason = "stop"
                        break
                    if len(self.token_ids) + len(taken) >= self.max_tokens:
                        self.finish_reason = "length"
                        break
                self.token_ids += taken
                if self.finish_reason is not None:
                    text += stops.push(detok.flush()) + stops.flush()
                self.text += text
                self.stats.generated_tokens = self.completion_tokens
                self.stats.total_seconds = time.perf_counter() - t0
                trace = []
                if self.trace and rnd.tree is not None and self.traced_rounds < TRACE_MAX_ROUNDS:
                    self.traced_rounds += 1
                    trace.append(trace_round(self.traced_rounds, rnd, rnd.tree, self.tokenizer))
                # A round with no tokens (a prefill step) still yields an empty chunk: the
                # caller gets control back between chunks of a long prompt.
                # The emitted tokens' log-probabilities, as many as were taken.
                logprobs = (rnd.logprobs or [])[: len(taken)]
                yield Chunk(text, taken, self.finish_reason, trace, logprobs)
                if self.finish_reason is not None:
                    return
            # The strategy ran out of room (end of context) before any stop rule fired.
            self.finish_reason = "length"
            tail = stops.push(detok.flush()) + stops.flush()
            self.text += tail
            yield Chunk(tail, [], self.finish_reason)
        finally:
            rounds.close()
            self.stats.total_seconds = time.perf_counter() - t0

    def run(self) -> Generation:
        for _ in self:
            pass
        return self
