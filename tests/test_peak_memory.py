"""PeakMemory: the probe the memory tests and scripts/bench_scale.py hold plans against."""

from __future__ import annotations

import sys

import pytest
import torch

from offload.machine import PeakMemory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_cpu_peak_sees_a_freed_temporary_and_not_older_memory() -> None:
    held = torch.ones(64 << 20, dtype=torch.uint8)  # in use before: not counted
    with PeakMemory("cpu") as peak:
        tmp = torch.ones(96 << 20, dtype=torch.uint8)
        del tmp
        kept = torch.ones(32 << 20, dtype=torch.uint8)
    assert peak.bytes is not None
    # The peak is the 96 MiB temporary (the 32 MiB came after it was freed), give or take allocator noise.
    assert 94 << 20 <= peak.bytes < 104 << 20
    del held, kept
