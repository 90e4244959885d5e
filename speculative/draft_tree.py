"""The draft tree (SpecExec): struct-of-tensors, the budgeted best-first builder, and the
ancestor attention masks for drafting and verification.

Node 0 is the root, the last committed token x_L that no model has seen yet. Every other
node is a guessed continuation token whose RoPE position is `root_position + depth`.
Nodes are stored in insertion order and a parent always precedes its children, so the
first b nodes of any tree are themselves a tree: about the one a smaller budget would have
built. `budget.py` uses that to learn, from one round, what every smaller tree yields.

A node's row of the ancestor mask is its parent's row plus itself: True where the column
is the node itself or one of its ancestors (the root included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from modeling.kv_cache import KVCache
from modeling.protocol import Model
from speculative.children import Candidates, ChildPolicy
from speculative.passes import Allot, Steps, forward, run_alone


class DraftTree:
    """Tokens, parents, depths, sibling ranks and estimated log reach probabilities of up
    to `capacity` nodes, preallocated so that growing the tree is a few slice writes."""

    def __init__(self, root_token: int, capacity: int, device: torch.device | str = "cpu"):
        self.capacity = capacity
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)  # (C,)
        self.parents = torch.full((capacity,), -1, dtype=torch.long, device=device)  # (C,)
        self.depths = torch.zeros(capacity, dtype=torch.long, device=device)  # (C,)
        # log P(verification reaches the node), as estimated when it was added (root: 0).
        self.values = torch.zeros(capacity, dtype=torch.float32, device=device)  # (C,)
        self.ranks = torch.zeros(capacity, dtype=torch.long, device=device)  # (C,) 1-based
        self.q = torch.ones(capacity, dtype=torch.float32, device=device)  # (C,) draft prob
        # First children (rank 1) on the path from the root, the node itself included: what
        # the acceptance model conditions a path's next first child on.
        self.firsts = torch.zeros(capacity, dtype=torch.long, device=device)  # (C,)
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)  # (C, C)
        self.tokens[0] = root_token
        self.ancestors[0, 0] = True
        self.size = 1
        # Node indices whose K/V the draft cache holds, in slot order from the root's slot
        # (set by `grow_tree`; nodes that will never be expanded are not fed).
        self.fed = torch.zeros(1, dtype=torch.long, device=device)  # (F,)
        self._paths: dict[int, list[int]] = {0: []}

    def add_candidates(self, chosen: Candidates) -> range:
        """Append candidates whose parents are already in the tree; returns their indices."""
        nodes = self.add(chosen.tokens, chosen.parents, chosen.values)
        self.ranks[nodes.start : nodes.stop] = chosen.ranks
        self.q[nodes.start : nodes.stop] = chosen.q.float()
        self.firsts[nodes.start : nodes.stop] = self.firsts[chosen.parents] + (chosen.ranks == 1)
        return nodes

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, values: torch.Tensor) -> range:
        """Append k nodes whose parents are already in the tree; returns their indices."""
        start, k = self.size, int(tokens.numel())
        end = start + k
        if end > self.capacity:
            raise ValueError(f"tree of capacity {self.capacity} cannot take {end} nodes")
        new = torch.arange(start, end, device=self.tokens.device)  # (k,)
        self.tokens[start:end] = tokens
        self.parents[start:end] = parents
        self.depths[start:end] = self.depths[parents] + 1
        self.values[start:end] = values
        self.ancestors[start:end] = self.ancestors[parents]  # parent's row ...
        self.ancestors[new, new] = True  # ... plus itself
        self.size = end
        return range(start, end)

    @property
    def mask(self) -> torch.Tensor:
        """(N, N) bool: row i attends to node i and its ancestors."""
        return self.ancestors[: self.size, : self.size]

    def token_list(self) -> list[int]:
        return self.tokens[: self.size].tolist()

    def children(self) -> dict[tuple[int, int], int]:
        """(parent index, token) → child index, for the walk."""
        tokens = self.tokens[1 : self.size].tolist()
        parents = self.parents[1 : self.size].tolist()
        return {(p, t): i + 1 for i, (p, t) in enumerate(zip(parents, tokens, strict=True))}

    def path_tokens(self, node: int) -> list[int]:
        """The tokens from the root's child down to `node` (the root's own excluded)."""
        path = self._paths.get(node)
        if path is None:
            parent = int(self.parents[node])
            path = self._paths[node] = [*self.path_tokens(parent), int(self.tokens[node])]
        return path


def default_depth(budget: int) -> int:
    """Depth limit for a fixed budget when none is given: none below the budget itself, so
    that a tree may be a chain of the budget's length (an aligned draft's best tree is
    nearly one); calibrated growth decides how deep it goes."""
    return max(budget, 0)


def grow_tree(
    draft: Model,
    cache: KVCache,
    tree: DraftTree,
    root_logits: torch.Tensor,  # (V,)
    root_position: int,
    budget: int,
    max_depth: int,
    policy: ChildPolicy,
) -> int:
    """`grow_tree_steps` run alone: each draft pass runs at once."""
    return run_alone(
        grow_tree_steps(draft, cache, tree, root_logits, root_position, budget, max_depth, policy)
    )


def step_size(candidates: Candidates, first_child: float, room: int) -> int:
    """How many candidates to add before the next draft pass: those that one-at-a-time
    best-first growth would add before the best candidate's expected first child, i.e.
    every candidate within a factor `first_child` (the calibrated acceptance of a node's
    first child) of the best. An aligned draft's tree (first_child near 1) then grows one
    level per pass down its likely path; a weak draft's, wide levels in few passes."""
    if not len(candidates):
        return 0
    best = float(candidates.values.max())
    near = int((candidates.values >= best + math.log(max(first_child, 1e-9))).sum())
    return max(1, min(near, room))


