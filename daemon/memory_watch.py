"""The engine's side of memory pressure (docs/architecture.md, "Memory pressure"): the
monitor (daemon/pressure.py) started once the models are loaded, and the relief ladder
(daemon/relief.py) it drives, followed on the engine's thread between passes, so that no
step races a pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from daemon.metrics import Metrics
from daemon.pools import SessionPool, StrategyPool
from daemon.pressure import PressureMonitor, PressureThresholds, cuda_probe, host_probe, settled
from daemon.relief import Relief, relief_steps
from speculative.batching import PassBounds

if TYPE_CHECKING:
    from daemon.runtime import Runtime

log = logging.getLogger("specd.engine")


class MemoryWatch:
    """The memory monitor and the relief ladder it drives. `monitor` is None until
    `start` (and stays None when memory is not watched); `relief` holds no step then."""

    def __init__(self, thresholds: PressureThresholds | None, metrics: Metrics) -> None:
        """`thresholds`: watch memory while serving (daemon/pressure.py); None: do not."""
        self.thresholds = thresholds
        self.metrics = metrics
        self.monitor: PressureMonitor | None = None
        self.relief = Relief([])
        self._gpu = False  # the models run on a CUDA device (known at `start`)
        self._recorded: tuple[object, int] | None = None

    def start(
        self,
        runtime: Runtime,
        sessions: SessionPool,
        strategies: StrategyPool,
        passes: PassBounds,
        device_probe: Callable[[], int] | None = None,
    ) -> None:
        """Start the monitor, its auto lines settled from what is available now the models
        are loaded and from the margin the plan left on the device. `device_probe`: free
        device bytes, in place of CUDA's count (tests)."""
        self._gpu = runtime.device.type == "cuda"
        thresholds = self.thresholds
        if thresholds is None or not thresholds.enabled:
            return
        probe = device_probe
        if probe is None and self._gpu:
            probe = cuda_probe(runtime.device)
        plan = runtime.plan
        margin = plan.budget.device_bytes - plan.device_bytes if probe is not None else None
        thresholds = settled(thresholds, host_probe()[0], margin)
        steps = relief_steps(
            runtime,
            sessions,
            strategies,
            passes,
            device_watched=probe is not None,
            host_floor=thresholds.tight_host_free or 0,
        )
        self.relief = Relief(steps)
        self.monitor = PressureMonitor(thresholds, device_free=probe)
        self.monitor.start()

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    @property
    def critical(self) -> bool:
        """Free memory is below the critical line: new requests are refused."""
        return self.monitor is not None and self.monitor.level == "critical"

    def follow(self) -> None:
        """Follow the monitor's level with the relief steps (between passes, on the
        engine's thread: the steps free what the passes use). A step that fails is logged
        and the engine serves on."""
        if self.monitor is None:
            return
        taken = self.relief.taken
        try:
            self.relief.follow(self.monitor.level, self.monitor.thresholds, self.monitor.short)
            if self.relief.taken > taken:
                self._return_device_memory()
        except Exception as exc:
            log.error("a memory relief step failed; serving on without it", exc_info=exc)
        seen = (self.monitor.sample, self.relief.taken)
        if seen != self._recorded:  # a new sample or step, not every pass
            self._recorded = seen
            self.metrics.record_pressure(self.monitor, self.relief)

    def out_of_memory(self) -> None:
        """A pass ran out of memory (and was rolled back): the next relief step that frees
        the memory that ran out, before it runs again."""
        self.relief.climb("out of memory in a pass", frozenset({"device" if self._gpu else "host"}))
        self._return_device_memory()

    def _return_device_memory(self) -> None:
        """Hand what the steps freed back to the driver: PyTorch's allocator keeps freed
        blocks for reuse, where neither the monitor nor other programs see them."""
        if self._gpu:
            torch.cuda.empty_cache()
