"""scripts/bench_trees.py end to end on the shared pair, small: every cell it reports holds
the tree and each chain, counted from the rounds' own statistics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scripts import bench_trees


def test_bench_trees_reports_tree_and_chains(
    tmp_path: Path, stories_target: Path, stories_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "trees.json"
    argv = [
        "bench_trees.py", "--target", str(stories_target), "--draft", str(stories_draft),
        "--drafts", "int8,ngram", "--temperatures", "0,1", "--budgets", "8",
        "--prompts", "1", "--tokens", "24", "--seeds", "1", "--json", str(out),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_trees.main()
    rows = json.loads(out.read_text())["rows"]
    assert {(r["draft"], r["temperature"]) for r in rows} == {
        ("int8", 0.0),
        ("int8", 1.0),
        ("ngram", 0.0),
        ("ngram", 1.0),
    }
    for r in rows:
        tree, chains = r["tree"], r["chains"]
        assert set(chains) == {"4", "16", "8"}
        assert tree["tokens"] == 24 and all(c["tokens"] == 24 for c in chains.values())
        assert tree["tokens_per_pass"] == tree["tokens"] / tree["passes"]
        best = max(c["tokens_per_pass"] for c in chains.values())
        assert r["tree_over_best_chain"] == pytest.approx(tree["tokens_per_pass"] / best)
        # A model draft's tree spends draft passes; prompt lookup none.
        assert (tree["draft_passes"] > 0) == (r["draft"] == "int8")
        kinds = set(tree["verification"])
        if r["draft"] == "int8" and r["temperature"] == 1.0:
            assert "rejection" in kinds  # auto starts sampled rounds with rejection
        else:
            assert kinds <= {"walk"}  # greedy, and prompt lookup, always walk
