"""scripts/bench_scale.py end to end on a small CPU setting: every phase of every scenario
is measured and set beside a plan figure, and the JSON and the plot are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_scale_writes_a_row_per_phase_with_plan_and_measure(tmp_path: Path) -> None:
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "scripts" / "bench_scale.py"), "--device", "cpu",
            "--presets", "qwen2.5-72b", "--budgets", "8", "--contexts", "256",
            "--prefill-tokens", "32", "--hidden-scale", "0.02", "--threads", "1",
            "--json", str(out), "--plot", str(png),
        ],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["phase"] for r in rows] == ["kv", "prefill", "tree", "regenerate"]
    for r in rows:
        assert r["planned"] > 0 and r["measured"] is not None and r["seconds"] > 0, r
        assert r["ratio"] == r["planned"] / r["measured"]
    assert rows[2]["notes"]["tree_nodes"] == 8
    assert png.stat().st_size > 0
    assert "upper bound in" in done.stdout
