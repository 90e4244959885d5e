"""Loading and placing the target (daemon/target_loading.py): a placed target is placed
once."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from daemon.target_loading import place_target


def test_placing_a_streamed_target_again_is_refused(stories_target: Path) -> None:
    runtime = Runtime(
        RuntimeOptions(
            model=str(stories_target), device="cpu", context=64, offload="stream",
            resident_layers=1,
        )
    )  # fmt: skip
    assert runtime.plan is not None and runtime.streamer is not None
    with pytest.raises(ValueError, match="already a streamer"):
        place_target(runtime.target, runtime.checkpoint, runtime.plan, runtime.device)
