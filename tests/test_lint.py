"""The repository is ruff clean (lint and format) and its packages are mypy clean, with the
ruff and mypy installed next to Python."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")
MYPY = Path(sys.executable).with_name("mypy")
PACKAGES = ["modeling", "speculative", "offload", "daemon"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command: list[str]) -> None:
    assert RUFF.is_file(), f"ruff is not installed next to {sys.executable}"
    done = subprocess.run(
        [str(RUFF), *command, str(ROOT)], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy() -> None:
    # The cache is the git-ignored .mypy_cache at the root: a cold run (torch's stubs) takes
    # about 42 s on two cores, a warm one about a second (2026-12-06).
    assert MYPY.is_file(), f"mypy is not installed next to {sys.executable}"
    done = subprocess.run(
        [str(MYPY), "--config-file", str(ROOT / "pyproject.toml"), *PACKAGES],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
