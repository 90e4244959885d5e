"""PeakMemory: the probe the memory tests and scripts/bench_scale.py hold plans against."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter: in the suite's process, threads and garbage left by earlier
# tests free memory while the block runs, which lowers the resident set under the base the
# probe took and hides the temporary (CI saw a peak of 0 that way).
PROBE = """
import torch
from offload.machine import PeakMemory
held = torch.ones(64 << 20, dtype=torch.uint8)  # in use before: not counted
with PeakMemory("cpu") as peak:
    tmp = torch.ones(96 << 20, dtype=torch.uint8)
    del tmp
    kept = torch.ones(32 << 20, dtype=torch.uint8)
print(peak.bytes)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_cpu_peak_sees_a_freed_temporary_and_not_older_memory() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    peak = int(out.split()[-1])
    # The peak is the 96 MiB temporary (the 32 MiB came after it was freed), give or take allocator noise.
    assert 94 << 20 <= peak < 104 << 20
