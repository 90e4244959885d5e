"""`specd bench --concurrency N` on the real pair: N generations at once through the batched
engine, each of which must produce the single stream's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.cli import main


def test_bench_concurrency_two(stories_target: Path, stories_draft: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["bench", "--model", str(stories_target), "--draft", str(stories_draft)]
    argv += ["--device", "cpu", "--max-tokens", "16", "--concurrency", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    single, _, together = out.partition("2 concurrent generations of the same prompt")
    assert together, out
    rows = {line.split()[0]: line.split() for line in together.splitlines()[2:] if line}
    assert set(rows) == {"autoregressive", "linear", "tree"}
    for cells in rows.values():
        assert cells[-1] == "yes"  # both generations gave the single stream's tokens
        assert float(cells[1]) > 0
    # Autoregressive: one token per generation per pass, both generations in every pass.
    assert float(rows["autoregressive"][3]) == pytest.approx(2.0, abs=0.2)
    assert "tok/pass" in single


def test_bench_concurrency_one_keeps_the_single_table(stories_target: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["bench", "--model", str(stories_target), "--device", "cpu", "--max-tokens", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    workload, header = out.splitlines()[:2]
    assert "concurrent" not in out and header.startswith("strategy")
    # What ran is said first, and each row in a sentence.
    assert workload.startswith("workload: prompt 'Once upon a time'") and "4 new tokens" in workload
    assert "  autoregressive: 4 tokens in 4 target passes" in out
