"""Which children a drafted tree node gets, and what each is worth.

A draft pass gives the logits after t expanded nodes; each node offers up to `max_branch`
children as candidates for best-first growth (speculative/draft_tree.py). A candidate's value
is the log-probability that verification reaches it: its parent's plus the edge's
calibrated acceptance (speculative/acceptance.py), by its rank among its siblings and its
draft probability. Siblings' values never rise with the rank, so best-first growth always
takes a node's children as a prefix of their order, which rejection verification needs.

Three ways to choose them, one per verification (speculative/verification.py):

- `RankedChildren`: the draft's most likely tokens, for the walk when it draws greedily
  (the target's argmax is then most likely the draft's);
- `CoupledChildren`: for the walk at T > 0, the draft's tokens ranked by log q + g, with g
  the Gumbel noise the walk will draw the target's token with at that position
  (`PositionNoise`): the target's draw is argmax(log p + g), so where q is close to p the
  first child *is* the target's draw. Exactly lossless like any walk (the tree only
  decides how far one pass reaches) and a seed still gives autoregressive decoding's text;
- `SampledChildren`: for rejection verification, children sampled from the draft's final
  distribution q without replacement (Gumbel top-k with the request's generator). Each
  expanded node's draft log-probabilities are kept (fp16, `DraftRows`) so that
  verification meets exactly the q its children were drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from speculative.acceptance import AcceptanceTable
from speculative.grammar import Constraint
from speculative.grammar_masks import mask_rows_
from speculative.sampling import PenaltyContext, PositionNoise, SamplingParams, probabilities

# Children scored per expanded node. Sampling at T=1 spreads the target over many tokens:
# the 17th..32nd child of a flat node can beat a deep guess; more than 32 never helped.
MAX_BRANCH = 32


@dataclass
class Candidates:
    """Children not yet in the tree, flat: (m,) each."""

    values: torch.Tensor  # log P(verification reaches it), estimated
    tokens: torch.Tensor
    parents: torch.Tensor  # node index of the parent
    ranks: torch.Tensor  # 1-based rank among the parent's children
    q: torch.Tensor  # its draft probability at the parent (the calibration's feature)

    def __len__(self) -> int:
        return int(self.values.numel())

    def pick(self, index: torch.Tensor) -> Candidates:
        return Candidates(
            self.values[index], self.tokens[index], self.parents[index], self.ranks[index],
            self.q[index],
        )  # fmt: skip

    def drop(self, index: torch.Tensor) -> Candidates:
        keep = torch.ones_like(self.values, dtype=torch.bool)
        keep[index] = False
        return self.pick(keep)

    def extend(self, other: Candidates) -> Candidates:
        return Candidates(
            torch.cat((self.values, other.values)), torch.cat((self.tokens, other.tokens)),
            torch.cat((self.parents, other.parents)), torch.cat((self.ranks, other.ranks)),
            torch.cat((self.q, other.q)),
        )  # fmt: skip


class TreeView(Protocol):
    """What choosing children reads of the tree being grown (`DraftTree`)."""

    tokens: torch.Tensor  # (C,)
    parents: torch.Tensor  # (C,)
    depths: torch.Tensor  # (C,)
    values: torch.Tensor  # (C,)
    firsts: torch.Tensor  # (C,) first children on the path from the root (the node's own too)

    def path_tokens(self, node: int) -> list[int]: ...


class ChildPolicy(Protocol):
    """Chooses and values the children of expanded nodes."""

    table: AcceptanceTable

    def children(
        self,
        tree: TreeView,
        nodes: torch.Tensor,  # (t,) node indices, expanded by one draft pass
        logits: torch.Tensor,  # (t, V) the draft's logits after each
        room: int,  # the most children that could still be added
    ) -> Candidates: ...


def _valued(
    table: AcceptanceTable,
    tree: TreeView,
    nodes: torch.Tensor,  # (t,)
    tokens: torch.Tensor,  # (t, k) in rank order
    q: torch.Tensor,  # (t, k)
    possible: torch.Tensor,  # (t, k) bool: a child that may be offered
    by_rank_only: bool = False,
) -> Candidates:
    """Flat candidates valued by the table (by rank alone for sampled children: see
    `AcceptanceTable.log_rank_acceptance`), siblings' values decreasing in rank."""
    t, k = tokens.shape
    ranks = torch.arange(1, k + 1, device=tokens.device).expand(t, k)  # (t, k)
    flat_ranks = ranks.reshape(-1).contiguous()
    firsts = tree.firsts[nodes][:, None].expand(t, k).reshape(-1)  # (t k,) the parents'
    if by_rank_only:
        accept = table.log_rank_acceptance(flat_ranks, firsts).view(t, k)
    else:
        accept = table.log_acceptance(flat_ranks, q.reshape(-1), firsts).view(t, k)
    values = tree.values[nodes][:, None] + accept  # (t, k)
    values = values.masked_fill(~possible, float("-inf"))
    # Strictly decreasing along the rank, so that a later sibling never outranks or ties an
    # earlier one: a step of a millionth of the value's size, well above float32's
    # resolution (6e-8 relative) at any magnitude.
    values = torch.cummin(values, dim=1).values
    size = 1.0 + values.abs().nan_to_num(posinf=0.0, neginf=0.0)
    values = values - ranks * 1e-6 * size
    keep = possible.reshape(-1).nonzero().squeeze(1)  # (m,) one sync for all outputs
    return Candidates(
        values.reshape(-1)[keep],
        tokens.reshape(-1)[keep],
        nodes[:, None].expand(t, k).reshape(-1)[keep],
        ranks.reshape(-1)[keep],
        q.reshape(-1)[keep],
    )


