"""scripts/bench_overhead.py end to end, small: the draft serves as both models (its graphs
are in the compile cache once tests/test_compiled.py has run), a few tokens, one repeat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_overhead_compares_eager_and_compiled(tmp_path: Path, stories_draft: Path) -> None:
    out = tmp_path / "overhead.json"
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "scripts" / "bench_overhead.py"),
            "--target", str(stories_draft), "--draft", str(stories_draft),
            "--tokens", "12", "--repeats", "1", "--json", str(out),
        ],
        capture_output=True, text=True, check=False, cwd=ROOT,
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
