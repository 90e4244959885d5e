"""scripts/bench_choices.py end to end on the stories model, small: both ways give the same
tokens, and the prompt is prefilled once where the choices share it."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import bench_choices


def test_bench_choices_reports_both_ways(
    stories_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(stories_target), "--n", "3", "--prompt-tokens", "40",
            "--repeats", "1", "--max-tokens", "2"]  # fmt: skip
    bench_choices.main(argv)
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| prefilled")
    }
    once, each = rows["prefilled once"], rows["prefilled by each"]
    assert once[2] == each[2] == "True"  # the same tokens both ways
    # The prompt's tokens once (and each other choice's last one, its first round's root),
    # against three times.
    prompt = int(each[1]) // 3
    assert int(once[1]) == prompt + 2
