"""The draft tree (SpecExec): struct-of-tensors, the budgeted best-first builder, and the
ancestor attention masks for drafting and verification.

Node 0 is the root, the last committed token x_L that no model has seen yet. Every other
node is a guessed continuation token whose RoPE position is `root_position + depth`.
Nodes are stored in insertion order and a parent always precedes its children, so the
first b nodes of any tree are themselves a tree: the one a smaller budget would have
built. `budget.py` uses that to learn, from one round, what every smaller tree yields.

A node's row of the ancestor mask is its parent's row plus itself: True where the column
is the node itself or one of its ancestors (the root included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from speculative.kv_cache import KVCache
from speculative.model import Transformer
from speculative.passes import Allot, Steps, forward, run_alone

# Children scored per expanded node. Sampling at T=1 spreads the target over many tokens:
# the 17th..32nd child of a flat node can beat a deep guess (budget 64: 3.44 -> 3.48 tokens
# per round on the stories pair, scripts/tree_acceptance.py); more than 32 never helped.
MAX_BRANCH = 32


class DraftTree:
    """Tokens, parents, depths and cumulative draft log-probabilities of up to `capacity`
    nodes, preallocated so that growing the tree is a few slice writes."""

    def __init__(self, root_token: int, capacity: int, device: torch.device | str = "cpu"):
        self.capacity = capacity
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)  # (C,)
        self.parents = torch.full((capacity,), -1, dtype=torch.long, device=device)  # (C,)
        self.depths = torch.zeros(capacity, dtype=torch.long, device=device)  # (C,)
        self.logprobs = torch.zeros(capacity, dtype=torch.float32, device=device)  # (C,)
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)  # (C, C)
        self.tokens[0] = root_token
        self.ancestors[0, 0] = True
        self.size = 1
        # Node indices whose K/V the draft cache holds, in slot order from the root's slot
        # (set by `grow_tree`; nodes that will never be expanded are not fed).
        self.fed = torch.zeros(1, dtype=torch.long, device=device)  # (F,)

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, logprobs: torch.Tensor) -> range:
        """Append k nodes whose parents are already in the tree; returns their indices."""
        start, k = self.size, int(tokens.numel())
        end = start + k
        if end > self.capacity:
            raise ValueError(f"tree of capacity {self.capacity} cannot take {end} nodes")
        new = torch.arange(start, end, device=self.tokens.device)  # (k,)
        self.tokens[start:end] = tokens
        self.parents[start:end] = parents
        self.depths[start:end] = self.depths[parents] + 1
        self.logprobs[start:end] = logprobs
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


def default_depth(budget: int) -> int:
    """Depth limit for a fixed budget when none is given: deep enough for a well-matched
    draft's runs of agreement, shallow enough to leave room for siblings."""
    if budget <= 0:
        return 0
    return min(budget, max(2, int(math.log2(budget)) + 6))


def grow_tree(
    draft: Transformer,
    cache: KVCache,
    tree: DraftTree,
    root_logits: torch.Tensor,  # (V,)
    root_position: int,
    budget: int,
    max_depth: int,
    batch: int | None = None,
    score_temperature: float = 1.0,
    max_branch: int = MAX_BRANCH,
) -> int:
    """`grow_tree_steps` run alone: each draft pass runs at once."""
    steps = grow_tree_steps(
        draft,
        cache,
        tree,
        root_logits,
        root_position,
        budget,
        max_depth,
        batch=batch,
        score_temperature=score_temperature,
        max_branch=max_branch,
    )
    return run_alone(steps)


