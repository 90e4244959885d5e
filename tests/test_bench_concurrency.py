"""scripts/bench_concurrency.py --quick on the real pair: the batched and interleaved
engines give the same tokens, and the counts it reports agree with each other; without
matplotlib the plot is a hand-written SVG."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from scripts import bench_concurrency, concurrency_plot


def test_bench_concurrency_script_quick(tmp_path: Path) -> None:
    path = tmp_path / "quick.json"
    assert bench_concurrency.main(["--quick", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    rows = {(r["clients"], r["engine"]): r for r in record["rows"]}
    assert set(rows) == {(n, e) for n in (1, 2) for e in ("batched", "interleaved")}
    assert all(r["path"] == "in-process" and r["same"] for r in rows.values())
    assert record["consistent_across_rows"] and record["interleaved_passes_accounted"]
    for r in rows.values():
        assert r["tokens"] == 8 * r["clients"]
        # Every target pass streams every layer once (5 layers, more than the 2 slots).
        assert r["streamed_bytes"] == r["passes"] * record["streamed_bytes_per_pass"] > 0
    assert rows[(1, "interleaved")]["generations_per_pass"] == 1.0
    assert rows[(2, "interleaved")]["generations_per_pass"] == 1.0
    assert rows[(2, "batched")]["generations_per_pass"] > 1.0


def test_plot_without_matplotlib_is_an_svg(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    summary = [
        {"path": p, "engine": e, "clients": n, "tokens_per_second": 100.0 * n,
         "streamed_bytes_per_token": 1e6 / n}
        for p in ("in-process", "rest") for e in ("batched", "interleaved") for n in (1, 2, 4, 8)
    ]  # fmt: skip
    path = tmp_path / "plot.svg"
    assert "svg" in concurrency_plot.plot(summary, path, "a <title>")
    root = ET.fromstring(path.read_text())
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 8  # two panels × (two paths × two engines)
    assert all(len(line.get("points", "").split()) == 4 for line in lines)
