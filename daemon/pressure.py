"""Memory pressure at run time (DESIGN.md, "Memory pressure"): a monitor that samples free
host and device memory off the event loop, and the level it reads from them. The ladder of
reversible relief steps the engine climbs under pressure is daemon/relief.py.

Levels: `ok`; `tight` when host RAM available (psutil) or device memory free
(`torch.cuda.mem_get_info`) falls below its `tight_*` threshold; `critical` below the
`critical_*` one, or when the machine swaps faster than `critical_swap_rate`. Hysteresis:
a level is left downwards only once the memory is back above its threshold by
`HYSTERESIS` and has stayed there for `recover_seconds`; upwards at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import psutil

from daemon.settings_checks import size_bytes
from offload.units import parse_rate

log = logging.getLogger("specd.pressure")

LEVELS = ("ok", "tight", "critical")
# Free memory must climb this much above a threshold before its level is left: a tenth
# of the line, at most 512 MiB.
HYSTERESIS = 0.1
MAX_SLACK = 512 << 20


@dataclass(frozen=True)
class PressureThresholds:
    """memory.pressure.* (daemon/settings.py), in bytes and seconds."""

    enabled: bool = True
    period_seconds: float = 1.0
    # Host thresholds: bytes, or None for what is available once the models are loaded
    # (`host_thresholds`).
    tight_host_free: int | None = 2 << 30
    critical_host_free: int | None = 1 << 30
    # Device thresholds: bytes, or None for the plan's own (a tenth of the device margin
    # the plan left, and half of that; see `device_thresholds`).
    tight_device_free: int | None = None
    critical_device_free: int | None = None
    critical_swap_rate: int = 16 << 20  # bytes/s swapped in + out
    recover_seconds: float = 10.0


def thresholds_from(settings: Any) -> PressureThresholds:
    """memory.pressure (daemon/settings.py's MemoryPressureSettings) in bytes; the device
    lines stay None where they are auto (the engine takes them from the plan)."""

    def size(value: Any) -> int | None:
        return None if value == "auto" else size_bytes(value)

    return PressureThresholds(
        enabled=settings.enabled,
        period_seconds=settings.period_seconds,
        tight_host_free=size(settings.tight_host_free),
        critical_host_free=size(settings.critical_host_free),
        tight_device_free=size(settings.tight_device_free),
        critical_device_free=size(settings.critical_device_free),
        critical_swap_rate=int(parse_rate(settings.critical_swap_rate)),
        recover_seconds=settings.recover_seconds,
    )


def device_thresholds(margin: int) -> int:
    """The tight line of free device bytes from the plan's margin (its budget less what
    it placed): a tenth of it, at least 256 MiB (critical's is half the tight line)."""
    return max(margin // 10, 256 << 20)


def host_thresholds(available: int) -> int:
    """The tight line of host RAM from what is available once the models are loaded: 2 GiB,
    or half of what is available where that is less (a plan that filled a small machine's
    RAM must not start tight); critical's is half the tight line."""
    return min(2 << 30, available // 2)


def settled(
    thresholds: PressureThresholds, available: int, margin: int | None
) -> PressureThresholds:
    """`thresholds` with every auto line set: the host's from `available` RAM, the
    device's from the plan's `margin` (None: no device to watch). A critical line left
    auto is half of the tight one, given or derived."""
    t = thresholds
    tight_host = t.tight_host_free if t.tight_host_free is not None else host_thresholds(available)
    critical_host = t.critical_host_free if t.critical_host_free is not None else tight_host // 2
    tight_device, critical_device = t.tight_device_free, t.critical_device_free
    if margin is not None:
        if tight_device is None:
            tight_device = device_thresholds(margin)
        if critical_device is None:
            critical_device = tight_device // 2
    return replace(
        t, tight_host_free=tight_host, critical_host_free=critical_host,
        tight_device_free=tight_device, critical_device_free=critical_device,
    )  # fmt: skip


@dataclass(frozen=True)
class MemorySample:
    at: float  # time.monotonic()
    host_available: int
    swap_rate: float  # bytes/s swapped in and out since the previous sample
    rss: int  # this process's resident set
    device_free: int | None  # None: no device, or not sampled


def host_probe() -> tuple[int, int, int]:
    """(available RAM, bytes swapped in + out so far, this process's RSS)."""
    swap = psutil.swap_memory()
    rss = psutil.Process().memory_info().rss
    return psutil.virtual_memory().available, swap.sin + swap.sout, rss


def cuda_probe(device: Any) -> Callable[[], int]:
    import torch

    return lambda: torch.cuda.mem_get_info(device)[0]


class PressureMonitor:
    """Samples memory every `period_seconds` on its own thread and keeps the level. Probes
    are injectable: the tests replace the device probe (and may the host one)."""

    def __init__(
        self,
        thresholds: PressureThresholds,
        device_free: Callable[[], int] | None = None,
        host: Callable[[], tuple[int, int, int]] = host_probe,
    ) -> None:
        self.thresholds = thresholds
        self._device_free = device_free
        self._host = host
        self.level = "ok"
        # Which memory is below its tight line now ("host", "device"): what relief frees.
        self.short: frozenset[str] = frozenset()
        self.sample: MemorySample | None = None
        self.calm_since = time.monotonic()  # when the memory last met the current level
        self._swapped: tuple[float, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specd-pressure", daemon=True)
        self.changed = threading.Condition()  # notified at every sample (tests wait on it)

    def start(self) -> None:
        if self.thresholds.enabled:
            self.poll()
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.thresholds.period_seconds):
            try:
                self.poll()
            except Exception as exc:  # a probe failing must not stop the watch
                log.warning("sampling memory failed: %s", exc)

    def poll(self) -> str:
        """Take one sample and update the level (the thread calls this every period)."""
        now = time.monotonic()
        available, swapped, rss = self._host()
        rate = 0.0
        if self._swapped is not None and now > self._swapped[0]:
            rate = (swapped - self._swapped[1]) / (now - self._swapped[0])
        self._swapped = (now, swapped)
        device = self._device_free() if self._device_free is not None else None
        sample = MemorySample(now, available, rate, rss, device)
        level = self._level(sample)
        if level != self.level:
            log.warning(
                "memory pressure %s → %s (host available %.2f GiB, device free %s)",
                self.level, level, available / 2**30,
                "-" if device is None else f"{device / 2**30:.2f} GiB",
            )  # fmt: skip
        with self.changed:
            self.sample, self.level, self.short = sample, level, self._short(sample)
            self.changed.notify_all()
        return level

    def _level(self, s: MemorySample) -> str:
        """The level `s` reads as, from the current one: up at once, down only with the
        memory past its threshold by HYSTERESIS for recover_seconds."""
        t = self.thresholds
        raw = self._raw_level(s, slack=0.0)
        if LEVELS.index(raw) >= LEVELS.index(self.level):
            self.calm_since = s.at
            return raw
        if LEVELS.index(self._raw_level(s, slack=HYSTERESIS)) >= LEVELS.index(self.level):
            self.calm_since = s.at  # below the level's line with the slack: not calm yet
            return self.level
        if s.at - self.calm_since < t.recover_seconds:
            return self.level
        self.calm_since = s.at
        return LEVELS[LEVELS.index(self.level) - 1]  # one level at a time

    def _short(self, s: MemorySample) -> frozenset[str]:
        t = self.thresholds
        host = s.swap_rate > t.critical_swap_rate or (
            t.tight_host_free is not None and s.host_available < t.tight_host_free
        )
        device = (
            s.device_free is not None
            and t.tight_device_free is not None
            and s.device_free < t.tight_device_free
        )
        return frozenset(name for name, low in (("host", host), ("device", device)) if low)

    def _raw_level(self, s: MemorySample, slack: float) -> str:
        t = self.thresholds

        def below(free: int | None, line: int | None) -> bool:
            if free is None or line is None:
                return False
            return free < line + min(line * slack, MAX_SLACK)

        if (
            below(s.host_available, t.critical_host_free)
            or below(s.device_free, t.critical_device_free)
            or s.swap_rate > t.critical_swap_rate
        ):
            return "critical"
        if below(s.host_available, t.tight_host_free) or below(s.device_free, t.tight_device_free):
            return "tight"
        return "ok"
