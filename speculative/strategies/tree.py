"""Tree speculation (SpecExec, Svirschevski et al. 2024): the draft grows a tree of likely
continuations under a node budget, the target scores the whole tree in one pass with an
ancestor mask, and exact sampling walks down the target's own distributions.

The walk, and why it is lossless: at the root, draw a token from the target's FINAL
distribution there (penalties, temperature, top-k/p, min-p; argmax when greedy). If the
token is a child in the tree, the target's distribution after it is already known: move
there and draw again. The first token that is not a child is emitted too and ends the
round (it becomes the next root). Every emitted token is a draw from the target's
distribution given everything before it, whatever the draft proposed; the draft only
decides how far one target pass reaches. Only the nodes the walk visits are drawn (at
most depth + 1 rows, never (nodes × vocabulary) temporaries), with noise keyed by the
token's sequence position (`PositionNoise`): one walk visits one node per position, so its
draws are independent, and a seed gives the same text as autoregressive decoding whatever
the tree looked like.

Round layout (see DESIGN.md): the caches hold x_1..x_{L-1}. One target pass takes the
committed tokens it has not seen yet (the prompt on the first round: prefill folded into
verification, one streamed pass instead of two), the root x_L, and the nodes, at positions
L - 1 + depth. The commit keeps the prefix, the root and the accepted path, in place.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence

import torch

from speculative.budget import AutoBudget, BudgetPlanner, FixedBudget, RoundRecord
from speculative.drafting import check_draft_width
from speculative.generation import PREFILL_CHUNK, Round, RoundStats, Session, prefill
from speculative.model import Transformer
from speculative.ngram import ngram_continuations
from speculative.prefix_cache import PrefixCache
from speculative.sampling import PenaltyContext, PositionNoise, SamplingParams, draw
from speculative.tree import DraftTree, grow_tree, tree_from_continuations, verification_mask

NGRAM_CANDIDATES = 8  # continuations merged into an n-gram tree
GREEDY_SCORE_TEMPERATURE = 0.5


class TreeSpeculation:
    name = "tree"

    def __init__(
        self,
        target: Transformer,
        draft: Transformer | None,
        budget: int | str = "auto",
        max_depth: int | None = None,
        prefix_cache: PrefixCache | None = None,
        ngram_max: int = 3,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        """`draft` None means n-gram drafting (prompt lookup)."""
        if max_depth is not None and max_depth < 1:
            raise ValueError(f"--max-depth must be at least 1, got {max_depth}")
        if draft is not None:
            check_draft_width(draft, target)
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
        return Session(self.target, capacity, self.draft)

    def rounds(
        self,
        session: Session,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        generator: torch.Generator,
    ) -> Generator[Round, None, None]:
        target, cache, pcache = self.target, session.target_cache, self.prefix_cache
        vocab = target.config.vocab_size
        seq = list(prompt_ids)  # committed x_1..x_L; x_L is the root
        stats = RoundStats()
        penalties = (
            PenaltyContext(vocab, prompt_ids, target.device) if params.has_penalties else None
        )
        noise = PositionNoise(generator, vocab)  # the same draws autoregressive decoding makes
        key = pcache.key(seq)  # the prefix cache's id of x_1..x_L
        emitted = 0
        while emitted < max_new_tokens:
            t_round = time.perf_counter()
            tokens: list[int] = []
            # Continuations verified in earlier rounds or requests need no target pass.
            while (
                pcache.max_bytes
                and emitted + len(tokens) < max_new_tokens
                and len(seq) - len(session.target_tokens) < cache.free
            ):
                row = pcache.get(key)  # (V,)
                if row is None:
                    stats.prefix_cache_misses += 1
                    break
                stats.prefix_cache_hits += 1
                tok = int(draw(row[None, :], params, penalties, noise, positions=[len(seq)])[0])
                if penalties is not None:
                    penalties.append([tok])
                tokens.append(tok)
                seq.append(tok)
                key = pcache.child(key, tok)
            left = max_new_tokens - emitted - len(tokens)
            pending = seq[len(session.target_tokens) : -1]
            room = cache.free - len(pending) - 1  # tree nodes that still fit the context
            if left == 0 or room < 0:
                if tokens:
                    stats.verify_seconds += time.perf_counter() - t_round
                    yield Round(tokens, stats)
                return
            shape = self.planner.next_shape()
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
            steps = prefill(
                session,
                seq,
                target,
                self.draft if budget else None,
                fold=fold,
                chunk=self.prefill_chunk,
            )
            for step in steps:
                step.tokens, tokens = tokens, []  # tokens walked above go out first
                emitted += len(step.tokens)
                yield step
                t_round = time.perf_counter()  # others ran meanwhile: not this round's cost
            pending = seq[len(session.target_tokens) : -1]
            if budget == 0 and not pending:
                tok = self._plain_step(session, seq[-1], params, penalties, noise, key)
                if pcache.max_bytes:
                    key = pcache.child(key, tok)
                if penalties is not None:
                    penalties.append([tok])
                seq.append(tok)
                tokens.append(tok)
                stats.target_passes += 1
                stats.budget = shape.budget
                seconds = time.perf_counter() - t_round
                stats.verify_seconds += seconds
                self.planner.observe(RoundRecord(shape, 0, [], 1, seconds, 0.0, 0))
                emitted += len(tokens)
                yield Round(tokens, stats)
                stats = RoundStats()
                continue
            target.prefetch()
            tree = self._draft(session, seq, budget, depth, params, stats)
            draft_seconds = stats.draft_seconds

            t0 = time.perf_counter()
            p = len(pending)
            base = len(session.target_tokens) + p  # the root's slot and position
            nodes = tree.size
            verify_tokens = torch.cat(
                (
                    torch.tensor(pending, dtype=torch.long, device=tree.tokens.device),
                    tree.tokens[:nodes],
                )
            )  # (P + N,)
            positions = torch.cat(
                (
                    torch.arange(base - p, base, device=tree.tokens.device),
                    base + tree.depths[:nodes],
                )
            )  # (P + N,)
            mask = verification_mask(tree.mask, p) if nodes > 1 else None
            logits = target(verify_tokens, positions, cache, mask=mask, logits_from=p)  # (N, V)
            # The tree's structure on the host, fetched once for the walk, the cache's keys
            # and the commit.
            node_tokens, parents = tree.token_list(), tree.parents[:nodes].tolist()
            children = {(parents[v], node_tokens[v]): v for v in range(1, nodes)}
            new, path = walk(tree, logits, params, penalties, noise, len(seq), children)
            tokens.extend(new)
            key = self._remember(logits, key, path, node_tokens, parents)
            if pcache.max_bytes:
                key = pcache.child(key, tokens[-1])

            # Commit: prefix, root, accepted path; both caches in place.
            session.target_tokens.extend(pending)
            session.target_tokens.append(seq[-1])
            cache.keep([base + i for i in path], start=base + 1)
            session.target_tokens.extend(node_tokens[i] for i in path)
            self._commit_draft(session, tree, path, node_tokens)
            seq.extend(new)  # (the walk counted them in `penalties` already)

            stats.target_passes += 1
            stats.drafted += nodes - 1
            stats.accepted += len(path)
            stats.tree_nodes += nodes - 1
            stats.budget = shape.budget
            stats.verify_seconds += time.perf_counter() - t0
            self.planner.observe(
                RoundRecord(
                    shape=shape,
                    nodes=nodes - 1,
                    path=path,
                    verify_tokens=p + nodes,
                    round_seconds=time.perf_counter() - t_round,
                    draft_seconds=draft_seconds,
                    draft_passes=stats.draft_passes,
                )
            )
            emitted += len(tokens)
            yield Round(tokens, stats)
            stats = RoundStats()

    def _plain_step(
        self,
        session: Session,
        root: int,
        params: SamplingParams,
        penalties: PenaltyContext | None,
        noise: PositionNoise,
        key: int,
    ) -> int:
        """No tree: one target step on the root, as cheap as autoregressive decoding (auto
        falls back to this where speculation does not pay)."""
        target = self.target
        pos = len(session.target_tokens)
        logits = target(
            torch.tensor([root], device=target.device),
            torch.tensor([pos], device=target.device),
            session.target_cache,
        )  # (1, V)
        session.target_tokens.append(root)
        if self.prefix_cache.max_bytes:
            self.prefix_cache.put_rows([key], logits, walked=1)  # drawn from below
        return int(draw(logits, params, penalties, noise, positions=[pos + 1])[0])

    def _draft(
        self,
        session: Session,
        seq: list[int],
        budget: int,
        depth: int,
        params: SamplingParams,
        stats: RoundStats,
    ) -> DraftTree:
        """The round's tree (just the root when budget is 0). The draft model's first pass
        takes what it has not seen with the root: at most a chunk, `prefill` fed the rest
        in earlier steps."""
        device = self.target.device
        root = seq[-1]
        if budget < 1:
            return DraftTree(root, 1, device)
        t0 = time.perf_counter()
        if self.draft is None:
            found = ngram_continuations(
                seq, max_ngram=self.ngram_max, max_len=depth, max_candidates=NGRAM_CANDIDATES
            )
            tree = tree_from_continuations(root, found, budget, depth, device)
            stats.draft_seconds += time.perf_counter() - t0
            return tree
        draft, dcache, fed = self.draft, session.draft_cache, session.draft_tokens
        assert dcache is not None, "a tree session with a draft model has a draft cache"
        todo = seq[len(fed) :]  # at least the root
        start = len(fed)
        root_logits = draft(
            torch.tensor(todo, dtype=torch.long, device=draft.device),
            torch.arange(start, start + len(todo), device=draft.device),
            dcache,
            last_only=True,
        )[0]  # (V,)
        fed.extend(todo)
        tree = DraftTree(root, budget + 1, device)
        # Rank guesses as the target will choose: sharply when greedy (0.5 measured best on
        # the stories pair), at the request's temperature when sampling.
        score_temperature = GREEDY_SCORE_TEMPERATURE if params.greedy else params.temperature
        passes = grow_tree(
            draft,
            dcache,
            tree,
            root_logits,
            len(seq) - 1,
            budget,
            depth,
            score_temperature=score_temperature,
        )
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
            return  # no draft model, or it drafted nothing this round
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
        nodes in the tree's best-first order (node indices: the builder adds the highest
        cumulative draft probability first). Parents come before their children in that
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


def walk(
    tree: DraftTree,
    logits: torch.Tensor,  # (N, V) the target's logits at every node
    params: SamplingParams,
    penalties: PenaltyContext | None,
    noise: PositionNoise,
    position: int,  # sequence position of the token drawn at the root
    children: dict[tuple[int, int], int] | None = None,  # tree.children(), if fetched already
) -> tuple[list[int], list[int]]:
    """Exact sampling down the tree: (tokens emitted, accepted node indices). Only the rows
    the walk visits are drawn: node v at depth d draws position `position + d` with the
    penalty counts of the tokens on its path, exactly what drawing every node would give
    there. `penalties` is advanced by every emitted token."""
    if children is None:
        children = tree.children() if tree.size > 1 else {}
    # Plain greedy is one argmax per row, (N,), no (N, V) temporary: one op instead of a
    # synchronising op per step of the walk.
    argmax = logits.argmax(-1).tolist() if params.greedy and not params.has_penalties else None
    tokens: list[int] = []
    path: list[int] = []
    node = 0
    while True:
        at = [position + len(path)]  # node's depth is len(path)
        if argmax is not None:
            tok = argmax[node]
        else:
            tok = int(draw(logits[node : node + 1], params, penalties, noise, positions=at)[0])
        tokens.append(tok)
        if penalties is not None:
            penalties.append([tok])  # counted for the child's draw, and for later rounds
        child = children.get((node, tok))
        if child is None:
            return tokens, path
        path.append(child)
        node = child