def grow_tree_steps(
    draft: Transformer,
    cache: KVCache,
    tree: DraftTree,
    root_logits: torch.Tensor,  # (V,) the draft's logits after the root
    root_position: int,
    budget: int,
    max_depth: int,
    batch: int | None = None,
    score_temperature: float = 1.0,
    max_branch: int = MAX_BRANCH,
) -> Steps[int]:
    """Best-first growth of `tree` (holding only its root, already fed to `cache` in the last
    slot) to `budget` nodes of depth <= `max_depth`. Each iteration adds the best `batch`
    (default `ceil(budget / max_depth)`) frontier candidates by cumulative draft log-probability,
    then runs one draft pass over those that may still have children, with the ancestor
    mask. Candidates are ranked by cumulative log-probability under the draft's logits
    divided by `score_temperature` (below 1 favours deep confident chains over siblings,
    which pays when the target is greedy). Nodes added are fed to the draft cache in index order, except those that will
    never be expanded (`tree.fed` lists those held); returns the number of draft passes,
    the root's not counted."""
    device = tree.tokens.device
    root_slot = cache.length - 1
    if batch is None:
        batch = max(1, math.ceil(budget / max(max_depth, 1)))
    fed = torch.zeros(1, dtype=torch.long, device=device)  # (F,) node 0, the root
    scale = 1.0 / score_temperature
    cand_logp, cand_token, cand_parent = _top_children(
        root_logits[None, :] * scale, tree.logprobs[:1], budget, max_branch
    )  # the root's row is 0, its node index
    passes = 0
    added = 0
    while added < budget and cand_logp.numel():
        # Alone a tree takes `batch` nodes a step; growing beside others for one pass, the
        # driver ranks all their candidates together (speculative/passes.py `allot`).
        request = Allot(cand_logp, min(batch, budget - added, int(cand_logp.numel())))
        yield request
        granted = request.take()
        if granted is None:
            break  # the pass's nodes are spent
        take = min(granted, budget - added, int(cand_logp.numel()))
        if take == 0:
            continue  # others' candidates were better this step: ask again
        best = torch.topk(cand_logp, take).indices  # (take,)
        nodes = tree.add(cand_token[best], cand_parent[best], cand_logp[best])
        keep = torch.ones_like(cand_logp, dtype=torch.bool)
        keep[best] = False
        cand_logp, cand_token, cand_parent = cand_logp[keep], cand_token[keep], cand_parent[keep]
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
        # Scaled in place (the same values as `logits * scale`): this pass's logits and
        # their log-softmax are then the only (t, V) fp32 tensors alive, which the memory
        # plan's tree-sized draft pass covers (t is at most the nodes granted this step,
        # within the budget; in a shared pass every tree's t together are within the
        # pass's rows, `passes.allot`).
        with torch.inference_mode():  # the pass returned an inference tensor
            logits.mul_(scale)
        logp, tok, row = _top_children(logits, tree.logprobs[idx], budget - added, max_branch)
        del done  # (its logits with it)
        # Freed before the next pass: held through it, this pass's (t, V) fp32 logits would
        # add to that pass's attention working set, which at a long context fills the
        # whole attention chunk (the plan reserves one pass's activations, not two).
        del logits
        cand_logp = torch.cat((cand_logp, logp))
        cand_token = torch.cat((cand_token, tok))
        cand_parent = torch.cat((cand_parent, idx[row]))
        room = budget - added
        if cand_logp.numel() > room:  # only the best `room` can ever be added: keep it short
            keep_idx = torch.topk(cand_logp, room).indices  # (room,)
            cand_logp, cand_token = cand_logp[keep_idx], cand_token[keep_idx]
            cand_parent = cand_parent[keep_idx]
    tree.fed = fed
    return passes


def _top_children(
    logits: torch.Tensor,  # (n, V)
    parent_logp: torch.Tensor,  # (n,)
    room: int,
    max_branch: int = MAX_BRANCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best children of n nodes as flat (cumulative log-prob, token, row in 0..n-1)
    candidates. A child of zero draft probability is never a candidate: a draft narrower
    than the target has -inf logits for the ids it lacks (`Transformer.set_vocab_width`),
    and a tiny vocabulary may have fewer possible children than k."""
    k = max(1, min(max_branch, room, logits.shape[-1]))
    logp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    top = torch.topk(logp, k, dim=-1)  # (n, k)
    # One nonzero (one device sync) selects the possible candidates for all three outputs.
    keep = (top.values > float("-inf")).reshape(-1).nonzero().squeeze(1)  # (m,)
    cumulative = (parent_logp[:, None] + top.values).reshape(-1)  # (n * k,)
    return (
        cumulative.index_select(0, keep),
        top.indices.reshape(-1).index_select(0, keep),
        torch.div(keep, k, rounding_mode="floor"),  # the row each candidate came from
    )


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