def grow_tree_steps(
    draft: Model,
    cache: KVCache,
    tree: DraftTree,
    root_logits: torch.Tensor,  # (V,) the draft's logits after the root
    root_position: int,
    budget: int,
    max_depth: int,
    policy: ChildPolicy,
) -> Steps[int]:
    """Best-first growth of `tree` (holding only its root, already fed to `cache` in the last
    slot) to `budget` nodes of depth <= `max_depth`, by the estimated probability that
    verification reaches each node (`policy` chooses and values the children). Each
    iteration adds the best candidates (`step_size`), then runs one draft pass over those
    that may still have children, with the ancestor mask. Nodes added are fed to the draft
    cache in index order, except those that will never be expanded (`tree.fed` lists those
    held); returns the number of draft passes, the root's not counted."""
    device = tree.tokens.device
    root_slot = cache.length - 1
    fed = torch.zeros(1, dtype=torch.long, device=device)  # (F,) node 0, the root
    root = torch.zeros(1, dtype=torch.long, device=device)
    candidates = policy.children(tree, root, root_logits[None, :], budget)
    first_child = policy.table.marginal()[0]
    # A draft pass expands at most half the budget's nodes: its (t, V) logits and the
    # policy's log-probabilities then stay well inside the tree-sized pass the memory plan
    # holds (offload/activations.py), with room for the policy's (V,) rows.
    widest = max(1, budget // 2)
    passes = 0
    added = 0
    while added < budget and len(candidates):
        # Alone a tree takes `step_size` nodes a step; growing beside others for one pass,
        # the driver ranks all their candidates together (speculative/passes.py `allot`).
        wanted = step_size(candidates, first_child, min(budget - added, widest))
        offers = candidates.values  # at most `widest` of them: never granted more
        if len(candidates) > widest:
            offers = torch.topk(offers, widest).values
        request = Allot(offers, wanted)
        yield request
        granted = request.take()
        if granted is None:
            break  # the pass's nodes are spent
        take = min(granted, budget - added, len(candidates))
        if take == 0:
            continue  # others' candidates were better this step: ask again
        best = torch.topk(candidates.values, take).indices  # (take,)
        nodes = tree.add_candidates(candidates.pick(best))
        candidates = candidates.drop(best)
        added += take
        if added >= budget:
            break
        idx = torch.arange(nodes.start, nodes.stop, device=device)  # (take,)
        idx = idx[tree.depths[idx] < max_depth]
        if not idx.numel():
            continue
        fed = torch.cat((fed, idx))
        t = int(idx.numel())
        mask = torch.zeros(t, cache.length + t, dtype=torch.bool, device=device)  # (t, slots)
        mask[:, :root_slot] = True  # the committed prefix
        mask[:, root_slot:] = tree.ancestors[idx][:, fed]  # ancestors among fed tree nodes
        done = yield from forward(
            draft, tree.tokens[idx], root_position + tree.depths[idx], cache, mask=mask
        )
        logits = done.logits  # (t, V)
        passes += 1
        del done
        # This pass's (t, V) logits and the policy's (t, V) log-probabilities are the only
        # vocabulary-wide tensors alive, which the memory plan's tree-sized draft pass covers
        # (t is at most the nodes granted this step, within the budget; in a shared pass
        # every tree's t together are within the pass's rows, `passes.allot`). They go
        # before the next pass: held through it, they would add to its attention working
        # set, which at a long context fills the whole attention chunk.
        new = policy.children(tree, idx, logits, budget - added)
        del logits
        candidates = candidates.extend(new)
        room = budget - added
        if len(candidates) > room:  # only the best `room` can ever be added: keep it short
            candidates = candidates.pick(torch.topk(candidates.values, room).indices)
    tree.fed = fed
    return passes


def tree_from_continuations(
    root_token: int,
    continuations: Sequence[Sequence[int]],
    budget: int,
    max_depth: int,
    device: torch.device | str = "cpu",
) -> DraftTree:
    """A trie of guessed continuations (best first, e.g. from n-gram lookup), cut to `budget`
    nodes and `max_depth` levels. Nodes are inserted level by level, so parents precede
    children and equal prefixes share nodes."""
    index: dict[tuple[int, ...], int] = {(): 0}
    chosen: list[tuple[int, ...]] = []
    for cont in continuations:
        for d in range(1, min(len(cont), max_depth) + 1):
            prefix = tuple(cont[:d])
            if prefix in index:
                continue
            if len(chosen) >= budget:
                break
            index[prefix] = -1
            chosen.append(prefix)
    tree = DraftTree(root_token, len(chosen) + 1, device)
    for depth in range(1, max_depth + 1):
        level = [p for p in chosen if len(p) == depth]
        if not level:
            break
        start = tree.size
        for i, p in enumerate(level):
            index[p] = start + i
        tree.add(
            torch.tensor([p[-1] for p in level], dtype=torch.long, device=device),
            torch.tensor([index[p[:-1]] for p in level], dtype=torch.long, device=device),
            torch.zeros(len(level), device=device),
        )
    return tree


def verification_mask(tree_mask: torch.Tensor, pending: int) -> torch.Tensor:
    """(P + N, P + N) mask for one target pass over P committed tokens the target has not
    seen yet (causal), then the tree (root and nodes see all P, and their ancestors)."""
    n = tree_mask.shape[0]
    t = pending + n
    mask = torch.zeros(t, t, dtype=torch.bool, device=tree_mask.device)
    mask[: pending + 1, : pending + 1] = torch.ones(
        pending + 1, pending + 1, dtype=torch.bool, device=tree_mask.device
    ).tril()
    mask[pending:, :pending] = True
    mask[pending:, pending:] = tree_mask
    return mask
