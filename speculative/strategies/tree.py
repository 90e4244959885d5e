"""Tree speculation (SpecExec, Svirschevski et al. 2024): the draft grows a tree of likely
continuations under a node budget, the target scores the whole tree in one pass with an
ancestor mask, and verification walks down the target's own distributions.

Two verifications, both exact (speculative/verification.py): the walk, which draws the
target's token at each node and moves while it is a child, and recursive rejection
sampling over children sampled from the draft. The tree is grown best-first by the
estimated probability that the round's verification reaches each node, learned from the
rounds so far (speculative/acceptance.py): an aligned draft grows deep, a weak one wide.
`verification` auto picks, per round, the one whose learned acceptance predicts more
tokens for the budget (greedy rounds always walk: with one-hot distributions rejection
is the walk over a chain). That choice, the children it needs and what is done with the
target's verdict are speculative/strategies/tree_verification.py; this module runs rounds.

Round layout (see DESIGN.md): the caches hold x_1..x_{L-1}. One target pass takes the
committed tokens it has not seen yet (the prompt on the first round: prefill folded into
verification, one streamed pass instead of two), the root x_L, and the nodes, at positions
L - 1 + depth. The commit keeps the prefix, the root and the accepted path, in place.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from modeling.protocol import Model
from speculative.acceptance import TREE_VERIFICATION_CHOICES, AcceptanceModel
from speculative.auto_budget import AutoBudget
from speculative.budget import BudgetPlanner, FixedBudget, RoundRecord
from speculative.children import ChildPolicy, DraftRows
from speculative.draft_tree import DraftTree, grow_tree_steps
from speculative.drafting import check_draft_width
from speculative.grammar import MAX_FORCED, Constraint
from speculative.grammar_masks import forced_logprobs
from speculative.ngram import ngram_tree
from speculative.passes import Steps, feed_pass, forward
from speculative.prefill import PREFILL_CHUNK, chunk_now, prefill
from speculative.prefix_cache import PrefixCache
from speculative.rounds import Round, RoundStats, RoundSteps
from speculative.sampling import PenaltyContext, PositionNoise, SamplingParams
from speculative.session import Session
from speculative.strategies.tree_verification import (
    Walker,
    accept,
    child_policy,
    choose_verification,
    verification_segment,
)

# With the substitute (a shared KV cache), committed tokens the target has not seen yet ride
# in the first draft pass and the verification pass when they are this few; more (a long
# prompt) go first in plain target passes, whose rows the substitute then attends over.
SHARED_FOLD = 64


class TreeSpeculation:
    name = "tree"
    pass_rows = 1  # the root's; the nodes' rows are granted per pass (passes.allot)

    def __init__(
        self,
        target: Model,
        draft: Model | None,
        budget: int | str = "auto",
        max_depth: int | None = None,
        prefix_cache: PrefixCache | None = None,
        ngram_max: int = 3,
        prefill_chunk: int = PREFILL_CHUNK,
        verification: str = "auto",
        acceptance: AcceptanceModel | None = None,
        shared_cache: bool = False,
    ) -> None:
        """`draft` None means n-gram drafting (prompt lookup), whose trees are walked.
        `verification`: auto | walk | rejection (speculation.tree_verification).
        `acceptance`: what verification accepted so far (a runtime shares one).
        `shared_cache`: the draft is the target's substitute (modeling/substitute.py):
        it drafts in the target's KV cache, past the committed rows, and keeps none."""
        if shared_cache and draft is None:
            raise ValueError("a shared KV cache needs a draft model (the substitute)")
        self.shared_cache = shared_cache
        if draft is not None:
            check_draft_width(draft, target)
        if verification not in TREE_VERIFICATION_CHOICES:
            raise ValueError(
                f"tree verification {verification!r} is not one of "
                f"{', '.join(TREE_VERIFICATION_CHOICES)}"
            )
        self.verification = verification
        # What verification did at the nodes it visited, per kind and temperature regime:
        # the trees' growth values and `auto`'s choice (shared by every request).
        self.acceptance = acceptance if acceptance is not None else AcceptanceModel()
        self.target, self.draft = target, draft
        self.ngram_max = ngram_max
        self.prefill_chunk = prefill_chunk
        self.planner: BudgetPlanner
        if budget == "auto":
            self.planner = AutoBudget(max_depth=max_depth, uses_draft_model=draft is not None)
        elif isinstance(budget, int):
            self.planner = FixedBudget(budget, max_depth)
        else:
            raise ValueError(f"tree budget must be a node count or 'auto', got {budget!r}")
        # The runtime passes its own, shared by every strategy it builds (keys are tokens
        # only, so one cache serves every budget and request).
        self.prefix_cache = (
            prefix_cache if prefix_cache is not None else PrefixCache(dtype=target.dtype)
        )

    def new_session(self, capacity: int) -> Session:
        return Session(self.target, capacity, None if self.shared_cache else self.draft)

    def steps(
        self,
        session: Session,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        generator: torch.Generator,
        constraint: Constraint | None = None,
    ) -> RoundSteps:
        """Rounds, composed of the phases below: walk what the prefix cache already knows,
        take the tokens a grammar forces, bring the caches up (prefill steps), draft a
        tree, request its verification, walk and commit. Each model pass is a requested
        `Forward`: alone or batched with other generations', the round is the same."""
        vocab = self.target.vocab_width
        state = Walker(
            seq=list(prompt_ids),
            key=self.prefix_cache.key(prompt_ids),
            penalties=PenaltyContext(vocab, prompt_ids, self.target.device)
            if params.has_penalties
            else None,
            noise=PositionNoise(generator, vocab),  # the draws autoregressive decoding makes
            params=params,
            generator=generator,
            constraint=constraint,
        )
        stats = RoundStats()
        # Passes plain decoding would spend feeding the prompt (x_1..x_{L-1}), and those
        # spent so far: the verification pass that carries the prompt's last tokens does
        # that work too, so it counts as a prefill pass while fewer were spent than plain
        # decoding's (a tree folds a short prompt into its first pass, one pass in all
        # where a chain spends a prefill pass and a round: counted as a round, the fold
        # made the tree look a pass worse than the chain it beat by one).
        prompt_rest = max(len(prompt_ids) - 1 - len(session.target_tokens), 0)
        # (in the chunks plain decoding's passes would have now: a CPU's are time-bounded)
        prefill_due = -(-prompt_rest // chunk_now(session, self.prefill_chunk))
        prefilled = 0
        while state.emitted < max_new_tokens:
            t_round = time.perf_counter()
            tokens = self._walk_cached(session, state, stats, max_new_tokens)
            if constraint is not None:
                forced = self._take_forced(state, constraint, max_new_tokens - len(tokens))
                tokens += forced
                stats.forced_tokens += len(forced)
                if constraint.ends(forced):  # the grammar is complete: nothing follows
                    state.emitted += len(tokens)
                    yield Round(tokens, stats, logprobs=state.take_logprobs())
                    return
            left = max_new_tokens - state.emitted - len(tokens)
            pending = state.seq[len(session.target_tokens) : -1]
            room = session.target_cache.free - len(pending) - 1  # nodes that still fit
            if left == 0 or room < 0:
                if tokens:
                    stats.verify_seconds += time.perf_counter() - t_round
                    yield Round(tokens, stats, logprobs=state.take_logprobs())
                return
            shape = self.planner.next_shape()
            stats.budget_reason = self.planner.reason
            budget = min(shape.budget, room)
            depth = min(shape.depth, left - 1)
            if depth < 1:
                budget = 0
            # The pass below carries the pending committed tokens, the root and the tree:
            # fold in only as many pending tokens as keep it within the planned largest
            # pass, max(chunk, budget + 1). The rest (a long prompt, a long walk through
            # the prefix cache) goes first, one plain chunk per step, with the draft's
            # catch-up when this round drafts with a model.
            # (`prefill` keeps it within each step's chunk, which shrinks while others
            # ride the passes on a CPU)
            fold = self.prefill_chunk
            draft = self.draft if budget else None
            if self.shared_cache and budget:
                # The substitute drafts on the target's rows: they hold the committed
                # tokens but the last few (forced ones, prefix-cache walks, a short
                # prompt), which its first draft pass takes with the root; a longer
                # prompt goes first in plain target passes.
                fold, draft = SHARED_FOLD, None
            caught_up = prefill(
                session, state.seq, self.target, draft,
                fold=fold, fold_reserve=budget + 1, chunk=self.prefill_chunk,
            )  # fmt: skip
            for step in caught_up:
                if isinstance(step, Round):
                    prefilled += step.stats.prefill_passes
                    step.tokens, tokens = tokens, []  # tokens walked above go out first
                    step.logprobs = state.take_logprobs()
                    state.emitted += len(step.tokens)
                    yield step
                    t_round = time.perf_counter()  # others ran meanwhile: not this round's
                else:
                    yield step  # a prefill pass, its result ignored
            pending = state.seq[len(session.target_tokens) : -1]
            drafted = None
            if budget == 0 and not pending:
                tok, shared = yield from self._plain_step(session, state)
                tokens.append(tok)
                stats.target_passes += 1
                stats.budget = shape.budget
                seconds = time.perf_counter() - t_round
                stats.verify_seconds += seconds
                self.planner.observe(
                    RoundRecord(shape, 0, [], 1, seconds, 0.0, 0, *shared)
                )  # fmt: skip
            else:
                self.target.prefetch()  # a streamed target's first layers copy meanwhile
                kind, table = choose_verification(
                    self.verification, self.acceptance, params, ngram=self.draft is None,
                    walked=state.coupled, first=state.trees == 0,
                )  # fmt: skip
                state.trees += 1
                stats.tree_verification = kind
                state.coupled |= kind == "walk" and not params.greedy
                stats.acceptance_estimate = table.expected_tokens(budget)
                rows = DraftRows() if kind == "rejection" else None
                drafted_with = state.penalties.copy() if state.penalties is not None else None
                policy = child_policy(state, table, rows, drafted_with)
                tree = yield from self._draft(session, state.seq, budget, depth, policy, stats)
                t0 = time.perf_counter()
                verified = yield from forward(
                    self.target, *verification_segment(session, state.seq, tree)
                )
                drafted = accept(
                    session, state, tree, verified.logits, tokens, table, rows, drafted_with,
                    self.prefix_cache, self.target.dtype,
                )  # fmt: skip
                # The draft's rows go now: the plan counts them until verification only.
                del rows, policy, drafted_with
                own_tokens = verified.segment_tokens
                shared = (verified.sequences, verified.tokens, verified.seconds)
                del verified  # its logits (a view of the whole pass's) go before the next pass
                path = drafted.path
                stats.target_passes += 1
                if pending and prefilled < prefill_due:  # it fed the prompt's rest
                    stats.prefill_passes += 1
                    prefilled += 1
                stats.drafted += tree.size - 1
                stats.accepted += len(path)
                stats.tree_nodes += tree.size - 1
                stats.budget = shape.budget
                stats.verify_seconds += time.perf_counter() - t0
                # A round in a pass shared with other generations teaches `auto` the pass's
                # cost by its tokens, and each tree is then charged its marginal cost
                # (speculative/pass_costs.py `MarginalCost`); under concurrency the forest's
                # grants place the pass's nodes.
                self.planner.observe(
                    RoundRecord(
                        shape=shape,
                        nodes=tree.size - 1,
                        path=path,
                        verify_tokens=own_tokens,
                        round_seconds=time.perf_counter() - t_round,
                        draft_seconds=stats.draft_seconds,
                        draft_passes=stats.draft_passes,
                        sequences=shared[0],
                        pass_tokens=shared[1],
                        pass_seconds=shared[2],
                    )
                )
            state.emitted += len(tokens)
            yield Round(tokens, stats, drafted, state.take_logprobs())
            stats = RoundStats()

    def _walk_cached(
        self, session: Session, state: Walker, stats: RoundStats, max_new_tokens: int
    ) -> list[int]:
        """Phase 1: continuations verified in earlier rounds or requests need no target
        pass; draw them from the prefix cache while it knows the next row."""
        pcache = self.prefix_cache
        tokens: list[int] = []
        while (
            pcache.max_bytes
            and state.emitted + len(tokens) < max_new_tokens
            and len(state.seq) - len(session.target_tokens) < session.target_cache.free
        ):
            row = pcache.get(state.key)  # (V,)
            if row is None:
                stats.prefix_cache_misses += 1
                break
            stats.prefix_cache_hits += 1
            tokens.append(state.draw(row[None, :], len(state.seq)))
            state.seq.append(tokens[-1])
            state.key = pcache.child(state.key, tokens[-1])
        return tokens

    def _take_forced(self, state: Walker, constraint: Constraint, room: int) -> list[int]:
        """The tokens the grammar allows alone after the committed ones: emitted without
        drafting or a pass of their own (the next pass carries them to the caches)."""
        forced = constraint.take_forced(min(MAX_FORCED, room - state.emitted))
        for tok in forced:
            state.seq.append(tok)
            if state.penalties is not None:
                state.penalties.append([tok])
            if self.prefix_cache.max_bytes:
                state.key = self.prefix_cache.child(state.key, tok)
        if forced:
            state.logprobs.extend(forced_logprobs(forced, state.params))
        return forced

    def _plain_step(
        self, session: Session, state: Walker
    ) -> Steps[tuple[int, tuple[int, int, float]]]:
        """No tree: one target step on the root, as cheap as autoregressive decoding (auto
        falls back to this where speculation does not pay)."""
        target = self.target
        pos = len(session.target_tokens)
        done = yield from forward(
            target,
            torch.tensor([state.seq[-1]], device=target.device),
            torch.tensor([pos], device=target.device),
            session.target_cache,
        )  # (1, V)
        session.target_tokens.append(state.seq[-1])
        if self.prefix_cache.max_bytes:
            self.prefix_cache.put_rows([state.key], done.logits, walked=1)  # drawn from below
        tok = state.draw(done.logits, pos + 1)
        if self.prefix_cache.max_bytes:
            state.key = self.prefix_cache.child(state.key, tok)
        state.seq.append(tok)
        # The token, and the pass it rode in: its generations, tokens and seconds.
        return tok, (done.sequences, done.tokens, done.seconds)

    def _draft(
        self,
        session: Session,
        seq: list[int],
        budget: int,
        depth: int,
        policy: ChildPolicy,
        stats: RoundStats,
    ) -> Steps[DraftTree]:
        """Phase 2: the round's tree (just the root when budget is 0). The draft model's
        first pass takes what it has not seen with the root: at most a chunk, `prefill`
        fed the rest in earlier steps."""
        device = self.target.device
        root = seq[-1]
        if budget < 1:
            return DraftTree(root, 1, device)
        t0 = time.perf_counter()
        if self.draft is None:
            tree = ngram_tree(seq, budget, depth, max_ngram=self.ngram_max, device=device)
            stats.draft_seconds += time.perf_counter() - t0
            return tree
        draft = self.draft
        if self.shared_cache:
            # The target's cache holds x_1..x_{L-1}: the root's row and the tree's go after
            # them, and are dropped before the target verifies (it writes its own there).
            dcache = session.target_cache
            committed = dcache.length
            fed_here = list(session.target_tokens)  # the substitute's rows go after them
            first = yield from feed_pass(draft, dcache, fed_here, seq[committed:])
        else:
            own, fed = session.draft_cache, session.draft_tokens
            assert own is not None, "a tree session with a draft model has a draft cache"
            dcache = own
            todo = seq[len(fed) :]  # at least the root
            first = yield from feed_pass(draft, dcache, fed, todo)
        tree = DraftTree(root, budget + 1, device)
        root_logits = first.logits[-1].clone()  # (V,) alone: not a view of the whole pass
        del first
        passes = yield from grow_tree_steps(
            draft, dcache, tree, root_logits, len(seq) - 1, budget, depth, policy
        )
        if self.shared_cache:
            dcache.truncate(committed)
        stats.draft_passes += passes + 1
        stats.draft_seconds += time.perf_counter() - t0
        return tree
