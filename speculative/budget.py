"""How big a tree to build: the shapes, what a round reports, and the fixed budget.

A planner (`BudgetPlanner`) gives each round a `TreeShape` (a node budget and a depth
limit; budget 0 is a plain target step) and learns from the `RoundRecord` the round
reports. `FixedBudget` always gives the configured shape; `AutoBudget`
(speculative/auto_budget.py) chooses it from the costs measured on the running machine,
with `choose_shape`, the rule both it and the step-timing script use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from speculative.draft_tree import default_depth
from speculative.pass_costs import CostLine, MarginalCost

# The largest tree `auto` explores: the memory plan reserves a pass this big, and requests
# may not ask for more nodes than the plan holds (see `max_tree_budget`).
AUTO_MAX_BUDGET = 256


def check_max_depth(depth: int | None) -> None:
    """A tree's depth limit: None (chosen with the budget) or at least one level."""
    if depth is not None and depth < 1:
        raise ValueError(f"--max-depth must be at least 1, got {depth}")


def max_tree_budget(budget: int | str) -> int:
    """The most tree nodes a strategy built with `budget` (a node count, or "auto") verifies
    in one pass: what memory must be planned for."""
    return AUTO_MAX_BUDGET if budget == "auto" else int(budget)


@dataclass(frozen=True)
class TreeShape:
    budget: int  # nodes besides the root; 0 = no tree, a plain target step
    depth: int

    @property
    def draft_passes(self) -> int:
        return self.depth if self.budget else 0


@dataclass
class RoundRecord:
    """What a finished round tells the planner."""

    shape: TreeShape  # what was asked for
    nodes: int  # nodes actually built (room and drafts may give fewer)
    path: list[int]  # accepted node indices, root excluded, in path order
    verify_tokens: int  # tokens in the target pass (pending + root + nodes)
    round_seconds: float  # the whole round, drafting included
    draft_seconds: float  # tree growth only, catch-up feeding excluded
    draft_passes: int
    # The target pass the round rode in: the generations it carried, all of their tokens
    # and its seconds (alone: 1, verify_tokens and the verification's seconds).
    sequences: int = 1
    pass_tokens: int = 0
    pass_seconds: float = 0.0


class BudgetPlanner(Protocol):
    # Why the last `next_shape` chose what it did, in a sentence (the stats' budget_reason).
    reason: str

    def next_shape(self) -> TreeShape: ...

    def observe(self, record: RoundRecord) -> None: ...


@dataclass
class FixedBudget:
    budget: int
    depth: int | None = None

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"tree budget must be >= 0 nodes, got {self.budget}")
        check_max_depth(self.depth)
        depth = self.depth if self.depth is not None else default_depth(self.budget)
        self.shape = TreeShape(self.budget, min(depth, self.budget))
        self.reason = (
            f"fixed: speculation.budget {self.budget}"
            if self.budget
            else "fixed: budget 0, plain decoding"
        )

    def next_shape(self) -> TreeShape:
        return self.shape

    def observe(self, record: RoundRecord) -> None:
        pass


def choose_shape(
    expected_tokens: dict[TreeShape, float],
    target: CostLine | MarginalCost,
    draft_seconds: Callable[[TreeShape], float],
    plain_seconds: float | None = None,
) -> TreeShape:
    """The shape with the best predicted tokens per second. Budget 0, a plain target step
    that yields exactly one token and drafts nothing, is always a candidate; its measured
    cost (`plain_seconds`, else the line at one token) is used as is, since a plain step
    skips the tree bookkeeping that every tree round pays."""
    best = TreeShape(0, 0)
    best_rate = 1.0 / (plain_seconds if plain_seconds is not None else target.predict(1))
    for shape, tokens in expected_tokens.items():
        rate = tokens / (target.predict(1 + shape.budget) + draft_seconds(shape))
        if rate > best_rate:
            best, best_rate = shape, rate
    return best
