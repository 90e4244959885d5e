"""The auto budget's choice from synthetic measured costs, and its learning loop."""

from __future__ import annotations

import random

import pytest

from scripts.step_timing import STORIES_TOKENS_PER_ROUND
from speculative.auto_budget import AutoBudget
from speculative.budget import FixedBudget, RoundRecord, TreeShape, choose_shape
from speculative.pass_costs import CostLine


def _expected_tokens(alpha: float) -> dict[TreeShape, float]:
    """A plausible acceptance curve: deeper and wider trees yield more, with diminishing
    returns (coverage per level grows with the nodes per level)."""
    table = {}
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for d in (1, 2, 3, 4, 6, 8, 12, 16):
            if d > b:
                continue
            per_level = 1 - (1 - alpha) ** max(1.0, b / d)
            table[TreeShape(b, d)] = sum(per_level**k for k in range(d + 1))
    return table


def _line(points: dict[int, float]) -> CostLine:
    line = CostLine()
    for n, s in points.items():
        line.observe(n, s)
    return line


def test_streamed_gpu_costs_pick_a_big_tree():
    # A pass streams the weights: 5 s whatever it carries; a resident draft pass is 5 ms.
    target = _line({1: 5.0, 257: 5.05})
    shape = choose_shape(_expected_tokens(0.7), target, lambda s: s.draft_passes * 0.005)
    assert shape.budget >= 128 and shape.depth >= 8


# Tokens per round the real stories260k pair yielded (greedy) at the builder's shapes of
# 2026-11-21 (scripts/step_timing.py): a realistic acceptance curve for the arithmetic.
MEASURED = STORIES_TOKENS_PER_ROUND


def test_cpu_costs_with_expensive_drafting_pick_no_tree():
    # A target pass ~1.5 ms (+20 us per token); a draft pass costs 0.9 ms, most of that
    # per-call overhead, as for these tiny models on a CPU.
    target = _line({1: 1.5e-3, 65: 1.5e-3 + 64 * 20e-6})
    shape = choose_shape(MEASURED, target, lambda s: s.draft_passes * 0.9e-3)
    assert shape == TreeShape(0, 0)


def test_cheaper_drafting_on_cpu_picks_a_small_tree():
    target = _line({1: 1.5e-3, 65: 1.5e-3 + 64 * 20e-6})
    shape = choose_shape(MEASURED, target, lambda s: s.draft_passes * 0.2e-3)
    assert 1 <= shape.budget <= 16


def test_streamed_gpu_costs_with_measured_acceptance_pick_the_biggest_tree():
    target = _line({1: 5.0, 129: 5.01})
    shape = choose_shape(MEASURED, target, lambda s: s.draft_passes * 0.005)
    assert shape == TreeShape(128, 9)


