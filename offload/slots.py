"""A streaming slot's bookkeeping: which layer it holds, the copy on its way, and the timing
of its copies (CUDA events, or host marks on a CPU), folded into the streamer's counters as
they complete."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

# Copies a slot may have timed but not yet folded into the counters. A copy stream runs its
# copies in order, so waiting for the oldest of more than this many only throttles a compute
# thread that has run that far ahead of the bus.
MAX_TIMED_COPIES = 4


@dataclass
class StreamCounters:
    passes: int = 0
    copies: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0  # time the copies took (CUDA: copy-stream events)


class TimingEvent(Protocol):
    """A `torch.cuda.Event(enable_timing=True)`, or its host stand-in `HostMark`."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    # milliseconds from this event to `end_event` (an event of the same kind)
    def elapsed_time(self, end_event: Any) -> float: ...


class HostMark:
    """A host-side timing event: complete as soon as it exists (host copies are synchronous),
    so the CPU path runs the same timing bookkeeping as CUDA events do."""

    def __init__(self) -> None:
        self.time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: Any) -> float:
        assert isinstance(end_event, HostMark)
        return (end_event.time - self.time) * 1000.0


@dataclass
class CopyTimes:
    """A slot's timed copies whose time is not yet counted, oldest first."""

    pending: deque[tuple[TimingEvent, TimingEvent]] = field(default_factory=deque)

    def add(self, start: TimingEvent, end: TimingEvent) -> float:
        """Record one copy; return the seconds of the copies that could be folded now."""
        self.pending.append((start, end))
        return self.fold()

    def fold(self, wait: bool = False) -> float:
        """Seconds of the completed copies, which are forgotten; `wait`: all of them."""
        seconds = 0.0
        while self.pending:
            start, end = self.pending[0]
            if not (wait or len(self.pending) > MAX_TIMED_COPIES or end.query()):
                break  # copies complete in order: the later ones are not done either
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000.0
            self.pending.popleft()
        return seconds


@dataclass
class Slot:
    index: int
    module: nn.Module
    flat: torch.Tensor  # (layout.nbytes,) uint8 on the compute device
    staging: torch.Tensor | None  # host bytes for tiers that read through staging
    layer: int | None = None  # which layer the slot holds (or is being filled with)
    pending: Future[torch.Tensor] | None = None  # host bytes on their way, copy not issued
    ready: torch.cuda.Event | None = None  # recorded on the copy stream after the copy
    released: torch.cuda.Event | None = None  # recorded on the compute stream after use
    timing: CopyTimes = field(default_factory=CopyTimes)
