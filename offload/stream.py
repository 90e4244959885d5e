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

- A slot's host bytes arrive as a future from the host tier: at once for RAM, from the
  disk tier's reader thread otherwise. The read starts when the slot is assigned (so the
  wrap-around and `prefetch()` read ahead too) and is joined, on the compute thread, right
  before the slot's host→device copy is issued: when the layer is needed, or earlier at any
  step that finds the read already done.
- Copy timings are folded into the counters as their events complete, so each slot holds at
  most `MAX_TIMED_COPIES` event pairs however long a generation runs.
- Under memory pressure resident layers can join the stream (`demote`): each is packed into
  a host arena of its own and its device memory freed; `promote` brings them back. A
  streamer may even be made over a model whose layers were all resident
  (`LayerStreamer.over_resident`), and handed back as plain modules once promoted. The
  RAM tier can give way to the disk tier (`to_disk`, freeing its arena) and be read back
  (`to_ram`: on a thread of its own, adopted at the start of a pass once complete).

On a CPU device the same code runs with host "slots" and synchronous copies, so the
bookkeeping (slot reuse, order, prefetch, wrap-around, read-ahead, timing) is tested on every
machine.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
from torch import nn

from offload.arena import HostArena
from offload.layout import FlatLayout, layer_states
from offload.live_tiers import LiveTiers, NothingStreamed, pack_to_host, to_meta
from offload.slots import HostMark, Slot, StreamCounters
from offload.storage import LayerStorage

log = logging.getLogger("specd.offload")