def _branch(room: int, vocab: int, max_branch: int) -> int:
    return max(1, min(max_branch, room, vocab))


def _log_probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(t, V) log-softmax of logits / T, the pass's logits scaled in place: with them, the
    only two (t, V) fp32 tensors alive (what the memory plan's draft pass counts)."""
    if temperature != 1.0:
        with torch.inference_mode():  # the pass returned an inference tensor
            logits.div_(temperature)
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass
class RankedChildren:
    """The draft's k most likely tokens (its distribution at `temperature`, 1 for greedy
    requests: only the order and the calibration's feature depend on it)."""

    table: AcceptanceTable
    temperature: float = 1.0
    max_branch: int = MAX_BRANCH

    def children(
        self, tree: TreeView, nodes: torch.Tensor, logits: torch.Tensor, room: int
    ) -> Candidates:
        k = _branch(room, logits.shape[-1], self.max_branch)
        logq = _log_probabilities(logits, self.temperature)  # (t, V)
        top = torch.topk(logq, k, dim=-1)  # (t, k)
        del logq
        possible = top.values > float("-inf")  # a narrower draft's missing ids are -inf
        return _valued(self.table, tree, nodes, top.indices, top.values.exp(), possible)


@dataclass
class CoupledChildren:
    """The draft's tokens ranked by log q + g_pos, g_pos the walk's Gumbel noise at the
    position the target's token after each node is drawn for (`position` is the root's:
    a node at depth d draws position + d)."""

    table: AcceptanceTable
    noise: PositionNoise
    position: int
    temperature: float
    max_branch: int = MAX_BRANCH

    def children(
        self, tree: TreeView, nodes: torch.Tensor, logits: torch.Tensor, room: int
    ) -> Candidates:
        k = _branch(room, logits.shape[-1], self.max_branch)
        keys = _log_probabilities(logits, self.temperature)  # (t, V) log q, then + g
        # log q of the chosen tokens, later, from the (scaled) logits and this row's log
        # normaliser (read off one entry: log q = logit - log Z), so that no noise row
        # outlives its addition and no (t, V) temporary is made.
        best = keys.max(dim=-1, keepdim=True)  # (t, 1)
        log_total = logits.float().gather(1, best.indices) - best.values  # (t, 1)
        depths = tree.depths[nodes].tolist()
        for depth in sorted(set(depths)):  # one noise row per position
            g = self.noise.gumbel([self.position + depth])[0].to(keys.device, keys.dtype)
            for i, d in enumerate(depths):
                if d == depth:
                    keys[i] += g  # in place, row by row: no (rows, V) copy
            del g
        top = torch.topk(keys, k, dim=-1)  # (t, k)
        del keys
        q = (logits.float().gather(1, top.indices) - log_total).exp()  # (t, k)
        possible = top.values > float("-inf")
        return _valued(self.table, tree, nodes, top.indices, q, possible)


class DraftRows:
    """The draft's log-probabilities after every expanded node of a rejection tree, fp16,
    so verification recomputes exactly the q its children were sampled from (the same
    function of the same row). Rows are kept as the draft passes made them, one block per
    pass: the round's nodes times the vocabulary times 2 bytes at most, which the memory
    plan counts (`rejection rows`)."""

    def __init__(self) -> None:
        self._blocks: list[torch.Tensor] = []  # (t, V) fp16 each
        self._where: dict[int, tuple[int, int]] = {}  # node → (block, row)

    def add(self, nodes: Sequence[int], logq: torch.Tensor) -> None:
        self._blocks.append(logq.to(torch.float16))
        block = len(self._blocks) - 1
        for row, node in enumerate(nodes):
            self._where[node] = (block, row)

    def row(self, node: int) -> torch.Tensor:
        """(V,) fp16 log q after `node` (expanded)."""
        block, row = self._where[node]
        return self._blocks[block][row]

    def __contains__(self, node: int) -> bool:
        return node in self._where


def draft_distribution(
    row: torch.Tensor,  # (V,) fp16 stored log-probabilities
    params: SamplingParams,
    penalties: PenaltyContext | None,
    path: Sequence[int],  # tokens from the root's child to the node (the root excluded)
) -> torch.Tensor:
    """(V,) the draft's final distribution after a node: the request's penalties (with the
    node's path counted), temperature and filters applied to its stored row, exactly as
    the target's distribution there is processed."""
    rows = None
    if penalties is not None and params.has_penalties:
        extra = torch.zeros(1, row.shape[-1], device=row.device)  # (1, V) the path's counts
        if path:
            extra[0].index_put_(
                (torch.tensor(list(path), device=row.device),),
                torch.ones(len(path), device=row.device),
                accumulate=True,
            )
        rows = penalties.rows(extra)
        del extra  # (the memory plan's draw figure counts the rows, not this)
    return probabilities(row.float()[None], params, rows)[0]


def _ordered_draw(q: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k tokens of `q` (V,) drawn in order without replacement, (k,): Gumbel top-k, the
    largest log q - log E with E ~ Exp(1) in fp64 (no zero or infinite noise). Where
    top-k, top-p, min-p or a grammar left q a small support, only it is drawn over (the
    same law: a token of q = 0 is never drawn); if it holds fewer than k tokens, tokens of
    q = 0 follow, the lowest ids (children verification skips). Drawing over a whole row
    of 262,144 cost 10 ms a node, most of a rejection tree's round under top_p."""
    whole = 4 * int((q > 0).sum()) > q.numel()
    support = None if whole else (q > 0).nonzero().squeeze(-1)  # (S,)
    drawn = q if support is None else q[support]
    e = torch.empty(drawn.shape, dtype=torch.float64, device=q.device)
    keys = drawn.double().log() - e.exponential_(generator=generator).log()
    del e, drawn
    top = torch.topk(keys, min(k, keys.numel())).indices
    chosen = top if support is None else support[top]
    if chosen.numel() < k:  # q's support is smaller than the branch
        zeros = (q == 0).nonzero().squeeze(-1)[: k - chosen.numel()]
        chosen = torch.cat((chosen, zeros))
    return chosen


@dataclass
class SampledChildren:
    """Children drawn from the draft's final distribution without replacement, in order
    (Gumbel top-k with the request's generator), for rejection verification."""

    table: AcceptanceTable
    params: SamplingParams
    penalties: PenaltyContext | None
    generator: torch.Generator
    rows: DraftRows
    max_branch: int = MAX_BRANCH

    def children(
        self, tree: TreeView, nodes: torch.Tensor, logits: torch.Tensor, room: int
    ) -> Candidates:
        k = _branch(room, logits.shape[-1], self.max_branch)
        logq_all = torch.log_softmax(logits.float(), dim=-1)  # (t, V)
        node_list = nodes.tolist()
        self.rows.add(node_list, logq_all)
        del logq_all
        tokens, qs = [], []
        for node in node_list:
            q = draft_distribution(
                self.rows.row(node), self.params, self.penalties, tree.path_tokens(node)
            )  # (V,)
            chosen = _ordered_draw(q, k, self.generator)
            tokens.append(chosen)
            qs.append(q[chosen])
        # Every child is offered, even one of zero draft probability (where q's support is
        # smaller than the branch): which children there are must not depend on the draws,
        # and verification skips such a child (it can never be accepted).
        stacked = torch.stack(tokens)
        possible = torch.ones_like(stacked, dtype=torch.bool)
        return _valued(
            self.table, tree, nodes, stacked, torch.stack(qs), possible, by_rank_only=True
        )


@dataclass
class ConstrainedChildren:
    """`policy`'s children under a grammar: each expanded node's draft logits are masked
    by the grammar state after that node's own path first, so the draft proposes only
    tokens the grammar allows there (which also raises acceptance: the target's row at
    that node is masked the same way)."""

    policy: ChildPolicy
    constraint: Constraint
    table: AcceptanceTable = field(init=False)  # the policy's

    def __post_init__(self) -> None:
        self.table = self.policy.table

    def children(
        self, tree: TreeView, nodes: torch.Tensor, logits: torch.Tensor, room: int
    ) -> Candidates:
        paths = [tree.path_tokens(node) for node in nodes.tolist()]
        mask_rows_(logits, self.constraint.masks(paths))
        return self.policy.children(tree, nodes, logits, room)


@dataclass
class BiasedChildren:
    """`policy`'s children under the request's `logit_bias`, for the policies that rank
    the draft's own logits (greedy and walk-verified trees): the bias is added to each
    expanded node's draft logits first, so the draft proposes what the biased target
    would draw (rejection's `SampledChildren` biases through the penalties already)."""

    policy: ChildPolicy
    bias: tuple[tuple[int, float], ...]
    table: AcceptanceTable = field(init=False)  # the policy's

    def __post_init__(self) -> None:
        self.table = self.policy.table

    def children(
        self, tree: TreeView, nodes: torch.Tensor, logits: torch.Tensor, room: int
    ) -> Candidates:
        ids = torch.tensor([i for i, _ in self.bias], device=logits.device)
        values = torch.tensor([b for _, b in self.bias], device=logits.device)
        with torch.inference_mode():  # in place: the pass's own (t, V) logits, no copy
            logits.index_add_(-1, ids, values.to(logits.dtype).expand(logits.shape[0], -1))
        return self.policy.children(tree, nodes, logits, room)
