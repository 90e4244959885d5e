"""Verifying a draft tree against the target's distributions at its nodes: two exact ways.

**The walk** (SpecExec). At the root, draw a token from the target's final distribution
(penalties, temperature, top-k/p, min-p; argmax when greedy) with the noise of its sequence
position (`PositionNoise`). If the token is a child in the tree, the target's distribution
after it is already known: move there and draw again. The first token that is not a child
is emitted too and ends the round. Every emitted token is a draw from the target's
distribution given everything before it, whatever the draft proposed; the draft only
decides how far one target pass reaches, and a seed gives autoregressive decoding's text.

**Rejection** (SpecInfer, SpecTr, Sequoia), for trees whose children were *sampled* from
the draft's final distribution q without replacement (speculative/children.py). At a node
with target distribution p and children c_1..c_k in their sampled order:

    for j = 1..k:  accept c_j with probability min(1, p(c_j) / q(c_j))   -> move to c_j
                   else p <- norm(max(0, p - q)),  q <- q without c_j, renormalised
    none accepted: emit a draw from p (the last residual) and end the round.

Each step is Leviathan/Chen's rule for one proposal drawn from q: what it emits, accepted
or drawn from the residual, is distributed as p. The next child was drawn from q without
the rejected ones (sampling without replacement), which is exactly the renormalised q the
next step proposes from, and a rejected child has p(c) < q(c), so the residual gives it no
mass and removing it from q loses nothing. By induction the node emits a draw from p. A
tree with one child per node is linear speculative sampling; more children only add
chances. Its draws come from the request's generator, so a seed reproduces the text of
the same tree strategy, but not autoregressive decoding's.

Both walks visit one node per emitted token and draw only those rows (at most depth + 1
rows, never (nodes x vocabulary) temporaries).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculative.children import DraftRows, draft_distribution
from speculative.grammar import Constraint
from speculative.grammar_masks import masked
from speculative.sampling import (
    PenaltyContext,
    PositionNoise,
    SamplingParams,
    draw,
    probabilities,
    residual_distribution,
    sample,
)


@dataclass
class Visit:
    """What verification did at one node it visited: the node's children (node indices, in
    rank order; rejection may stop before the last of them, but each counts as a trial of
    its rank: its chance of being reached includes the earlier ones' rejection) and the
    one it moved to (None: the round ended there)."""

    node: int
    children: list[int]
    moved_to: int | None


@dataclass
class Verified:
    tokens: list[int]  # emitted, in order (the last is the next round's root)
    path: list[int]  # accepted node indices, root excluded
    visits: list[Visit]
    # Under a grammar: the mask words each emitted token was drawn under, in order.
    masks: list[torch.Tensor] = field(default_factory=list)


def _row(
    logits: torch.Tensor, node: int, constraint: Constraint | None, out: Verified
) -> torch.Tensor:
    """(1, V) the target's logits at `node`, masked by the grammar's state there (the
    committed state: the walk commits every token it emits)."""
    row = logits[node : node + 1]
    if constraint is None:
        return row
    words = constraint.words()
    out.masks.append(words)
    return masked(row, words)


def _children_in_rank_order(
    parents: list[int], size: int, ranks: list[int] | None = None
) -> dict[int, list[int]]:
    """node → its children, by rank (`ranks`, each node's among its siblings), else in
    insertion order (best-first growth adds a node's children as a prefix of their ranks,
    speculative/children.py)."""
    kids: dict[int, list[int]] = {}
    for v in range(1, size):
        kids.setdefault(parents[v], []).append(v)
    if ranks is not None:
        for children in kids.values():
            children.sort(key=ranks.__getitem__)
    return kids


def walk(
    tokens_of: list[int],  # (N,) each node's token
    parents: list[int],  # (N,) each node's parent (the root's is unused)
    logits: torch.Tensor,  # (N, V) the target's logits at every node
    params: SamplingParams,
    penalties: PenaltyContext | None,
    noise: PositionNoise,
    position: int,  # sequence position of the token drawn at the root
    constraint: Constraint | None = None,
) -> Verified:
    """Exact sampling down the tree. Node v at depth d draws position `position + d` with
    the penalty counts of the tokens on its path, exactly what drawing every node would
    give there. `penalties` is advanced by every emitted token, and so is `constraint`
    (each row masked by its state first)."""
    size = len(tokens_of)
    kids = _children_in_rank_order(parents, size)
    child_of = {(parents[v], tokens_of[v]): v for v in range(1, size)}
    # Plain greedy is one argmax per row, (N,), no (N, V) temporary: one op instead of a
    # synchronising op per step of the walk.
    plain = params.greedy and not params.has_penalties and constraint is None
    argmax = logits.argmax(-1).tolist() if plain else None
    out = Verified([], [], [])
    node = 0
    while True:
        at = [position + len(out.path)]  # node's depth is len(path)
        if argmax is not None:
            tok = argmax[node]
        else:
            row = _row(logits, node, constraint, out)
            tok = int(draw(row, params, penalties, noise, positions=at)[0])
            del row
        out.tokens.append(tok)
        if penalties is not None:
            penalties.append([tok])  # counted for the child's draw, and for later rounds
        if constraint is not None:
            constraint.commit([tok])
        child = child_of.get((node, tok))
        out.visits.append(Visit(node, kids.get(node, []), child))
        if child is None:
            return out
        out.path.append(child)
        node = child


def rejection_walk(
    tokens_of: list[int],
    parents: list[int],
    ranks: list[int],  # (N,) each node's rank among its siblings, in their sampled order
    logits: torch.Tensor,  # (N, V) the target's logits at every node
    rows: DraftRows,  # the draft's stored rows at every expanded node
    params: SamplingParams,
    penalties: PenaltyContext | None,
    drafted_with: PenaltyContext | None,  # the counts the children were sampled with
    generator: torch.Generator,
    constraint: Constraint | None = None,
) -> Verified:
    """Recursive rejection sampling down a sampled tree (the module's docstring).
    `penalties` is advanced by every emitted token; `drafted_with` is its copy from before
    the round, which with each node's path gives exactly the q its children came from.
    At T=0 the distributions are one-hot and this is the greedy walk over the draft's
    argmax chain."""
    size = len(tokens_of)
    kids = _children_in_rank_order(parents, size, ranks)
    out = Verified([], [], [])
    node = 0
    path_tokens: list[int] = []
    while True:
        rows_now = penalties.rows() if penalties is not None and params.has_penalties else None
        p = probabilities(_row(logits, node, constraint, out), params, rows_now)[0]  # (V,)
        del rows_now
        children = kids.get(node, [])
        moved = None
        if children:
            q = draft_distribution(rows.row(node), params, drafted_with, path_tokens).clone()
            draws = torch.rand(len(children), generator=generator, device=generator.device)
            for j, child in enumerate(children):
                tok = tokens_of[child]
                if not bool(q[tok] > 0):
                    continue  # offered beyond q's support (children.py): never accepted
                # u < p/q holds with probability min(1, p/q); strict, so p(t) = 0 never
                # passes.
                if bool(draws[j] * q[tok] < p[tok]):
                    moved = child
                    break
                p = residual_distribution(p, q)
                q[tok] = 0.0
                mass = q.sum()
                if mass <= 0:
                    break  # q's whole support was tried
                q = q / mass
        out.visits.append(Visit(node, children, moved))
        if moved is None:
            tok = int(sample(p[None], generator)[0])
        else:
            tok = tokens_of[moved]
        out.tokens.append(tok)
        if penalties is not None:
            penalties.append([tok])
        if constraint is not None:
            constraint.commit([tok])
        if moved is None:
            return out
        out.path.append(moved)
        path_tokens.append(tok)
        node = moved
