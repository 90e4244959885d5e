"""Trees learn before they run (issue 35 item 5): the acceptance prior grows the best chain
until evidence says otherwise, and what a model pair learned (acceptance tables, `auto`'s
pass costs) is kept on disk per (target, draft, bits) and loaded at the next start; a
learned file is hostile input, checked before anything in it is used."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from daemon.learned_store import MAX_BYTES, MAX_STORED, LearnedStore
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.checkpoints.checkpoint import load
from speculative.acceptance import (
    FIRST_CHILD_PRIOR,
    AcceptanceModel,
    AcceptanceTable,
)
from speculative.auto_budget import AutoBudget
from speculative.drafting import ModelDrafter
from speculative.passes import alone
from speculative.prefix_cache import PrefixCache
from speculative.sampling import SamplingParams
from speculative.strategies.linear import Linear
from speculative.strategies.tree import TreeSpeculation

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = (
    "Once upon a time, there was a little girl named Lily. She",
    "The dog ran to the park and",
)


def test_the_prior_is_a_chain_until_first_children_fail() -> None:
    """Cold: a first child almost always, later siblings a share of what it misses, so
    best-first growth is the longest chain; once first children are seen to fail, the
    second rank is worth a share of the failures and the tree widens."""
    for kind in ("walk", "rejection"):
        table = AcceptanceTable(kind)
        first, second = table.marginal()[:2]
        assert first == pytest.approx(FIRST_CHILD_PRIOR, abs=0.03)
        assert second < 0.05 and table.expected_tokens(16) > 6  # a deep chain's yield
        ranks, q = torch.ones(40, dtype=torch.long), torch.full((40,), 0.5)
        table.observe(ranks, q, torch.arange(40) % 2 == 0)  # half the first children fail
        first, second = table.marginal()[:2]
        assert first == pytest.approx(0.5, abs=0.05)
        assert second > 0.15  # worth a place beside the first child's second level


def test_a_cold_tree_is_the_best_chain_with_an_aligned_draft(stories_target: Path) -> None:
    """The cold tree at budget 64 against chains of 16 and 64 (the best chain of <= 64 in
    tokens per pass is the longest for an aligned draft), greedy, the target's int8 copy as
    its draft: before this prior a cold tree gave 0.71x the chain."""
    target, tok, _ = load(stories_target)
    draft, _, _ = load(stories_target, quantize="int8")
    prompts = [tok.encode(p) for p in PROMPTS]

    def per_pass(make) -> float:  # type: ignore[no-untyped-def]
        tokens = passes = 0
        for ids in prompts:
            strategy = make()
            session = strategy.new_session(256)
            for rnd in alone(strategy.steps(session, ids, GREEDY, 96, torch.Generator())):
                tokens += len(rnd.tokens)
                passes += rnd.stats.target_passes - rnd.stats.prefill_passes
        return tokens / passes

    tree = per_pass(
        lambda: TreeSpeculation(
            target, draft, budget=64, prefix_cache=PrefixCache(0), acceptance=AcceptanceModel()
        )
    )
    chains = [per_pass(lambda k=k: Linear(target, ModelDrafter(draft), k)) for k in (16, 64)]
    assert tree >= 0.95 * max(chains), (tree, chains)


def runtime(model: Path, cache: Path, **kw: object) -> Runtime:
    options = RuntimeOptions(
        model=str(model), device="cpu", context=256, learned_cache=str(cache), **kw
    )  # type: ignore[arg-type]
    return Runtime(options)


def generate(rt: Runtime, tokens: int = 48, strategy: str | None = None) -> None:
    for prompt in PROMPTS:
        rt.generation(rt.tokenizer.encode(prompt), GREEDY, tokens, strategy=strategy).run()


def test_what_a_pair_learned_is_loaded_at_the_next_start(
    stories_target: Path, stories_draft: Path, tmp_path: Path
) -> None:
    rt = runtime(stories_target, tmp_path, draft=str(stories_draft))
    auto = rt.strategy("tree")  # --budget auto: its planner is kept for the save
    for prompt in PROMPTS:
        ids = rt.tokenizer.encode(prompt)
        for _ in alone(auto.steps(auto.new_session(256), ids, GREEDY, 64, torch.Generator())):
            pass
    planner = auto.planner
    assert isinstance(planner, AutoBudget) and planner.rounds_seen > 0
    rt.save_learned()
    (stored,) = tmp_path.glob("*.json")
    before = rt.acceptance.state()

    again = runtime(stories_target, tmp_path, draft=str(stories_draft))
    assert again.learned is not None and again.learned.loaded_rounds > 0
    assert again.acceptance.state() == before
    fresh = again.strategy("tree").planner
    assert isinstance(fresh, AutoBudget)
    assert fresh.state() == planner.state()
    assert "earlier runs" in fresh.reason

    # Another draft is another pair: its own file, nothing loaded.
    other = runtime(stories_target, tmp_path, draft="ngram")
    assert other.learned is not None and other.learned.loaded_rounds == 0
    generate(other, 16)
    other.save_learned()
    assert len(list(tmp_path.glob("*.json"))) == 2 and stored.is_file()


WRONG = {"trials": [[1]], "successes": [[1]], "rounds": 1, "tokens": 1, "recent": 1}
HOSTILE = {
    "not json": b"{nope",
    "a list": b"[1, 2, 3]",
    "another format": json.dumps({"format": 99, "acceptance": {}}).encode(),
    "an unknown table": json.dumps({"format": 1, "acceptance": {"walk/hot": {}}}).encode(),
    "a wrong shape": json.dumps({"format": 1, "acceptance": {"walk/greedy": WRONG}}).encode(),
    "NaN counts": b'{"format": 1, "acceptance": {"walk/greedy": {"trials": NaN}}}',
    "too large": b" " * (MAX_BYTES + 1),
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
}


def _a_count_past_a_float() -> bytes:
    """A real table's record with one count of 401 digits: torch.tensor raised an
    OverflowError, which stopped `specd generate` and the daemon at every start."""
    model = AcceptanceModel()
    model.table("walk", GREEDY).note_round(3)
    state = model.state()
    state["walk/greedy"]["trials"][0][0] = 10**400
    return json.dumps({"format": 1, "acceptance": state}).encode()


HOSTILE["a count past a float"] = _a_count_past_a_float()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_learned_file_is_named_and_replaced(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LearnedStore(tmp_path, "k", "cpu")
    store.path.write_bytes(HOSTILE[name])
    model = AcceptanceModel()
    with caplog.at_level(logging.WARNING, logger="specd.learned"):
        store.load(model)
    assert model.tables == {} and store.loaded_rounds == 0
    assert str(store.path) in caplog.text and "ignoring learned state" in caplog.text
    model.table("walk", GREEDY).note_round(3)
    store.save(model, None)
    again = AcceptanceModel()
    LearnedStore(tmp_path, "k", "cpu").load(again)
    assert again.state() == model.state()


def test_a_planner_record_reads_back_whatever_it_measured() -> None:
    """Every value a planner can reach reads back, a negative net exploration loss too (it
    is negative where exploring paid off)."""
    planner = AutoBudget()
    planner.explore_seconds = -0.25
    again = AutoBudget()
    again.load_state(json.loads(json.dumps(planner.state())))
    assert again.state() == planner.state()


def test_bad_pass_costs_are_dropped_and_the_tables_kept(tmp_path: Path) -> None:
    model = AcceptanceModel()
    model.table("walk", GREEDY).note_round(5)
    planner = AutoBudget()
    record = planner.state()
    record["shapes"] = [[64, 8, 1e9, 1]]  # more tokens than a depth-8 tree can yield
    store = LearnedStore(tmp_path, "k", "cpu")
    store.budgets["cpu"] = record
    store.save(model, None)
    loaded = LearnedStore(tmp_path, "k", "cpu")
    loaded.load(AcceptanceModel())
    assert loaded.loaded_rounds == 1
    fresh = AutoBudget()
    loaded.restore(fresh)
    assert fresh.state() == AutoBudget().state()  # untouched
    assert "cpu" not in loaded.budgets


def test_a_huge_count_in_the_pass_costs_is_dropped(tmp_path: Path) -> None:
    """A shape's count past any float made every request of the daemon a 500 (the planner's
    OverflowError), and the record was written back at the stop, never healing."""
    model = AcceptanceModel()
    model.table("walk", GREEDY).note_round(5)
    record = AutoBudget().state()
    record["shapes"] = [[1, 1, 10**400, 10**400]]
    store = LearnedStore(tmp_path, "k", "cpu")
    store.budgets["cpu"] = record
    store.save(model, None)
    loaded = LearnedStore(tmp_path, "k", "cpu")
    loaded.load(AcceptanceModel())
    fresh = AutoBudget()
    loaded.restore(fresh)
    assert fresh.state() == AutoBudget().state() and "cpu" not in loaded.budgets


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "folder"])
def test_a_learned_file_that_is_no_file_is_not_read(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO waited forever; a link to /dev/zero read until the kernel killed specd (its
    size is 0, so the size check passed)."""
    store = LearnedStore(tmp_path, "k", "cpu")
    if kind == "fifo":
        os.mkfifo(store.path)
    elif kind == "folder":
        store.path.mkdir()
    else:
        store.path.symlink_to("/dev/zero")
    with caplog.at_level(logging.WARNING, logger="specd.learned"):
        store.load(AcceptanceModel())
    assert store.loaded_rounds == 0 and "not a regular file" in caplog.text


def test_the_store_evicts_only_its_own_files(tmp_path: Path) -> None:
    """`models.learned_cache` may name a folder of the user's: eviction deleted any *.json."""
    mine = [tmp_path / f"important-{i}.json" for i in range(MAX_STORED + 6)]
    for path in mine:
        path.write_text("{}")
    model = AcceptanceModel()
    for i in range(MAX_STORED + 2):
        LearnedStore(tmp_path, f"{i:032x}", "cpu").save(model, None)
    assert all(path.is_file() for path in mine)
    assert len([p for p in tmp_path.glob("*.json") if p not in mine]) == MAX_STORED
