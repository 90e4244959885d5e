"""The layer streamer: a model's decoder layers, some resident on the compute device and the
rest brought there just in time through a small ring of device slots.

How a pass goes (S streamed layers, N >= 2 slots):

- A slot is a layer module whose parameters are views into one flat device buffer
  (`FlatLayout.bind`); streaming layer j into slot s is one copy of j's flat host buffer.
- Iterating the streamer yields the layers in order. Before yielding streamed layer j it
  makes sure the next N streamed layers (cyclically) each have a slot with a copy issued:
  the copies run on a dedicated copy stream while earlier layers compute, and the compute
  stream waits (an event) only for the layer it needs now.
- A slot is reused only after the compute that read it has finished: its `released` event
  is recorded on the compute stream after the layer's kernels were queued, and the copy
  stream waits for it before overwriting the slot.
- When a pass ends the ring wraps around: the first streamed layers of the next pass are
  copied right away, so they arrive while the draft builds the next tree (`prefetch()`
  does the same on demand, e.g. before the very first pass).
- With S <= N every streamed layer keeps its own slot and nothing is copied after the
  first pass.

On a CPU device the same code runs with host "slots" and synchronous copies, so the
bookkeeping (slot reuse, order, prefetch, wrap-around) is tested on every machine.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from offload.layout import FlatLayout
from offload.storage import LayerStorage


@dataclass
class StreamCounters:
    passes: int = 0
    copies: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0  # time the copies took (CUDA: copy-stream events)


@dataclass
class _Slot:
    index: int
    module: nn.Module
    flat: torch.Tensor  # (layout.nbytes,) uint8 on the compute device
    staging: torch.Tensor | None  # pinned host bytes for tiers that read through staging
    layer: int | None = None  # which layer the slot holds (or is being filled with)
    ready: torch.cuda.Event | None = None  # recorded on the copy stream after the copy
    released: torch.cuda.Event | None = None  # recorded on the compute stream after use
    timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)


class LayerStreamer:
    """A layer sequence for `Transformer.set_layers`: iterable in order, with a length."""

    def __init__(
        self,
        resident: Mapping[int, nn.Module],
        streamed: Sequence[int],
        storage: LayerStorage,
        template: nn.Module,
        device: torch.device | str,
        slots: int = 2,
    ) -> None:
        """`resident`: layer index → module already on `device`. `streamed`: the indices whose
        weights `storage` holds. `template`: any one layer (meta device is fine) copied to
        make the slot modules; its tensors are replaced by views into the slot buffers."""
        if slots < 2:
            raise ValueError(f"streaming needs at least 2 slots (got {slots})")
        self.device = torch.device(device)
        self.resident = dict(resident)
        self.order = sorted(streamed)
        total = len(self.resident) + len(self.order)
        if sorted([*self.resident, *self.order]) != list(range(total)):
            raise ValueError("resident and streamed layer indices must cover 0..n-1 exactly once")
        if not self.order:
            raise ValueError("nothing to stream: every layer is resident")
        self.storage = storage
        self.layout: FlatLayout = storage.layout
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.counters = StreamCounters()
        self.fetch_log: deque[int] = deque(maxlen=4096)  # layer indices in copy order
        self._holder: dict[int, _Slot] = {}
        self._clock = 0  # for least-recently-filled slot choice
        self._filled_at: dict[int, int] = {}
        self.slots = [self._make_slot(i, template, storage.needs_staging) for i in range(slots)]
        if self.copy_stream is not None:
            # The slot buffers come from the compute stream's memory pool, whose earlier
            # tenants may still be in use by queued kernels: the first copies wait for them.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    def _make_slot(self, index: int, template: nn.Module, staging: bool) -> _Slot:
        module = copy.deepcopy(template)
        flat = self.layout.empty(self.device)
        if self.copy_stream is not None:
            # Written on the copy stream: when freed, the allocator must not hand the memory
            # to the compute stream before the copies queued into it have finished.
            flat.record_stream(self.copy_stream)
        self.layout.bind(module, flat)
        stage = self.layout.empty("cpu", pin=self.cuda) if staging else None
        return _Slot(index, module.eval(), flat, stage)

    def __len__(self) -> int:
        return len(self.resident) + len(self.order)

    @property
    def streamed_layers(self) -> int:
        return len(self.order)

    def prefetch(self) -> None:
        """Start copying the first streamed layers of the next pass (no-op if under way)."""
        self._fill(0)

    def __iter__(self) -> Iterator[nn.Module]:
        self._fill(0)  # the first slots fill while resident layers compute
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        pos = 0
        finished = False
        try:
            for index in range(len(self)):
                if index in self.resident:
                    yield self.resident[index]
                    continue
                self._fill(pos)
                slot = self._holder[index]
                if compute is not None and slot.ready is not None:
                    compute.wait_event(slot.ready)
                yield slot.module
                # The caller has queued this layer's kernels by now: the slot is free once
                # they finish.
                slot.released = self._record(compute)
                pos += 1
            finished = True
            self.counters.passes += 1
        finally:
            if not finished:
                # Aborted mid-pass: whatever was queued may still read any slot.
                for s in self.slots:
                    s.released = self._record(compute)
            self._fill(0)  # wrap around: the next pass's first layers start now

    def _record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _fill(self, pos: int) -> None:
        """Make sure the next N streamed layers from position `pos` (cyclic) have slots."""
        count = min(len(self.slots), len(self.order))
        window = [self.order[(pos + k) % len(self.order)] for k in range(count)]
        for layer in window:
            if layer in self._holder:
                continue
            free = [s for s in self.slots if s.layer not in window]
            # Prefer an empty slot, then the one filled longest ago.
            slot = min(free, key=lambda s: (s.layer is not None, self._filled_at.get(s.index, -1)))
            self._copy(layer, slot)

    def _copy(self, layer: int, slot: _Slot) -> None:
        if slot.layer is not None:
            del self._holder[slot.layer]
        if slot.staging is not None and slot.ready is not None:
            slot.ready.synchronize()  # the previous copy out of this staging buffer is done
        source = self.storage.host_buffer(layer, slot.staging)  # (nbytes,) uint8, host
        if self.copy_stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.copy_stream):
                if slot.released is not None:
                    self.copy_stream.wait_event(slot.released)
                start.record(self.copy_stream)
                slot.flat.copy_(source, non_blocking=True)
                end.record(self.copy_stream)
            slot.ready = end
            slot.timing.append((start, end))
        else:
            t0 = time.perf_counter()
            slot.flat.copy_(source)
            self.counters.copy_seconds += time.perf_counter() - t0
        slot.layer = layer
        self._holder[layer] = slot
        self._clock += 1
        self._filled_at[slot.index] = self._clock
        self.fetch_log.append(layer)
        self.counters.copies += 1
        self.counters.bytes_copied += self.layout.nbytes

    def synchronize(self) -> None:
        """Wait for every copy issued so far and fold the CUDA copy timings into counters."""
        if self.copy_stream is None:
            return
        self.copy_stream.synchronize()
        for slot in self.slots:
            for start, end in slot.timing:
                self.counters.copy_seconds += start.elapsed_time(end) / 1000.0
            slot.timing.clear()

    def reset_counters(self) -> None:
        self.synchronize()
        self.counters = StreamCounters()

    def stats(self) -> dict[str, float | int | str]:
        """The streaming figures a generation reports (`--json` stats)."""
        self.synchronize()
        c = self.counters
        return {
            "streamed_layers": len(self.order),
            "stream_slots": len(self.slots),
            "host_tier": self.storage.tier,
            "stream_passes": c.passes,
            # Steady state: with more streamed layers than slots each pass copies them all;
            # otherwise they stay in their slots after the first pass.
            "streamed_bytes_per_pass": self.layout.nbytes * len(self.order)
            if len(self.order) > len(self.slots)
            else 0,
            "streamed_bytes_total": c.bytes_copied,
            "stream_seconds": c.copy_seconds,
            "stream_gbps": (c.bytes_copied / c.copy_seconds / 1e9) if c.copy_seconds else 0.0,
        }

    def device_buffers(self) -> list[torch.Tensor]:
        """The flat layer buffers this streamer holds on the compute device (N of them)."""
        return [s.flat for s in self.slots]