class LayerStreamer(LiveTiers):
    """A layer sequence for `Transformer.set_layers`: iterable in order, with a length."""

    def __init__(
        self,
        resident: Mapping[int, nn.Module],
        streamed: Sequence[int],
        storage: LayerStorage,
        template: nn.Module,
        device: torch.device | str,
        slots: int = 2,
        states: Mapping[int, Sequence[tuple[str, Any]]] | None = None,
    ) -> None:
        """`resident`: layer index → module already on `device`. `streamed`: the indices whose
        weights `storage` holds. `template`: any one layer (meta device is fine) copied to
        make the slot modules; its tensors are replaced by views into the slot buffers.
        `states`: per streamed layer, what its submodules hold besides tensors where layers
        differ (`layer_states`), put into a slot's modules whenever it computes that layer."""
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
        self.states = dict(states or {})
        self.layout: FlatLayout = storage.layout
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.counters = StreamCounters()
        self.fetch_log: deque[int] = deque(maxlen=4096)  # layer indices in copy order
        self._holder: dict[int, Slot] = {}
        self._clock = 0  # for least-recently-filled slot choice
        self._filled_at: dict[int, int] = {}
        # One arena for every slot's staging (page-locked on a GPU), sized like the plan's.
        self.staging: HostArena | None = None
        if storage.needs_staging:
            self.staging = HostArena(self.layout.nbytes, slots)
            self.staging.pin(self.device)
        self.slots = [self._make_slot(i, template) for i in range(slots)]
        # What changes while serving (offload/live_tiers.py): none of it yet.
        self.demoted = None
        self._parked = {}
        self._refill = None
        self._staged = self.staging is not None
        if self.copy_stream is not None:
            # The slot buffers come from the compute stream's memory pool, whose earlier
            # tenants may still be in use by queued kernels: the first copies wait for them.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    def _make_slot(self, index: int, template: nn.Module) -> Slot:
        module = copy.deepcopy(template)
        flat = self.layout.empty(self.device)
        if self.copy_stream is not None:
            # Written on the copy stream: when freed, the allocator must not hand the memory
            # to the compute stream before the copies queued into it have finished.
            flat.record_stream(self.copy_stream)
        self.layout.bind(module, flat)
        stage = self.staging.view(index) if self.staging is not None else None
        return Slot(index, module.eval(), flat, stage)

    def __len__(self) -> int:
        return len(self.resident) + len(self.order)

    @property
    def streamed_layers(self) -> int:
        return len(self.order)

    @property
    def host_bytes(self) -> int:
        """RAM the host tier allocated: its layers, or the staging buffers (what the plan's
        `host_bytes` predicts)."""
        staging = self.staging.nbytes if self.staging is not None else 0
        demoted = self.demoted.host_bytes if self.demoted is not None else 0
        return self.storage.host_bytes + staging + demoted

    @property
    def host_pinned(self) -> bool:
        """Whether the host bytes copied from are page-locked (asynchronous DMA)."""
        return self.staging.pinned if self.staging is not None else self.storage.pinned

    def prefetch(self) -> None:
        """Start copying the first streamed layers of the next pass (no-op if under way)."""
        self._fill(0)

    def __iter__(self) -> Iterator[nn.Module]:
        self._adopt_refill()
        self._retry_failed_reads()
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
                if slot.pending is not None:
                    self._land(slot)  # joins the read: a reader error surfaces here
                if compute is not None and slot.ready is not None:
                    compute.wait_event(slot.ready)
                for name, state in self.states.get(index, ()):
                    module: Any = slot.module.get_submodule(name)
                    module.load_stream_state(state)
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
        """Make sure the next N streamed layers from position `pos` (cyclic) have slots, and
        issue the device copies of those whose host bytes are ready."""
        count = min(len(self.slots), len(self.order))
        window = [self.order[(pos + k) % len(self.order)] for k in range(count)]
        for layer in window:
            if layer in self._holder:
                continue
            free = [s for s in self.slots if s.layer not in window]
            # Prefer an empty slot, then the one filled longest ago.
            slot = min(free, key=lambda s: (s.layer is not None, self._filled_at.get(s.index, -1)))
            self._assign(layer, slot)
        self._land_finished_reads()

    def _land_finished_reads(self) -> None:
        for slot in self.slots:
            # A failed read is left pending: it is raised where its layer is needed.
            if slot.pending is not None and slot.pending.done() and not slot.pending.exception():
                self._land(slot)

    def wait_reads(self) -> None:
        """Wait for the host tier's reads under way (read-ahead included) and issue their
        copies."""
        wait_futures([s.pending for s in self.slots if s.pending is not None])
        self._land_finished_reads()

    def _retry_failed_reads(self) -> None:
        """Read again what a previous pass's read-ahead failed to read: a failure is raised
        where its layer is needed, and a new pass needs it from a fresh read (the file may
        be readable again), not the stale error."""
        for slot in self.slots:
            if slot.pending is not None and slot.pending.done() and slot.pending.exception():
                assert slot.layer is not None
                self._assign(slot.layer, slot)

    def _assign(self, layer: int, slot: Slot) -> None:
        """Give `slot` to `layer` and start getting its host bytes (disk: a background read)."""
        if slot.layer is not None:
            del self._holder[slot.layer]
        if slot.pending is not None and not slot.pending.done():
            # A read for a layer no longer wanted (an aborted pass moved the window). If it
            # already runs, the new read into the same staging is queued behind it.
            slot.pending.cancel()
        # The staging buffer is overwritten only once the device copied its previous layer.
        storage = self.demoted if layer in self._parked else self.storage
        assert storage is not None
        slot.pending = storage.fetch(layer, slot.staging, slot.ready)
        slot.layer = layer
        self._holder[layer] = slot
        self._clock += 1
        self._filled_at[slot.index] = self._clock
        self.fetch_log.append(layer)

    def _land(self, slot: Slot) -> None:
        """Join the slot's host bytes and issue their copy into the slot."""
        assert slot.pending is not None and slot.layer is not None
        pending, slot.pending = slot.pending, None
        try:
            source = pending.result()  # (nbytes,) uint8, host
        except BaseException:
            # Nothing usable landed: forget the layer so the next pass fetches it again.
            del self._holder[slot.layer]
            slot.layer = None
            raise
        if self.copy_stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.copy_stream):
                if slot.released is not None:
                    self.copy_stream.wait_event(slot.released)
                start.record(self.copy_stream)
                slot.flat.copy_(source, non_blocking=True)
                end.record(self.copy_stream)
            slot.ready = end
            self.counters.copy_seconds += slot.timing.add(start, end)
        else:
            begin = HostMark()
            slot.flat.copy_(source)
            self.counters.copy_seconds += slot.timing.add(begin, HostMark())
        self.counters.copies += 1
        self.counters.bytes_copied += self.layout.nbytes

    def synchronize(self) -> None:
        """Wait for every copy issued so far and fold every copy's time into the counters.
        Reads already done get their copies issued first; reads still under way are not
        waited for (stats at the end of a request should not wait for the disk)."""
        self._land_finished_reads()
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        for slot in self.slots:
            self.counters.copy_seconds += slot.timing.fold(wait=True)

    def timed_copies_pending(self) -> int:
        """Timing event pairs held, not yet folded (bounded: N slots × MAX_TIMED_COPIES)."""
        return sum(len(s.timing.pending) for s in self.slots)

    @classmethod
    def over_resident(
        cls,
        layers: Sequence[nn.Module],
        demote: Sequence[int],
        device: torch.device | str,
        slots: int = 2,
    ) -> LayerStreamer:
        """A streamer over a model whose `layers` are all resident on `device`, streaming
        the `demote` ones from host RAM (each packed, then its device memory freed)."""
        layout = FlatLayout.of(layers[0])
        for layer in layers:
            layout.check(layer)
        chosen = sorted(demote)
        states = {i: s for i, s in layer_states(layers).items() if i in chosen}
        resident = {i: m for i, m in enumerate(layers) if i not in chosen}
        modules = {i: layers[i] for i in chosen}
        demoted = pack_to_host(layout, modules, device)
        try:  # the slots are allocated on the device before any layer leaves it
            template = copy.deepcopy(layers[chosen[0]]).to("meta")
            streamer = cls(
                resident, chosen, NothingStreamed(layout), template, device, slots, states
            )
        except BaseException:
            demoted.close()
            raise
        # Everything it streams came from the device, so `promote` gives all of it back.
        streamer.demoted, streamer._parked = demoted, to_meta(modules)
        return streamer

    def close(self) -> None:
        """Finish what is under way and release the host tier (unpinning its memory)."""
        self.cancel_refill()
        self.wait_reads()
        self.synchronize()
        self.storage.close()
        if self.demoted is not None:
            self.demoted.close()
        if self.staging is not None:
            self.staging.close()

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
            "host_bytes": self.host_bytes,
            "host_pinned": int(self.host_pinned),
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
