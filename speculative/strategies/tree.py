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
is the walk over a chain).

Round layout (see DESIGN.md): the caches hold x_1..x_{L-1}. One target pass takes the
committed tokens it has not seen yet (the prompt on the first round: prefill folded into
verification, one streamed pass instead of two), the root x_L, and the nodes, at positions
L - 1 + depth. The commit keeps the prefix, the root and the accepted path, in place.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from speculative.acceptance import (
    TREE_VERIFICATION_CHOICES,
    AcceptanceModel,
    AcceptanceTable,
)
from speculative.budget import AutoBudget, BudgetPlanner, FixedBudget, RoundRecord
from speculative.children import (
    BiasedChildren,
    ChildPolicy,
    ConstrainedChildren,
    CoupledChildren,
    DraftRows,
    RankedChildren,
    SampledChildren,
)
from speculative.draft_tree import (
    DraftTree,
    grow_tree_steps,
    verification_mask,
)
from speculative.drafting import check_draft_width
from speculative.grammar import MAX_FORCED, Constraint, forced_logprobs, masked
from speculative.kv_cache import KVCache
from speculative.model import Transformer
from speculative.ngram import ngram_tree
from speculative.passes import Steps, feed_pass, forward
from speculative.prefill import PREFILL_CHUNK, prefill
from speculative.prefix_cache import PrefixCache
from speculative.rounds import DraftedTree, Round, RoundStats, RoundSteps
from speculative.sampling import (
    PenaltyContext,
    PositionNoise,
    SamplingParams,
    TokenLogprob,
    draw,
    token_logprob,
)
from speculative.session import Session
from speculative.verification import Verified, rejection_walk, walk

# With `auto` at T > 0, rejection's first rounds in a temperature regime come first. Where
# its first children are accepted this often, it stays: one sampled child accepted with
# probability 1 - TV(p, q) is the best any coupling of two draws can do, which bounds the
# walk's first child too. Below it, the walk is tried for as many rounds, then the one with
# more tokens per round is used, and one round in EXPLORE_EVERY the other, so that a change
# in the text is noticed.
EXPLORE_ROUNDS = 4
REJECTION_STAYS = 0.9
EXPLORE_EVERY = 32
# With the substitute (a shared KV cache), committed tokens the target has not seen yet ride
# in the first draft pass and the verification pass when they are this few; more (a long
# prompt) go first in plain target passes, whose rows the substitute then attends over.
SHARED_FOLD = 64
# Greedy trees rank and calibrate children by the draft's distribution sharpened at this
# temperature: a small draft's flat distributions crowd into two or three probability bins
# at T=1, sharpened they spread over more and calibration tells them apart (the stories
# pair, 24 prompts: 4.26 -> 4.35 tokens per pass at budget 16, 5.43 -> 5.60 at 64).
GREEDY_FEATURE_TEMPERATURE = 0.5


@dataclass
class _Walker:
    """One generation's sampling state across rounds: the committed sequence x_1..x_L (x_L
    is the root), its prefix-cache key, the penalty counts and the position-keyed noise."""

    seq: list[int]
    key: int
    penalties: PenaltyContext | None
    noise: PositionNoise
    params: SamplingParams
    generator: torch.Generator  # rejection verification's draws
    constraint: Constraint | None = None  # the request's grammar, at the committed tokens
    emitted: int = 0

    # The round's emitted tokens' log-probabilities, when the request asked for them.
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def note_logprob(
        self, row: torch.Tensor, token: int, words: torch.Tensor | None = None
    ) -> None:
        """Keep `token`'s log-probability under `row` (V,), the target's logits where it
        was drawn (masked by the grammar's `words` there, under a grammar), if the
        request asked for log-probabilities."""
        if self.params.logprobs is not None:
            if words is not None:
                row = masked(row, words)
            self.logprobs.append(token_logprob(row, token, self.params.logprobs))

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """What was noted since the last call (None when not asked for)."""
        if self.params.logprobs is None:
            return None
        taken, self.logprobs = self.logprobs, []
        return taken

    def draw(self, logits: torch.Tensor, position: int) -> int:
        """One exact sample from a (1, V) row at sequence `position` (masked by the
        grammar's state, under one), counted for the penalties of the draws after it and
        committed to the grammar; its log-probability noted."""
        words = self.constraint.words() if self.constraint is not None else None
        row = masked(logits, words) if words is not None else logits
        tok = int(draw(row, self.params, self.penalties, self.noise, positions=[position])[0])
        del row
        if self.penalties is not None:
            self.penalties.append([tok])
        if self.constraint is not None:
            self.constraint.commit([tok])
        self.note_logprob(logits[0], tok, words)
        return tok


