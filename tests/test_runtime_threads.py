"""CPU thread choice: tiny models run single-threaded (extra intra-op threads only wait on
each other), larger ones use the physical cores, and an explicit count wins."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from daemon.cli import main
from daemon.compiling import SMALL_LAYER_PARAMETERS
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime, cpu_threads


def test_auto_threads_follow_the_layer_size():
    assert cpu_threads("auto", 45_000) == 1
    cores = psutil.cpu_count(logical=False) or torch.get_num_threads()
    assert cpu_threads("auto", SMALL_LAYER_PARAMETERS * 20) == max(1, cores)
    assert cpu_threads(3, 45_000) == 3


def test_runtime_applies_the_thread_count_on_cpu(stories_target: Path):
    try:
        runtime = Runtime(RuntimeOptions(model=str(stories_target), device="cpu", threads=2))
        assert runtime.threads == 2 and torch.get_num_threads() == 2
        runtime = Runtime(RuntimeOptions(model=str(stories_target), device="cpu"))
        assert runtime.threads == 1 and torch.get_num_threads() == 1  # a 45k-weight layer
    finally:
        torch.set_num_threads(1)


def test_generate_rejects_a_bad_thread_count(stories_target: Path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(stories_target), "--threads", "0", "--prompt", "a"])
    assert exc.value.code == 2
    assert "--threads must be at least 1" in capsys.readouterr().err
