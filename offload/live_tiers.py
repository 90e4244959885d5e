"""What a streamer changes while serving, between passes, when memory does (the memory
pressure steps of daemon/relief.py): resident layers join the stream (`demote`, packed into
host RAM of their own, their device memory freed) and come back (`promote`); the RAM tier
gives way to the disk tier (`to_disk`, its arena freed) and is read back (`to_ram`, on a
thread of its own, adopted at the start of the first pass after it finished). A mixin of
`LayerStreamer` (offload/stream.py), whose ring and passes it leaves as they are."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
from torch import nn

from offload.arena import HostArena
from offload.layout import FlatLayout, layer_state
from offload.slots import Slot
from offload.storage import DiskStorage, LayerStorage, RamStorage

log = logging.getLogger("specd.offload")


class LiveTiers:
    """The streamer's state these changes touch (set by `LayerStreamer.__init__`)."""

    device: torch.device
    layout: FlatLayout
    storage: LayerStorage
    staging: HostArena | None
    slots: list[Slot]
    resident: dict[int, nn.Module]
    order: list[int]
    states: dict[int, Sequence[tuple[str, Any]]]
    _holder: dict[int, Slot]
    # Layers that were resident and joined the stream at run time (`demote`): their host
    # bytes, and their modules (on the meta device until `promote` rebinds them).
    demoted: RamStorage | None
    _parked: dict[int, nn.Module]
    # The RAM tier being read back from the disk tier (`to_ram`), and its cancel flag.
    _refill: tuple[Future[RamStorage], threading.Event] | None
    _staged: bool  # the tier the streamer was built with reads through staging

    def wait_reads(self) -> None: ...

    def synchronize(self) -> None: ...

    @property
    def tier_layers(self) -> list[int]:
        """The streamed layers the host tier holds (those demoted at run time aside)."""
        return [i for i in self.order if i not in self._parked]

    def demote(self, layers: Sequence[int]) -> int:
        """Move resident `layers` into the stream: pack each into host RAM (page-locked on a
        GPU) and free its device memory. Returns the device bytes freed. One demotion at a
        time: `promote` first to demote again."""
        if self.demoted is not None:
            raise RuntimeError("resident layers were demoted already: promote them first")
        chosen = sorted(layers)
        missing = [i for i in chosen if i not in self.resident]
        if not chosen or missing:
            raise ValueError(f"not resident layers: {missing or 'none given'}")
        self.synchronize()  # the compute still queued may read the resident layers
        if self.states:  # per-layer types: the demoted layers' own, as build_streamer does
            for i in chosen:
                self.states[i] = layer_state(self.resident[i])
        modules = {i: self.resident[i] for i in chosen}
        self.demoted = pack_to_host(self.layout, modules, self.device)
        for i in chosen:
            del self.resident[i]
        self._parked = to_meta(modules)
        self.order = sorted([*self.order, *chosen])
        return self.layout.nbytes * len(chosen)

    def promote(self) -> list[int]:
        """Bring the demoted layers back to the device, resident as before (each in one
        flat buffer); returns their indices. Their host arena is released."""
        if self.demoted is None:
            return []
        self.wait_reads()
        self.synchronize()  # no copy into a slot, nor compute reading one, still under way
        back = sorted(self._parked)
        for slot in self.slots:
            if slot.layer in self._parked:
                del self._holder[slot.layer]
                slot.layer = None
        for i in back:
            flat = self.layout.empty(self.device)
            flat.copy_(self.demoted.buffers[i])
            module = self._parked.pop(i)
            self.layout.bind(module, flat)
            for name, state in self.states.pop(i, ()):
                cast: Any = module.get_submodule(name)
                cast.load_stream_state(state)
            self.resident[i] = module
        self.order = [i for i in self.order if i not in back]
        self.demoted.close()
        self.demoted = None
        return back

    def to_disk(self, disk: DiskStorage) -> int:
        """Stream from `disk` (the disk tier, over the same layers) instead of the RAM tier,
        whose arena is freed; returns the host bytes freed (0 if the tier is not RAM)."""
        self.cancel_refill()
        if not isinstance(self.storage, RamStorage):
            disk.close()
            return 0
        self.wait_reads()
        self.synchronize()  # no copy still reads the arena
        if self.staging is None:
            self.staging = HostArena(self.layout.nbytes, len(self.slots))
            self.staging.pin(self.device)
            for slot in self.slots:
                slot.staging = self.staging.view(slot.index)
        ram, self.storage = self.storage, disk
        freed = ram.host_bytes
        ram.close()
        return freed

    def to_ram(self) -> None:
        """Start reading the layers the disk tier streams back into a RAM tier, on a thread
        of its own; the first pass after the reads finish streams from RAM again."""
        disk = self.storage
        if not isinstance(disk, DiskStorage) or self._refill is not None:
            return
        layers = self.tier_layers
        ram = RamStorage(self.layout, layers)
        cancelled = threading.Event()

        def fill() -> RamStorage:
            for i in layers:
                if cancelled.is_set():
                    break
                ram.fill(i, disk)
            ram.pin(self.device)
            return ram

        pool = ThreadPoolExecutor(1, thread_name_prefix="specd-ram-refill")
        self._refill = (pool.submit(fill), cancelled)
        pool.shutdown(wait=False)

    @property
    def reading_back(self) -> bool:
        """Whether `to_ram`'s reads are under way (or done, not yet adopted)."""
        return self._refill is not None

    def cancel_refill(self) -> None:
        """Drop `to_ram`'s reads (waiting for the layer being read): the disk tier stays."""
        if self._refill is not None:
            done, cancelled = self._refill
            cancelled.set()
            wait_futures([done])
            if done.exception() is None:
                done.result().close()
            self._refill = None

    def _adopt_refill(self) -> None:
        """Between passes: stream from the RAM tier `to_ram` read, once it is complete."""
        if self._refill is None or not self._refill[0].done():
            return
        done, _ = self._refill
        self._refill = None
        error = done.exception()
        if error is not None:
            log.warning("reading the streamed layers back into RAM failed (%s): they stay "
                        "on the disk tier", error)  # fmt: skip
            return
        self.wait_reads()
        self.synchronize()  # no copy still reads a staging buffer
        disk, self.storage = self.storage, done.result()
        disk.close()
        if not self._staged and self.staging is not None:
            self.staging.close()
            self.staging = None
            for slot in self.slots:
                slot.staging = None

    def resident_modules(self) -> list[nn.Module]:
        """Every layer as a resident module, in order: for a streamer whose layers have all
        been promoted (`over_resident`'s, given back), to become the model's layers again."""
        if self.order:
            raise RuntimeError(f"layers {self.order} are still streamed")
        return [self.resident[i] for i in range(len(self.resident))]


def pack_to_host(
    layout: FlatLayout, modules: Mapping[int, nn.Module], device: torch.device | str
) -> RamStorage:
    """Pack `modules` (layer index → resident module) into a host arena of their own,
    page-locked for `device`. The modules are left as they are: a failure leaves nothing
    changed."""
    storage = RamStorage(layout, sorted(modules))
    try:
        for i, module in modules.items():
            storage.add(i, module)
    except BaseException:
        storage.close()
        raise
    storage.pin(torch.device(device))
    return storage


def to_meta(modules: Mapping[int, nn.Module]) -> dict[int, nn.Module]:
    """Move packed modules to the meta device, which frees their device memory."""
    for module in modules.values():
        module.to("meta")
    return dict(modules)


class NothingStreamed:
    """The host tier of a streamer made over resident layers: it streams only what was
    demoted, which comes from the streamer's own arena."""

    tier = "ram"
    needs_staging = False
    host_bytes = 0
    pinned = False

    def __init__(self, layout: FlatLayout) -> None:
        self.layout = layout

    def fetch(self, layer: int, staging: Any, after: Any = None) -> Future[torch.Tensor]:
        raise KeyError(f"layer {layer} is not streamed")

    def close(self) -> None:
        pass