class TreeSpeculation:
    name = "tree"
    pass_rows = 1  # the root's; the nodes' rows are granted per pass (passes.allot)

    def __init__(
        self,
        target: Transformer,
        draft: Transformer | None,
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
        `shared_cache`: the draft is the target's substitute (speculative/substitute.py):
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
        vocab = self.target.config.vocab_size
        state = _Walker(
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
            fold = max(self.prefill_chunk, budget + 1) - (budget + 1)
            draft = self.draft if budget else None
            if self.shared_cache and budget:
                # The substitute drafts on the target's rows: they hold the committed
                # tokens but the last few (forced ones, prefix-cache walks, a short
                # prompt), which its first draft pass takes with the root; a longer
                # prompt goes first in plain target passes.
                fold, draft = min(fold, SHARED_FOLD), None
            caught_up = prefill(
                session, state.seq, self.target, draft, fold=fold, chunk=self.prefill_chunk
            )
            for step in caught_up:
                if isinstance(step, Round):
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
                kind, table = self._verification_kind(params)
                stats.tree_verification = kind
                stats.acceptance_estimate = table.expected_tokens(budget)
                rows = DraftRows() if kind == "rejection" else None
                drafted_with = state.penalties.copy() if state.penalties is not None else None
                policy = self._policy(state, table, rows, drafted_with)
                tree = yield from self._draft(session, state.seq, budget, depth, policy, stats)
                t0 = time.perf_counter()
                verified = yield from forward(
                    self.target, *self._verification(session, state.seq, tree)
                )
                drafted = self._accept(
                    session, state, tree, verified.logits, tokens, table, rows, drafted_with
                )
                # The draft's rows go now: the plan counts them until verification only.
                del rows, policy, drafted_with
                own_tokens = verified.segment_tokens
                shared = (verified.sequences, verified.tokens, verified.seconds)
                del verified  # its logits (a view of the whole pass's) go before the next pass
                path = drafted.path
                stats.target_passes += 1
                stats.drafted += tree.size - 1
                stats.accepted += len(path)
                stats.tree_nodes += tree.size - 1
                stats.budget = shape.budget
                stats.verify_seconds += time.perf_counter() - t0
                # A round in a pass shared with other generations teaches `auto` the pass's
                # cost by its tokens, and each tree is then charged its marginal cost
                # (speculative/budget.py `MarginalCost`); under concurrency the forest's
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

    def _verification_kind(self, params: SamplingParams) -> tuple[str, AcceptanceTable]:
        """This round's verification and the acceptance statistics it grows by: the walk
        for greedy rounds and n-gram trees; else the configured one, or with `auto` the
        one that yields more tokens per round (see EXPLORE_ROUNDS). `auto` walks a
        request with a seed: the walk's text is autoregressive decoding's for that seed
        whatever the tree, while rejection's depends on the tree's shape, which changes
        as acceptance is learned."""
        model = self.acceptance
        walks = self.verification == "walk" or (
            self.verification == "auto" and params.seed is not None
        )
        if self.draft is None or params.greedy or walks:
            return "walk", model.table("walk", params)
        if self.verification == "rejection":
            return "rejection", model.table("rejection", params)
        walk_t, reject_t = model.table("walk", params), model.table("rejection", params)
        if reject_t.rounds < EXPLORE_ROUNDS or reject_t.marginal()[0] >= REJECTION_STAYS:
            return "rejection", reject_t
        if walk_t.rounds < EXPLORE_ROUNDS:
            return "walk", walk_t
        chosen = "walk" if walk_t.recent > reject_t.recent else "rejection"
        if (walk_t.rounds + reject_t.rounds) % EXPLORE_EVERY == 0:
            chosen = "rejection" if chosen == "walk" else "walk"
        return chosen, walk_t if chosen == "walk" else reject_t

    def _policy(
        self,
        state: _Walker,
        table: AcceptanceTable,
        rows: DraftRows | None,
        drafted_with: PenaltyContext | None,
    ) -> ChildPolicy:
        """How the round's tree gets its children (speculative/children.py)."""
        params = state.params
        policy: ChildPolicy
        if rows is not None:
            policy = SampledChildren(table, params, drafted_with, state.generator, rows)
        elif params.greedy:
            policy = RankedChildren(table, temperature=GREEDY_FEATURE_TEMPERATURE)
        else:
            policy = CoupledChildren(table, state.noise, len(state.seq), params.temperature)
        if rows is None and params.logit_bias:
            policy = BiasedChildren(policy, params.logit_bias)
        if state.constraint is not None:
            return ConstrainedChildren(policy, state.constraint)
        return policy

    def _walk_cached(
        self, session: Session, state: _Walker, stats: RoundStats, max_new_tokens: int
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

    def _take_forced(self, state: _Walker, constraint: Constraint, room: int) -> list[int]:
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

    def _verification(
        self, session: Session, seq: list[int], tree: DraftTree
    ) -> tuple[torch.Tensor, torch.Tensor, KVCache, torch.Tensor | None, int]:
        """Phase 3, what this generation wants verified: the committed tokens the target
        has not seen (causal), the root and the tree (ancestor mask), logits for the tree
        only. Arguments of `forward`."""
        pending = seq[len(session.target_tokens) : -1]
        p, nodes, device = len(pending), tree.size, tree.tokens.device
        base = len(session.target_tokens) + p  # the root's slot and position
        tokens = torch.cat(
            (torch.tensor(pending, dtype=torch.long, device=device), tree.tokens[:nodes])
        )  # (P + N,)
        positions = torch.cat(
            (torch.arange(base - p, base, device=device), base + tree.depths[:nodes])
        )  # (P + N,)
        mask = verification_mask(tree.mask, p) if nodes > 1 else None
        return tokens, positions, session.target_cache, mask, p

    def _accept(
        self,
        session: Session,
        state: _Walker,
        tree: DraftTree,
        logits: torch.Tensor,  # (N, V) the target's logits at every node
        tokens: list[int],  # this round's emitted tokens so far: extended
        table: AcceptanceTable,
        rows: DraftRows | None,  # the draft's rows, when the tree is verified by rejection
        drafted_with: PenaltyContext | None,  # the penalty counts it was drafted with
    ) -> DraftedTree:
        """Phase 4, what to do with the target's output: verify the tree (teaching `table`
        what verification did), remember the verified rows, commit prefix + root +
        accepted path to both caches. Returns the tree as host lists with the accepted
        path (node indices)."""
        pending = state.seq[len(session.target_tokens) : -1]
        base = len(session.target_tokens) + len(pending)
        # The tree's structure on the host, fetched once for the verification, the cache's
        # keys and the commit.
        node_tokens, parents = tree.token_list(), tree.parents[: tree.size].tolist()
        verified: Verified
        if rows is not None:
            verified = rejection_walk(
                node_tokens, parents, tree.ranks[: tree.size].tolist(), logits, rows,
                state.params, state.penalties, drafted_with, state.generator, state.constraint,
            )  # fmt: skip
        else:
            verified = walk(
                node_tokens, parents, logits, state.params, state.penalties, state.noise,
                len(state.seq), state.constraint,
            )  # fmt: skip
        self._learn(tree, verified, table)
        new, path = verified.tokens, verified.path
        tokens.extend(new)
        masks: list[torch.Tensor | None] = [*verified.masks] or [None] * len(new)
        for node, tok, words in zip([0, *path], new, masks, strict=False):  # where drawn
            state.note_logprob(logits[node], tok, words)
        state.key = self._remember(logits, state.key, path, node_tokens, parents)
        if self.prefix_cache.max_bytes:
            state.key = self.prefix_cache.child(state.key, new[-1])
        session.target_tokens.extend(pending)
        session.target_tokens.append(state.seq[-1])
        session.target_cache.keep([base + i for i in path], start=base + 1)
        session.target_tokens.extend(node_tokens[i] for i in path)
        self._commit_draft(session, tree, path, node_tokens)
        state.seq.extend(new)  # (the walk counted them in `penalties` already)
        return DraftedTree(node_tokens, parents, path)

    def _plain_step(
        self, session: Session, state: _Walker
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

    @staticmethod
    def _learn(tree: DraftTree, verified: Verified, table: AcceptanceTable) -> None:
        """Every child of every node verification visited is a trial of its (rank, draft
        probability) cell; the one it moved to is a success."""
        tried = [child for visit in verified.visits for child in visit.children]
        if tried:
            index = torch.tensor(tried, device=tree.ranks.device)
            moved = {visit.moved_to for visit in verified.visits}
            table.observe(
                tree.ranks[index], tree.q[index], torch.tensor([c in moved for c in tried])
            )
        table.note_round(len(verified.tokens))

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

    def _commit_draft(
        self, session: Session, tree: DraftTree, path: list[int], node_tokens: list[int]
    ) -> None:
        """Keep the accepted nodes the draft has K/V for (a prefix of the path: the last
        level is never fed); the rest is fed next round with the new root."""
        dcache = session.draft_cache
        if dcache is None or tree.size == 1:
            return  # no draft cache (prompt lookup, or the substitute's shared one), or no tree
        root_slot = len(session.draft_tokens) - 1
        slot_of = {n: j for j, n in enumerate(tree.fed.tolist())}
        kept: list[int] = []
        for n in path:
            if n not in slot_of:
                break
            kept.append(n)
        dcache.keep([root_slot + slot_of[n] for n in kept], start=root_slot + 1)
        session.draft_tokens.extend(node_tokens[n] for n in kept)

    def _remember(
        self,
        logits: torch.Tensor,  # (N, V) the target's logits at every node
        root_key: int,
        path: list[int],
        tokens: list[int],  # (N,) each node's token
        parents: list[int],  # (N,) each node's parent (the root's is unused)
    ) -> int:
        """Cache the target's logits at the verified nodes under their prefixes' keys, as
        many as the cache holds, most valuable first: the root and the walked path (the
        next sample of this prompt with this seed walks exactly there), then the other
        nodes in the tree's best-first order (node indices: the builder adds the nodes most
        likely to be reached first). Parents come before their children in that
        order, so every stored node's prefix is interned. Returns the key of the walk's
        last node (the root's with the cache off: keys are not needed then)."""
        pcache = self.prefix_cache
        if not pcache.max_bytes:
            return root_key
        keys = {0: root_key}
        on_path = set(path)
        order = [0, *path, *(v for v in range(1, len(tokens)) if v not in on_path)]
        stored = order[: pcache.capacity_rows(logits.shape[1], self.target.dtype)]
        for v in order[1 : max(len(stored), 1 + len(path))]:
            keys[v] = pcache.child(keys[parents[v]], tokens[v])
        pcache.put_rows([keys[v] for v in stored], logits, stored, walked=1 + len(path))
        return keys[path[-1]] if path else root_key
