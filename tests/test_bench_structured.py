"""scripts/bench_structured.py end to end on the shared pair, small: a cell for every mode,
strategy and temperature, counted from the generations' own statistics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from scripts import bench_structured


def test_bench_structured_reports_every_mode_and_strategy(
    tmp_path: Path, stories_target: Path, stories_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "structured.json"
    argv = [
        "bench_structured.py", "--target", str(stories_target), "--draft", str(stories_draft),
        "--strategies", "tree:8,linear:2", "--temperatures", "0,1", "--prompts", "1",
        "--seeds", "1", "--tokens", "100", "--json", str(out),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_structured.main()
    cells = json.loads(out.read_text())["cells"]
    assert {(c["mode"], c["strategy"], c["temperature"]) for c in cells} == {
        (m, s, t)
        for m in bench_structured.MODES
        for s in ("tree:8", "linear:2")
        for t in (0.0, 1.0)
    }
    for c in cells:
        assert c["answers"] == 1
        assert c["tokens_per_pass"] == c["tokens"] / c["passes"]
        if c["mode"] == "free":
            assert c["forced"] == c["masks"] == 0 and c["grammar_seconds"] == 0.0
        else:
            assert c["masks"] > 0 and c["grammar_seconds"] > 0.0
        if c["mode"] in ("json_schema", "tool"):
            # Short answers within 100 tokens, their braces, keys and tags forced.
            assert c["complete"] == 1 and c["forced"] >= 10
    # Greedy constrained text is the same for every strategy: so is its length.
    greedy = [c for c in cells if c["temperature"] == 0.0]
    for mode in bench_structured.MODES:
        assert len({c["tokens"] for c in greedy if c["mode"] == mode}) == 1
