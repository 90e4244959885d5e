"""The repository is ruff clean (lint and format), with the ruff installed next to Python."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command: list[str]) -> None:
    assert RUFF.is_file(), f"ruff is not installed next to {sys.executable}"
    done = subprocess.run(
        [str(RUFF), *command, str(ROOT)], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
