"""scripts/bench_overhead.py runs end to end: one cold run of each start-up measure on the
small real pair, the table printed and every run written to the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_overhead_startup_measures_cold_processes(
    stories_target: Path, stories_draft: Path, tmp_path: Path
) -> None:
    out = tmp_path / "overhead.json"
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--sections", "startup",
            "--runs", "1", "--model", str(stories_target), "--draft", str(stories_draft),
            "--json", str(out),
        ],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["section"] == "startup" and len(r["seconds"]) == 1 for r in rows.values())
    first = rows["generate: start → first token"]["median"]
    assert 0 < first < rows["generate: start → exit (8 tokens)"]["median"]
    assert rows["serve: start → /health ready"]["median"] > 0
    assert rows["import torch"]["median"] > rows["interpreter alone"]["median"]
    assert "share of first token" in rows["imports of generate"]["notes"]
    assert "| startup | generate: start → first token |" in done.stdout
