"""Measuring what a piece of code allocates at its peak, on the CPU, in a child process.

The child runs a test file as a script with glibc's mmap threshold fixed at 64 KiB (by
default it rises up to 32 MiB as blocks are freed): every tensor but the smallest is then
its own mapping, returned to the system when freed, so the peak resident set follows the
tensors alive at once instead of the heap's history. The script prints a JSON list of
rows; `offload.machine.PeakMemory` takes the measurements inside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Tests that use it: they need Linux's /proc to reset and read the peak resident set.
needs_proc = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="the CPU peak probe needs Linux /proc"
)


def run_child(script: str | Path, timeout: float = 300) -> list[dict[str, Any]]:
    """Run `script` (a test file's `__main__`) as described above; its JSON rows."""
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(2**16), "MALLOC_TRIM_THRESHOLD_": str(2**16)}
    env = {**os.environ, **malloc, "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert child.returncode == 0, child.stderr
    rows: list[dict[str, Any]] = json.loads(child.stdout)
    return rows
