"""A tree round's verification, from choosing it to committing what it accepted
(speculative/strategies/tree.py runs the round and asks for its passes): which verification
the round uses (`auto` tries the walk and rejection sampling and keeps the one that yields
more), the children the draft's tree gets for it, the target's segment (the pending tokens,
the root and the tree), and `accept`: the walk or rejection sampling over the target's
logits (speculative/verification.py), what it teaches the acceptance table, the verified
rows kept in the prefix cache and the accepted path kept in both KV caches. `Walker` is a
generation's sampling state, which every draw of a round uses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from modeling.kv_cache import KVCache
from speculative.acceptance import AcceptanceModel, AcceptanceTable
from speculative.children import (
    BiasedChildren,
    ChildPolicy,
    ConstrainedChildren,
    CoupledChildren,
    DraftRows,
    RankedChildren,
    SampledChildren,
)
from speculative.draft_tree import DraftTree, verification_mask
from speculative.grammar import Constraint
from speculative.grammar_masks import masked
from speculative.prefix_cache import PrefixCache
from speculative.rounds import DraftedTree
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

# With `auto` at T > 0, rejection's first REJECTION_FIRST rounds in a temperature regime
# come first. Where its first children are accepted REJECTION_STAYS of the time, it stays:
# one sampled child accepted with probability 1 - TV(p, q) is the best any coupling of two
# draws can do, which bounds the walk's first child too. Below it, the walk is tried for
# EXPLORE_ROUNDS rounds, then the one with more tokens per round is used, and one
# generation in EXPLORE_GENERATIONS starts with the other, so that a change in the text is
# noticed. The walk is tried, or explored, only as a generation starts: a generation that
# walked walks on (`choose_verification`), so a walk explored mid-generation kept it for
# the rest of its rounds, however much better rejection was. A round's yield at
# T > 0 varies about as much as its mean, so the walk must beat rejection by 1/sqrt(its
# rounds) of rejection's mean before it is used (45% after its first 5 rounds, 10% after
# 100): rejection, whose rounds a chain's cannot beat, is kept unless the walk is seen to
# yield more. Measured on cold 128-token runs (the stories model with its 2-, 3- and
# 4-bit substitute, T=1, 6 seeds: scripts/bench_realtext.py's cells), exploring after 4
# rounds on a bare comparison flipped between the two on noise, each learning from half
# the rounds, and gave fewer tokens per pass than either alone (4 bits: 7.9 against 8.5
# walking and 8.9 rejecting); now 9.1 (and 1.86 at 2 bits, against 1.90 rejecting and
# 1.76 before; 4.57 at 3 bits, where walking gives 4.77 and rejecting 4.47).
EXPLORE_ROUNDS = 4
REJECTION_FIRST = 16
REJECTION_STAYS = 0.9
EXPLORE_GENERATIONS = 8
# Greedy trees rank and calibrate children by the draft's distribution sharpened at this
# temperature: a small draft's flat distributions crowd into two or three probability bins
# at T=1, sharpened they spread over more and calibration tells them apart (the stories
# pair, 24 prompts: 4.26 -> 4.35 tokens per pass at budget 16, 5.43 -> 5.60 at 64).
GREEDY_FEATURE_TEMPERATURE = 0.5


@dataclass
class Walker:
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
    # A tree drawn by the noise was walked (T > 0): every later round walks, as the noise
    # of positions past the walk shaped where it stopped (`choose_verification`).
    coupled: bool = False
    trees: int = 0  # tree rounds so far (the first chooses its verification afresh)

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


def choose_verification(
    setting: str,
    model: AcceptanceModel,
    params: SamplingParams,
    ngram: bool,
    walked: bool = False,
    first: bool = True,
) -> tuple[str, AcceptanceTable]:
    """This round's verification and the acceptance statistics it grows by: the walk
    for greedy rounds and n-gram trees; else the configured one, or with `auto` the
    one that yields more tokens per round (see EXPLORE_ROUNDS). `auto` walks a
    request with a seed: the walk's text is autoregressive decoding's for that seed
    whatever the tree, while rejection's depends on the tree's shape, which changes
    as acceptance is learned.

    `walked`: this generation has walked a tree at T > 0 (`Walker.coupled`); it walks on.
    Such a tree's children were drawn by the noise of positions the walk has not reached
    yet (the depth-d children by position d's, competing for one budget across depths),
    so where the walk stopped depends on that noise. Walking on, each position is still
    the draw its own noise makes; a rejection round would draw those positions afresh
    on exactly the outcomes where the walk stopped short, and their law would no longer
    be the target's (a reviewer measured P = 0.217 for a token of probability 0.25).
    Rejection rounds use no noise, so the walk may follow them. `first`: the generation's
    first tree round, where the walk is tried or explored (see EXPLORE_ROUNDS); later
    rounds move to the walk only where it yields clearly more."""
    walks = setting == "walk" or (setting == "auto" and (params.seed is not None or walked))
    if ngram or params.greedy or walks:
        return "walk", model.table("walk", params)
    if setting == "rejection":
        return "rejection", model.table("rejection", params)
    walk_t, reject_t = model.table("walk", params), model.table("rejection", params)
    if reject_t.rounds < REJECTION_FIRST or reject_t.marginal()[0] >= REJECTION_STAYS:
        return "rejection", reject_t
    if walk_t.rounds < EXPLORE_ROUNDS:
        return ("walk", walk_t) if first else ("rejection", reject_t)
    margin = 1.0 + 1.0 / math.sqrt(walk_t.rounds)
    chosen = "walk" if walk_t.recent > reject_t.recent * margin else "rejection"
    if first:
        reject_t.starts += 1
        if reject_t.starts % EXPLORE_GENERATIONS == 0:
            chosen = "rejection" if chosen == "walk" else "walk"
    return chosen, walk_t if chosen == "walk" else reject_t


def child_policy(
    state: Walker,
    table: AcceptanceTable,
    rows: DraftRows | None,
    drafted_with: PenaltyContext | None,
) -> ChildPolicy:
    """How the round's tree gets its children (speculative/children.py), for the
    verification it will have: sampled from the draft for rejection (`rows` kept), else
    ranked (greedy) or coupled to the walk's noise."""
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


def verification_segment(
    session: Session, seq: list[int], tree: DraftTree
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


def accept(
    session: Session,
    state: Walker,
    tree: DraftTree,
    logits: torch.Tensor,  # (N, V) the target's logits at every node
    tokens: list[int],  # this round's emitted tokens so far: extended
    table: AcceptanceTable,
    rows: DraftRows | None,  # the draft's rows, when the tree is verified by rejection
    drafted_with: PenaltyContext | None,  # the penalty counts it was drafted with
    prefix_cache: PrefixCache,
    dtype: torch.dtype,  # the target's: a cached row's dtype where the cache names none
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
    _learn(tree, verified, table)
    new, path = verified.tokens, verified.path
    tokens.extend(new)
    masks: list[torch.Tensor | None] = [*verified.masks] or [None] * len(new)
    for node, tok, words in zip([0, *path], new, masks, strict=False):  # where drawn
        state.note_logprob(logits[node], tok, words)
    state.key = _remember(prefix_cache, dtype, logits, state.key, path, node_tokens, parents)
    if prefix_cache.max_bytes:
        state.key = prefix_cache.child(state.key, new[-1])
    session.target_tokens.extend(pending)
    session.target_tokens.append(state.seq[-1])
    session.target_cache.keep([base + i for i in path], start=base + 1)
    session.target_tokens.extend(node_tokens[i] for i in path)
    _commit_draft(session, tree, path, node_tokens)
    state.seq.extend(new)  # (the walk counted them in `penalties` already)
    return DraftedTree(node_tokens, parents, path)


def _learn(tree: DraftTree, verified: Verified, table: AcceptanceTable) -> None:
    """Every child of every node verification visited is a trial of its (rank, draft
    probability) cell; the one it moved to is a success."""
    tried = [child for visit in verified.visits for child in visit.children]
    if tried:
        index = torch.tensor(tried, device=tree.ranks.device)
        moved = {visit.moved_to for visit in verified.visits}
        table.observe(tree.ranks[index], tree.q[index], torch.tensor([c in moved for c in tried]))
    table.note_round(len(verified.tokens))


def _commit_draft(
    session: Session, tree: DraftTree, path: list[int], node_tokens: list[int]
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
    pcache: PrefixCache,
    dtype: torch.dtype,  # the target's: a cached row's dtype where the cache names none
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
    if not pcache.max_bytes:
        return root_key
    keys = {0: root_key}
    on_path = set(path)
    order = [0, *path, *(v for v in range(1, len(tokens)) if v not in on_path)]
    stored = order[: pcache.capacity_rows(logits.shape[1], dtype)]
    for v in order[1 : max(len(stored), 1 + len(path))]:
        keys[v] = pcache.child(keys[parents[v]], tokens[v])
    pcache.put_rows([keys[v] for v in stored], logits, stored, walked=1 + len(path))
    return keys[path[-1]] if path else root_key