def _simulate(planner: AutoBudget, target_s, draft_pass_s: float, alpha: float, rounds: int):
    """Rounds with synthetic costs and a synthetic accepted path, grown as calibrated
    growth grows a tree of budget b: about b / 8 nodes per level (side branches, which
    raise each level's acceptance a little) over at most `shape.depth` levels, one draft
    pass per level; node i on the path is accepted with that level's probability, the
    best-first order putting the path node of level k at index ~k·width."""
    rng = random.Random(0)
    for _ in range(rounds):
        shape = planner.next_shape()
        path: list[int] = []
        width = max(1, shape.budget // 8)
        levels = min(shape.depth, max(1, shape.budget // width)) if shape.budget else 0
        level_accept = alpha + (1 - alpha) * (1 - 1 / width) / 2  # siblings help, a bit
        for level in range(1, levels + 1):
            if rng.random() > level_accept:
                break
            path.append(min(shape.budget, (level - 1) * width + 1))
        draft = levels * draft_pass_s
        planner.observe(
            RoundRecord(
                shape, shape.budget, path, 1 + shape.budget,
                target_s(1 + shape.budget) + draft, draft, levels,
            )
        )  # fmt: skip
    return planner


def test_auto_learns_no_tree_on_cpu_and_rations_exploration():
    planner = _simulate(AutoBudget(), lambda n: 1.4e-3 + 20e-6 * n, 1.0e-3, 0.6, 400)
    assert planner.chosen == TreeShape(0, 0)
    # The first round explores unconditionally; later exploration stays within its share
    # (one more round may start just under the line).
    biggest = 1.4e-3 + 20e-6 * 257 + 16 * 1.0e-3
    assert planner.explore_seconds <= 0.02 * planner.total_seconds + 2 * biggest


def test_auto_unlearns_a_plain_cost_measured_under_load_within_a_few_refreshes():
    """A daemon under load learnt plain steps at 4.4 ms and kept it on disk; on a quiet
    machine they take 0.94 ms. The re-measuring plain steps (one in 16 rounds) bring it
    back to plain decoding within about a hundred rounds: moved 10% a time toward a
    quicker pass, the stale cost kept a slower tree chosen for hundreds."""
    slow_plain = lambda n: 4.4e-3 if n == 1 else 1.4e-3 + 20e-6 * n  # noqa: E731
    planner = _simulate(AutoBudget(), slow_plain, 1.0e-3, 0.6, 200)
    assert planner.chosen.budget > 0, "under load a tree beat the slow plain steps"
    quiet = lambda n: 0.94e-3 if n == 1 else 1.4e-3 + 20e-6 * n  # noqa: E731
    _simulate(planner, quiet, 1.0e-3, 0.6, 100)
    assert planner.chosen == TreeShape(0, 0), planner.reason


def test_auto_learns_a_big_tree_for_a_streamed_target_within_a_few_rounds():
    # Each round is a 5 s streamed pass: exploring bigger trees costs nothing extra, so it
    # must not be rationed like exploring on a CPU.
    planner = _simulate(AutoBudget(), lambda n: 5.0 + 1e-4 * n, 0.005, 0.7, 20)
    assert planner.chosen.budget >= 64


def test_fixed_budget_shape():
    # No depth limit below the budget: a tree may be a chain (calibrated growth decides).
    assert FixedBudget(64).next_shape() == TreeShape(64, 64)
    assert FixedBudget(64, 4).next_shape() == TreeShape(64, 4)
    assert FixedBudget(0).next_shape() == TreeShape(0, 0)


def test_the_planner_says_why_it_chose_its_budget():
    fresh = AutoBudget()
    fresh.next_shape()
    assert "first small tree" in fresh.reason
    cpu = _simulate(AutoBudget(), lambda n: 1.4e-3 + 20e-6 * n, 1.0e-3, 0.6, 400)
    cpu._rounds = 1  # off the plain-step refresh
    assert cpu.next_shape() == TreeShape(0, 0)
    assert "plain decoding" in cpu.reason and "speculation does not pay" in cpu.reason
    gpu = _simulate(AutoBudget(), lambda n: 5.0 + 1e-4 * n, 0.005, 0.7, 20)
    gpu._rounds = 1
    shape = gpu.next_shape()
    assert f"{shape.budget}-node tree" in gpu.reason
    assert "speculation.budget 64" in FixedBudget(64).reason
    assert "plain decoding" in FixedBudget(0).reason


def test_a_generations_stats_carry_the_budget_reason(tiny_checkpoint):
    from modeling.checkpoints.checkpoint import load
    from speculative.generation import Generation
    from speculative.prefix_cache import PrefixCache
    from speculative.sampling import SamplingParams
    from speculative.strategies.tree import TreeSpeculation

    target, tok, _ = load(tiny_checkpoint("llama"), "fp32", "cpu")
    draft, _, _ = load(tiny_checkpoint("llama", seed=3), "fp32", "cpu")
    for budget, expect in (("auto", "auto: "), (8, "fixed: speculation.budget 8")):
        tree = TreeSpeculation(target, draft, budget, prefix_cache=PrefixCache(0))
        gen = Generation(
            tree, tree.new_session(64), tok, [1, 2, 3], SamplingParams(temperature=0.0), 6
        ).run()
        reason = gen.stats.to_dict()["budget_reason"]
        assert reason is not None and reason.startswith(expect)


def _shared_rounds(planner: AutoBudget, pass_s, sharing: int, alpha: float, rounds: int):
    """Rounds that ride in passes carrying `sharing` generations of about the same size:
    each round observes the whole pass's time and tokens."""
    rng = random.Random(1)
    for _ in range(rounds):
        shape = planner.next_shape()
        path = []
        for level in range(1, shape.depth + 1):
            if rng.random() > alpha:
                break
            path.append(level)
        tokens = sharing * (1 + shape.budget)
        seconds = pass_s(tokens)
        planner.observe(
            RoundRecord(
                shape, shape.budget, path, 1 + shape.budget, seconds + 0.001, 0.001,
                shape.draft_passes, sequences=sharing, pass_tokens=tokens, pass_seconds=seconds,
            )
        )  # fmt: skip
    return planner


def test_shared_passes_charge_each_tree_its_marginal_cost():
    """Eight generations per pass. A streamed target's pass costs its weight transfer
    whatever it carries: a tree's own tokens cost almost nothing, so trees stay big. On a
    CPU every token costs compute: the marginal cost of a big tree is its tokens' slope,
    and the planner picks a small tree or none, as it would alone at that slope."""
    streamed = _shared_rounds(AutoBudget(), lambda n: 5.0 + 1e-5 * n, 8, 0.8, 60)
    assert streamed.sharing > 7 and streamed.chosen.budget >= 16
    cpu = _shared_rounds(AutoBudget(), lambda n: 1e-3 + 2e-4 * n, 8, 0.5, 200)
    assert cpu.chosen.budget <= 4
    # Exploring bigger trees is rationed in shared passes too (their time is charged at
    # its marginal cost), not tried every round.
    biggest = 1e-3 / 8 + 2e-4 * 257 + 0.001
    assert cpu.total_seconds > 0 and cpu.explore_seconds <= 0.02 * cpu.total_seconds + 2 * biggest
    cost = cpu.target_cost()
    fixed, slope = cpu.passes.intercept_and_slope()
    assert cost.predict(10) == pytest.approx(fixed / cpu.sharing + slope * 10)
    assert slope == pytest.approx(2e-4, rel=0.05)


def test_an_expert_targets_passes_are_priced_by_the_experts_they_wake():
    """A Qwen3-30B-A3B-shaped target whose experts stream: a pass costs a fixed part plus
    each distinct expert its tokens wake (E (1 - (1 - k/E)^n) a layer: 126 of 128 at 64
    tokens, no more at 256). Measured at the small sizes exploring starts with, a line in
    tokens extrapolates the first steep rise (16 experts at 2 tokens, 85 at 17) to 9x the
    true cost at 257 and stops at a 4-node tree (19 tokens/s where 64 nodes give 29);
    priced by the experts woken it predicts every size and chooses the best shape."""
    from functools import partial

    from offload.expert_plans import expected_experts

    woken = partial(expected_experts, 128, 8)

    def true_seconds(n: float) -> float:
        return 0.02 + 0.004 * woken(n)  # 4 ms an expert (every layer's copy of it)

    class Truth:
        def predict(self, n: int) -> float:
            return true_seconds(n)

    def draft(shape: TreeShape) -> float:
        return shape.draft_passes * 0.004

    tokens = _expected_tokens(0.8)
    best = choose_shape(tokens, Truth(), draft)  # type: ignore[arg-type]
    by_tokens, by_experts = CostLine(), CostLine()
    by_experts.price_by(woken)
    for n in (2, 3, 5, 9, 17):
        for line in (by_tokens, by_experts):
            line.observe(n, true_seconds(n))
    for n in (33, 129, 257):
        assert by_experts.predict(n) == pytest.approx(true_seconds(n), rel=1e-9)
    assert choose_shape(tokens, by_experts, draft) == best
    assert best.budget >= 64
    assert choose_shape(tokens, by_tokens, draft).budget < best.budget


def test_the_planner_keeps_its_pricing_when_it_takes_up_a_record():
    """A planner priced by experts woken, given a record saved from another (its lines
    in tokens, as a file keeps them), still prices by experts woken."""
    planner = _simulate(AutoBudget(), lambda n: 5.0 + 1e-4 * n, 0.005, 0.7, 20)
    priced = AutoBudget()
    feature = lambda n: min(n, 8.0)  # noqa: E731
    priced.price_passes_by(feature)
    priced.load_state(planner.state())
    assert priced.target.feature is feature and priced.passes.feature is feature
    assert priced.target.state() == planner.target.state()
