"""`Generation`: a strategy's rounds of token ids turned into text, with EOS, stop strings
and `max_tokens` applied, and each round's draft tree traced for a person on request."""

from __future__ import annotations

import time
from collections.abc import Generator as PyGenerator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from modeling.errors import RequestError
from modeling.text.detok import IncrementalDetokenizer, StopMatcher, StopsOutsideCalls
from modeling.text.thinking import Stops, Thinking, ThinkingStops
from modeling.text.tokenizer import Tokenizer
from speculative.grammar import Constraint
from speculative.passes import Allot, Forward, PassRequest, alone
from speculative.rounds import DraftedTree, GenerationStats, Round, Strategy
from speculative.sampling import SamplingParams, TokenLogprob, make_generator
from speculative.session import Session


class ContextFullError(RequestError):
    """The prompt does not fit the context (a request error, never silently truncated)."""


@dataclass
class Chunk:
    """Text and tokens a round added; both empty after a prefill step (progress only)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # With Generation(trace=True): one entry per round that drafted a tree (`trace_round`).
    trace: list[dict[str, Any]] = field(default_factory=list)
    # With params.logprobs set: one entry per emitted token whose text is out, in order (a
    # token whose text a stop string's prefix holds comes with that text; one inside the
    # stop string, never), so they spell the answer's text as it streams.
    logprobs: list[TokenLogprob] = field(default_factory=list)


# A trace stays small whatever the budget and the answer's length: the first nodes of each
# tree (a prefix of the node order is a tree: parents come first), the first rounds.
TRACE_MAX_NODES = 64
TRACE_MAX_ROUNDS = 128


def trace_round(number: int, rnd: Round, tree: DraftedTree, tokenizer: Tokenizer) -> dict[str, Any]:
    """One round's tree for a person to read: node tokens as text (each after its parent,
    `Tokenizer.piece`), parents, the accepted path, and the tokens the round emitted
    (cached ones first, then the walk's)."""
    kept = min(len(tree.tokens), TRACE_MAX_NODES)
    text = tokenizer.piece
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
        call_lead: str | None = None,
        thinking: Thinking | None = None,
    ) -> None:
        """`constraint`: the request's grammar (speculative/grammar.py); its end of
        sequence always stops the generation, `ignore_eos` or not. `call_lead`: how an
        answer that calls tools begins, where it may (`stop` then applies to text answers
        only: `StopsOutsideCalls`). `thinking`: a reasoning model's turn, whose stops
        apply after its think block (`ThinkingStops`)."""
        # The daemon admits every request before it gets here (daemon/admission.py: the
        # prompt not empty and within the context, naming the field). This guards the
        # session's caches for every caller that builds a Generation directly, on a
        # session of any capacity.
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
        self.call_lead = call_lead
        self.thinking = thinking
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

    def steps(self) -> PyGenerator[Chunk | PassRequest, None, None]:
        """The generation step-wise: the passes it needs (and its trees' requests for
        nodes) are yielded for the driver to serve (the engine batches them with other
        generations'); a Chunk after each round."""
        t0 = time.perf_counter()
        self.stats.cached_prompt_tokens = self.session.reuse_prefix(self.prompt_ids)
        detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        stops: Stops = (
            StopMatcher(self.stop)
            if self.call_lead is None
            else StopsOutsideCalls(self.stop, self.call_lead)
        )
        if self.thinking is not None:
            stops = ThinkingStops(stops, self.thinking)
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
        # Emitted tokens' log-probabilities not given yet, with where each one's text
        # begins among the characters decoded so far (`decoded`).
        held: list[tuple[int, TokenLogprob]] = []
        decoded = 0
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
                scores = rnd.logprobs or []
                for tok in rnd.tokens:
                    if tok in self.stop_token_ids:
                        self.finish_reason, self.stopped_by_token = "stop", True
                        break
                    if len(taken) < len(scores):  # (where its text begins in the decoded)
                        start = decoded + detok.held_chars()
                        held.append((start, replace(scores[len(taken)], start=start)))
                    taken.append(tok)
                    piece = detok.push([tok])
                    decoded += len(piece)
                    text += stops.push(piece)
                    if stops.stopped:
                        self.finish_reason = "stop"
                        break
                    if len(self.token_ids) + len(taken) >= self.max_tokens:
                        self.finish_reason = "length"
                        break
                self.token_ids += taken
                if self.finish_reason is not None:
                    text += stops.push(detok.flush()) + stops.flush()
                    if stops.stopped:  # (the held text's end made a stop string)
                        self.finish_reason = "stop"
                self.text += text
                self.stats.generated_tokens = self.completion_tokens
                self.stats.total_seconds = time.perf_counter() - t0
                trace = []
                # (A tree of the root alone, where the draft proposed nothing, verified no draft.)
                tree = rnd.tree if rnd.tree is not None and len(rnd.tree.tokens) > 1 else None
                if self.trace and tree is not None and self.traced_rounds < TRACE_MAX_ROUNDS:
                    self.traced_rounds += 1
                    trace.append(trace_round(self.traced_rounds, rnd, tree, self.tokenizer))
                # A round with no tokens (a prefill step) still yields an empty chunk: the
                # caller gets control back between chunks of a long prompt.
                # The log-probabilities of the tokens whose text is out (a token's text held
                # back by a stop string's prefix keeps its own back; one inside the stop
                # string is never given), every one at an end that no stop string made.
                cut = stops.stopped or self.finish_reason is None
                out = len(self.text)
                given = sum(1 for start, _ in held if start < out) if cut else len(held)
                logprobs = [lp for _, lp in held[:given]]
                held = [] if self.finish_reason is not None else held[given:]
                yield Chunk(text, taken, self.finish_reason, trace, logprobs)
                if self.finish_reason is not None:
                    return
            # The strategy ran out of room (end of context) before any stop rule fired.
            self.finish_reason = "length"
            tail = stops.push(detok.flush()) + stops.flush()
            self.text += tail
            if stops.stopped:  # (the held text's end made a stop string: cut there)
                self.finish_reason = "stop"
                held = [(start, lp) for start, lp in held if start < len(self.text)]
            yield Chunk(tail, [], self.finish_reason, logprobs=[lp for _, lp in held])
        finally:
            rounds.close()
            self.stats.total_seconds = time.perf_counter() - t0

    def run(self) -> Generation:
        for _ in self:
            pass
        return self
