"""scripts/bench_overhead.py runs end to end, small: one cold run of each start-up measure on
the real pair; and the compiled sections with the draft as both models (its graphs are in
the compile cache once tests/test_compiled.py has run), a few tokens, one repeat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), *argv],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )


def test_bench_overhead_startup_measures_cold_processes(
    stories_target: Path, stories_draft: Path, tmp_path: Path
) -> None:
    out = tmp_path / "overhead.json"
    done = _bench(
        "--sections", "startup", "--runs", "1", "--model", str(stories_target),
        "--draft", str(stories_draft), "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(out.read_text())["startup"]}
    assert all(r["section"] == "startup" and len(r["seconds"]) == 1 for r in rows.values())
    first = rows["generate: start → first token"]["median"]
    assert 0 < first < rows["generate: start → exit (8 tokens)"]["median"]
    assert rows["serve: start → /health ready"]["median"] > 0
    assert rows["import torch"]["median"] > rows["interpreter alone"]["median"]
    assert "share of first token" in rows["imports of generate"]["notes"]
    assert "| startup | generate: start → first token |" in done.stdout


def test_bench_overhead_compares_eager_and_compiled(tmp_path: Path, stories_draft: Path) -> None:
    out = tmp_path / "overhead.json"
    done = _bench(
        "--sections", "decode", "draft", "profile", "--model", str(stories_draft),
        "--draft", str(stories_draft), "--tokens", "12", "--repeats", "1", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [r["strategy"] for r in report["decode"]] == [
        "autoregressive", "linear (k=4)", "tree (budget 8)"
    ]  # fmt: skip
    for row in report["decode"]:
        assert row["identical_output"], row
        assert abs(row["ratio"] - row["compiled_tokens_per_s"] / row["eager_tokens_per_s"]) < 1e-9
    assert [r["nodes"] for r in report["draft"]] == [1, 8, 32]
    for row in report["draft"]:
        assert row["ratio"] == row["eager_us"] / row["compiled_us"]
    profile = report["profile"]
    assert profile["compiled"]["ops_per_step"] < profile["eager"]["ops_per_step"]
    assert "ratio" in profile and "decode step" in done.stdout


def test_the_budget_section_predicts_from_the_draft_step_times() -> None:
    """The budget section's arithmetic, on given step times: a target pass at the plan's
    transfer bound (a 70B on 24 GB streams most of its 140 GB), the auto budget's choice for
    each variant of the draft's steps, and a cheaper draft never predicting fewer tokens/s.
    A draft step as slow as the pass leaves no tree worth drafting; a fast one, a big one."""
    sys.path.insert(0, str(ROOT))
    from scripts.step_timing import _budget_rows

    nodes = (1, 2, 4, 8, 16, 32, 64)
    rows = [{"nodes": n, "eager_us": 4e6, "compiled_graphed_us": 500.0} for n in nodes]
    out = _budget_rows(rows, bandwidth=25e9)
    assert [(r["target"], r["draft_steps"]) for r in out] == [
        ("llama-3.1-8b", "eager"), ("llama-3.1-8b", "compiled+graphed"),
        ("llama-3.1-70b", "eager"), ("llama-3.1-70b", "compiled+graphed"),
    ]  # fmt: skip
    slow, fast = out[2], out[3]
    assert 4 < slow["target_pass_s"] < 6  # ~115 GB streamed per pass at 25 GB/s
    assert fast["budget"] == 128 and abs(fast["draft_s_per_round"] - 9 * 500e-6) < 1e-12
    assert slow["budget"] < fast["budget"]
    for eager, graphed in (out[0:2], out[2:4]):
        assert graphed["predicted_tokens_per_s"] >= eager["predicted_tokens_per_s"]
