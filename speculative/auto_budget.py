"""`AutoBudget`: how big a tree to build, chosen from costs measured on the running machine.

Throughput is (DESIGN.md)

    tokens/s = E[tokens per round | tree] / (t_draft(tree) + t_target(1 + budget))

`AutoBudget` learns all three terms from the rounds it sees, with no calibration passes:

- t_target(n): seconds of a tree round outside drafting (the verification pass over n
  tokens plus the walk and commit), as a line fitted through the sizes seen so far
  (`CostLine`, speculative/pass_costs.py). A streamed GPU target gives a nearly flat line,
  a CPU a steep one. A plain step (budget 0) is measured on its own: it skips all tree
  bookkeeping.
- t_draft: seconds per draft pass (catch-up feeding excluded), times the passes a shape
  needs (one per level: the root's pass plus depth - 1).
- E[tokens | budget b, depth d]: every round's tree is a best-first tree whose first b nodes
  are the tree budget b would have grown, and each node's sample is drawn independently of
  the tree's shape, so one round tells how many tokens every smaller tree would have
  accepted: the leading path nodes with index <= b, at most d of them.

It picks the shape with the best predicted rate, including budget 0 (a plain target step,
no drafting at all) when speculation does not pay. Bigger trees are explored (budget
doubling from a small first tree) only while they could still win: a tree of depth d
yields at most d + 1 tokens, so once the costs are measured a shape whose best case
`(d + 1) / (t_target + t_draft)` loses to the current choice is not tried. What exploring
loses (its time minus what its tokens would have cost at the chosen rate) is rationed to
`explore_share` of the time spent. A streamed target, where a bigger tree costs about the
same pass, loses nothing by exploring and so learns quickly; a CPU, where drafting costs as
much as the target, stops after one small tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from speculative.budget import (
    AUTO_MAX_BUDGET,
    RoundRecord,
    TreeShape,
    check_max_depth,
    choose_shape,
)
from speculative.draft_tree import default_depth
from speculative.pass_costs import CostLine, MarginalCost, half_octave

BUDGET_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Depth limits considered: up to the largest budget, since an aligned draft's best tree is
# nearly a chain (calibrated growth makes it one where verification accepts).
DEPTH_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PLAIN_REFRESH_EVERY = 16  # rounds between plain steps while a tree is chosen
# Generations per target pass (a running mean, this weight on the latest) from which a
# tree is charged its marginal cost in the shared pass rather than a lone round's.
SHARING_WEIGHT = 0.2
# Generations per pass (that running mean) from which passes count as shared: a tree is
# then charged its marginal cost, alone its round's own.
SHARED = 1.5


class AutoBudget:
    def __init__(
        self,
        max_budget: int = AUTO_MAX_BUDGET,
        max_depth: int | None = None,
        explore_share: float = 0.02,
        uses_draft_model: bool = True,
    ) -> None:
        self.max_budget = max_budget
        check_max_depth(max_depth)
        self.depth_cap = max_depth if max_depth is not None else DEPTH_GRID[-1]
        self.explore_share = explore_share
        self.uses_draft_model = uses_draft_model
        self.target = CostLine()  # tree rounds: seconds outside drafting vs tokens verified
        self.plain = CostLine()  # plain steps (budget 0)
        # Every target pass (alone or shared): its seconds against all the tokens it
        # carried, and how many generations the recent ones carried.
        self.passes = CostLine()
        self.sharing = 1.0
        self._draft_passes: dict[int, float] = {}  # budget → draft passes per round
        self.draft_unit_seconds = 0.0  # per draft pass, or per n-gram lookup
        self._draft_samples = 0
        self._sums: dict[TreeShape, float] = {}
        self._counts: dict[TreeShape, int] = {}
        self.total_seconds = 0.0
        self.explore_seconds = 0.0
        self._explore_budget = min(2, max_budget)
        self._exploring = False
        self._rate_before = 0.0  # predicted tokens/s of the choice when exploring began
        self._rounds = 0
        self.chosen = TreeShape(0, 0)
        self.reason = "auto: nothing measured yet"
        self._pass_feature: Callable[[float], float] | None = None

    def price_passes_by(self, feature: Callable[[float], float] | None) -> None:
        """What a target pass's cost grows with, as a function of its tokens (None: the
        tokens): a mixture of experts whose experts live off the device passes the expected
        distinct experts its tokens wake (speculative/pass_costs.py)."""
        self._pass_feature = feature
        for line in (self.target, self.passes):
            line.price_by(feature)
        if self._counts:
            self._choose()

    def state(self) -> dict[str, Any]:
        """What the planner measured, as JSON-able values (`load_state` reads it back): the
        cost lines, the draft's pass cost and passes per budget, the tokens each shape
        yielded, and how far exploring has gone."""
        return {
            "target": self.target.state(),
            "plain": self.plain.state(),
            "passes": self.passes.state(),
            "sharing": self.sharing,
            "draft_passes": {str(b): v for b, v in self._draft_passes.items()},
            "draft_unit_seconds": self.draft_unit_seconds,
            "draft_samples": self._draft_samples,
            "shapes": [[s.budget, s.depth, self._sums[s], self._counts[s]] for s in self._counts],
            "total_seconds": self.total_seconds,
            "explore_seconds": self.explore_seconds,
            "explore_budget": self._explore_budget,
            "rounds": self._rounds,
        }

    def load_state(self, state: object) -> None:
        """Take up a `state()` record (from a file: hostile until checked), within this
        planner's own limits; ValueError naming what is wrong, leaving it as it was."""
        if not isinstance(state, dict):
            raise ValueError("budget: not a planner's record")
        lines = [
            CostLine.from_state(state.get(n), f"budget {n}") for n in ("target", "plain", "passes")
        ]
        numbers = {}
        for name in ("sharing", "draft_unit_seconds", "total_seconds", "explore_seconds"):
            value = state.get(name)
            # (explore_seconds is a net loss: negative where exploring paid off)
            low = -1e12 if name == "explore_seconds" else 0
            if not isinstance(value, (int, float)) or not low <= value < 1e12:
                raise ValueError(f"budget {name}: not a number within its range")
            numbers[name] = float(value)
        counts = {}
        for name in ("draft_samples", "explore_budget", "rounds"):
            value = state.get(name)
            if not isinstance(value, int) or not 0 <= value < 1 << 40:
                raise ValueError(f"budget {name}: not a count")
            counts[name] = value
        passes, shapes = state.get("draft_passes"), state.get("shapes")
        if not isinstance(passes, dict) or not isinstance(shapes, list):
            raise ValueError("budget: draft_passes or shapes missing")
        if len(passes) > len(BUDGET_GRID) or len(shapes) > len(BUDGET_GRID) * len(DEPTH_GRID):
            raise ValueError("budget: more budgets or shapes than the planner considers")
        draft_passes = {}
        for key, value in passes.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) in BUDGET_GRID):
                raise ValueError(f"budget draft_passes: {key!r} is not a budget of the grid")
            if not isinstance(value, (int, float)) or not 0 <= value <= AUTO_MAX_BUDGET:
                raise ValueError(f"budget draft_passes at {key}: not a pass count")
            draft_passes[int(key)] = float(value)
        sums, seen = {}, {}
        for entry in shapes:
            ok = isinstance(entry, list) and len(entry) == 4
            b, d, total, n = entry if ok else (None,) * 4
            if not (ok and b in BUDGET_GRID and d in DEPTH_GRID and d <= b):
                raise ValueError(f"budget shapes: {entry!r} is not a shape of the grid")
            if not (isinstance(n, int) and 0 < n < 1 << 40 and isinstance(total, (int, float))
                    and 0 <= total <= n * d):  # fmt: skip
                raise ValueError(f"budget shapes: counts of {b}x{d} are not possible")
            shape = TreeShape(b, d)
            sums[shape], seen[shape] = float(total), n
        self.target, self.plain, self.passes = lines
        for line in (self.target, self.passes):
            line.price_by(self._pass_feature)
        self.sharing = max(numbers["sharing"], 1.0)
        self.draft_unit_seconds = numbers["draft_unit_seconds"]
        self.total_seconds, self.explore_seconds = (
            numbers["total_seconds"],
            numbers["explore_seconds"],
        )
        self._draft_samples = min(counts["draft_samples"], 20)
        self._explore_budget = max(1, min(counts["explore_budget"], self.max_budget))
        self._rounds = counts["rounds"]
        self._draft_passes = draft_passes
        keep = [s for s in seen if s.budget <= self.max_budget and s.depth <= self.depth_cap]
        self._sums = {s: sums[s] for s in keep}
        self._counts = {s: seen[s] for s in keep}
        self._choose()
        if self._counts:
            self.reason = "auto: what earlier runs of this model pair measured"

    @property
    def rounds_seen(self) -> int:
        """Rounds chosen since the first (what `save_learned` ranks planners by)."""
        return self._rounds

    def draft_seconds(self, shape: TreeShape) -> float:
        """A draft pass per level, or as many as rounds of this budget took (calibrated
        growth stops early where the tree is wide)."""
        if not shape.budget:
            return 0.0
        units = float(shape.draft_passes) if self.uses_draft_model else 1.0
        if self.uses_draft_model and shape.budget in self._draft_passes:
            units = min(units, self._draft_passes[shape.budget])
        return units * self.draft_unit_seconds

    def target_cost(self) -> CostLine | MarginalCost:
        """Seconds of a round's target pass by its own tokens: alone, the rounds' line;
        sharing passes with other generations, its marginal cost there."""
        if self.sharing >= SHARED and self.passes:
            # (With passes of one size seen so far the line is flat: all of it is fixed cost.)
            return MarginalCost(self.passes, self.sharing)
        return self.target

    def _explore_shape(self) -> TreeShape:
        b = self._explore_budget
        return TreeShape(b, min(b, self.depth_cap, default_depth(b)))

    def next_shape(self) -> TreeShape:
        self._exploring = False
        if self.max_budget < 1:
            self.reason = "auto: the plan holds no tree"
            return TreeShape(0, 0)
        if not self._counts:  # nothing learnt yet: the first round explores
            self._exploring = True
            self.reason = "auto: a first small tree, to measure what speculation buys here"
            return self._explore_shape()
        self._rounds += 1
        unmeasured = not self.plain and not isinstance(self.target_cost(), MarginalCost)
        if unmeasured or (self.chosen.budget and self._rounds % PLAIN_REFRESH_EVERY == 0):
            # A plain step measures what no tree costs (and re-measures it now and then: a
            # stall during the first one must not keep trees looking cheap forever).
            self.reason = "auto: a plain step, measuring what decoding without a tree costs"
            return TreeShape(0, 0)
        rationed = self.explore_seconds <= self.explore_share * self.total_seconds
        if rationed and self._explore_budget > self.chosen.budget:
            shape = self._explore_shape()
            best = self.predicted_rate(self.chosen)
            if self._best_case_rate(shape) > best:
                self._exploring, self._rate_before = True, best
                self.reason = (
                    f"auto: trying a {shape.budget}-node tree (at best it would beat the "
                    f"current choice's {best:.0f} tokens/s)"
                )
                return shape
        self.reason = self._why_chosen()
        return self.chosen

    def _why_chosen(self) -> str:
        plain = self.predicted_rate(TreeShape(0, 0))
        if self.chosen.budget:
            return (
                f"auto: a {self.chosen.budget}-node tree, predicted "
                f"{self.predicted_rate(self.chosen):.0f} tokens/s against {plain:.0f} without one"
            )
        trees = [self.predicted_rate(s) for s in self.expected_tokens()]
        best_tree = max(trees, default=0.0)
        return (
            f"auto: plain decoding, predicted {plain:.0f} tokens/s; the best tree measured "
            f"so far would give {best_tree:.0f} tokens/s (a draft step, model or lookup, costs "
            f"{self.draft_unit_seconds * 1e3:.2f} ms here, averaged over its last "
            f"{self._draft_samples} steps, earlier runs' kept): speculation does not pay"
        )

    def predicted_rate(self, shape: TreeShape) -> float:
        """Tokens per second the planner expects from `shape` (0 when it cannot tell)."""
        if not shape.budget:
            plain = self._plain_seconds()
            return 1.0 / plain if plain else 0.0
        tokens = self.expected_tokens().get(shape)
        if tokens is None or not self._costed():
            return 0.0
        cost = self.target_cost()
        return tokens / (cost.predict(1 + shape.budget) + self.draft_seconds(shape))

    def _plain_seconds(self) -> float | None:
        """A plain step's seconds: measured alone, or its marginal cost in shared passes."""
        cost = self.target_cost()
        if isinstance(cost, MarginalCost):
            return cost.predict(1)
        return self.plain.predict(1) if self.plain else None

    def _best_case_rate(self, shape: TreeShape) -> float:
        """Every drafted level accepted: the most a tree of this shape could yield."""
        if not self._costed():
            return float("inf")
        cost = self.target_cost()
        return (shape.depth + 1) / (cost.predict(1 + shape.budget) + self.draft_seconds(shape))

    def expected_tokens(self) -> dict[TreeShape, float]:
        return {s: 1.0 + self._sums[s] / self._counts[s] for s in self._counts}

    def observe(self, record: RoundRecord) -> None:
        self.sharing += SHARING_WEIGHT * (record.sequences - self.sharing)
        if record.pass_tokens:
            self.passes.observe(
                record.pass_tokens, record.pass_seconds, half_octave(record.pass_tokens)
            )
        if record.sequences > 1:
            self._observe_shared(record)
            return
        self.total_seconds += record.round_seconds
        if not record.nodes and not self._exploring and self._rounds % PLAIN_REFRESH_EVERY:
            self.plain.observe(1, record.round_seconds)  # the common no-tree step: stay cheap
            return
        if self._exploring:
            # The net loss: this round's time minus what its tokens would have cost at the
            # chosen rate. Negative when exploring paid off, which leaves room for more.
            # The first round has nothing to compare with: it costs no ration.
            if self._rate_before:
                gained = (len(record.path) + 1) / self._rate_before
                self.explore_seconds += record.round_seconds - gained
            if record.nodes >= self._explore_budget:  # next time, look further
                self._explore_budget = min(self._explore_budget * 2, self.max_budget)
        line = self.target if record.nodes else self.plain
        line.observe(record.verify_tokens, record.round_seconds - record.draft_seconds)
        if record.nodes:
            self._learn_tree(record)
        if record.nodes or self._rounds % PLAIN_REFRESH_EVERY == 0:
            # Plain rounds only refine t_target(1): re-deciding now and then is enough, and
            # keeps the no-tree path as cheap as plain decoding.
            self._choose()

    def _observe_shared(self, record: RoundRecord) -> None:
        """A round whose target pass carried other generations' work too: its time is all
        of theirs, so it teaches only the pass line (observed above), the draft's cost and
        acceptance; the choice then charges each tree its marginal cost (`MarginalCost`).
        Fed whole, a shared round's time made a lone client's trees look cheap on a CPU
        (256-node trees, 0.47x the speed); charged as an equal share, it made 8 clients'
        trees look cheap where every token adds compute (1.6x the interleaved engine
        instead of 2.8x)."""
        # Time is its marginal cost here, for rationing exploration as a lone round does
        # (its share of the round, while no cost can be predicted yet).
        if self._costed():
            cost = self.target_cost().predict(record.verify_tokens) + record.draft_seconds
        else:
            cost = record.round_seconds / record.sequences
        self.total_seconds += cost
        if self._exploring:
            if self._rate_before:
                self.explore_seconds += cost - (len(record.path) + 1) / self._rate_before
            if record.nodes >= self._explore_budget:
                self._explore_budget = min(self._explore_budget * 2, self.max_budget)
        if record.nodes:
            self._learn_tree(record)
            self._choose()

    def _learn_tree(self, record: RoundRecord) -> None:
        unit = record.draft_seconds
        if self.uses_draft_model:
            unit /= max(record.draft_passes, 1)
        n = self._draft_samples = min(self._draft_samples + 1, 20)
        self.draft_unit_seconds += (unit - self.draft_unit_seconds) / n
        passes = self._draft_passes.get(record.shape.budget, float(record.draft_passes))
        self._draft_passes[record.shape.budget] = passes + 0.2 * (record.draft_passes - passes)
        self._learn_acceptance(record)

    def _costed(self) -> bool:
        """Whether a tree round's target cost can be predicted yet."""
        return bool(self.target) or isinstance(self.target_cost(), MarginalCost)

    def _choose(self) -> None:
        if self._costed():
            self.chosen = choose_shape(
                self.expected_tokens(), self.target_cost(), self.draft_seconds,
                self._plain_seconds(),
            )  # fmt: skip

    def _learn_acceptance(self, record: RoundRecord) -> None:
        for b in BUDGET_GRID:
            if b > record.nodes:
                break
            leading = 0  # accepted nodes within the first b (path depths are 1, 2, ...)
            for node in record.path:
                if node > b:
                    break
                leading += 1
            for d in DEPTH_GRID:
                if d > min(record.shape.depth, b, self.depth_cap):
                    break
                shape = TreeShape(b, d)
                self._sums[shape] = self._sums.get(shape, 0.0) + min(leading, d)
                self._counts[shape] = self._counts.get(shape, 0) + 1
