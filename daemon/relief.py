"""The relief ladder (DESIGN.md, "Memory pressure"): reversible steps the engine takes
under memory pressure, cheapest first, and undoes newest first when it is gone.

Order: the prefix cache's memory, the conversations kept for reuse, smaller passes, the
CUDA graphs' pools, then resident target layers into the stream. Under `tight` one more
step each period while the level stays; at `critical` every step at once, and new requests
are refused with 503 while the level is critical (running ones finish); back at `ok`, the
newest step is undone, one per `recover_seconds`. Steps run on the engine's thread, between
passes, so none of them races a pass. daemon/pressure.py reads the levels.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil
from torch import nn

from daemon.pools import SessionPool, StrategyPool
from daemon.pressure import PressureThresholds
from daemon.target_loading import disk_sources
from modeling.checkpoints.folder_files import CheckpointError
from modeling.compiled import CompiledPasses
from offload.layout import FlatLayout
from offload.storage import DiskStorage, RamStorage
from offload.stream import LayerStreamer
from offload.units import format_size
from speculative.batching import PassBounds

if TYPE_CHECKING:
    from daemon.runtime import Runtime

log = logging.getLogger("specd.pressure")


@dataclass
class Step:
    """One relief step: `take` frees what it can and returns a line for the log; `undo`
    gives it back. `available` False: nothing to do on this machine (skipped). `device`,
    `host`: what it frees, device memory or host RAM; a step is taken only while memory it
    frees is short (an out-of-memory pass takes the next that frees the device's)."""

    name: str
    take: Callable[[], str]
    undo: Callable[[], None]
    available: bool = True
    device: bool = True
    host: bool = True

    def frees(self, short: frozenset[str]) -> bool:
        return (self.device and "device" in short) or (self.host and "host" in short)


BOTH = frozenset({"host", "device"})


@dataclass
class Relief:
    """The ladder: `steps` in order, cheapest first; `held` the indices of those in force,
    in the order they were taken (undone newest first)."""

    steps: list[Step]
    held: list[int] = field(default_factory=list)
    last_change: float = field(default_factory=time.monotonic)
    counts: dict[str, int] = field(default_factory=dict)  # times each step was taken

    @property
    def taken(self) -> int:
        return len(self.held)

    @property
    def in_force(self) -> list[str]:
        return [self.steps[i].name for i in self.held]

    def follow(
        self, level: str, thresholds: PressureThresholds, short: frozenset[str] = BOTH
    ) -> None:
        """Climb or descend for the monitor's `level`, taking steps that free what is
        `short` ("host", "device"): at `critical` every such step now; at `tight` one more
        per period; at `ok` (which the monitor reports only once the memory has been back
        for recover_seconds) one step undone per recover_seconds."""
        now = time.monotonic()
        if level == "critical":
            while self.climb("memory pressure critical", short):
                pass
        elif level == "tight":
            if not self.held or now - self.last_change >= thresholds.period_seconds:
                self.climb("memory pressure tight", short)
        elif self.held and now - self.last_change >= thresholds.recover_seconds:
            self.descend()

    def climb(self, why: str, short: frozenset[str] = BOTH) -> bool:
        """Take the first step not in force that frees memory of a kind in `short`; False
        when there is none."""
        for index, step in enumerate(self.steps):
            if index in self.held or not step.available or not step.frees(short):
                continue
            try:
                said = step.take()
            finally:
                # In force once done (what the status reports); one that failed is passed
                # over, not tried again at every pass.
                self.held.append(index)
            self.counts[step.name] = self.counts.get(step.name, 0) + 1
            self.last_change = time.monotonic()
            log.warning("%s: %s (%s)", why, step.name, said)
            return True
        return False

    def descend(self) -> None:
        """Undo the newest step in force."""
        if self.held:
            step = self.steps[self.held.pop()]
            step.undo()
            self.last_change = time.monotonic()
            log.info("memory pressure eased: %s undone", step.name)


# The pass-size step keeps this share of a pass's tokens and rows (trees get a quarter of
# the nodes, prefill chunks a quarter of the tokens).
PASS_SHARE = 4


def relief_steps(
    runtime: Runtime,
    sessions: SessionPool,
    strategies: StrategyPool,
    passes: PassBounds,
    device_watched: bool,
    host_floor: int,
) -> list[Step]:
    """The steps the engine can take, cheapest first: the prefix cache's memory (its
    chunks freed, not only its rows forgotten), the conversations kept for reuse (their KV
    caches), smaller passes (trees and prefill chunks, so fewer logit rows and activations
    at once), the CUDA graphs' pools, and resident target layers moved into the stream.
    `device_watched`: the monitor reads a device's free memory (steps that free only device
    memory are offered then). `host_floor`: host RAM a step may not take below."""
    saved: dict[str, Any] = {}
    cache = runtime.prefix_cache
    gpu = runtime.device.type == "cuda"

    def empty_cache() -> str:
        return f"{cache.shrink(0) / 2**20:.0f} MiB freed"

    def drop_sessions() -> str:
        saved["sessions"], dropped = sessions.capacity, len(sessions)
        sessions.clear()
        sessions.capacity = 0
        return f"{dropped} conversations' KV caches freed"

    def keep_sessions() -> None:
        sessions.capacity = saved["sessions"]

    def shrink_passes() -> str:
        saved["passes"] = (passes.max_pass_tokens, passes.max_pass_rows)
        passes.max_pass_tokens = max(passes.max_pass_tokens // PASS_SHARE, 1)
        passes.max_pass_rows = max(passes.max_pass_rows // PASS_SHARE, 1)
        strategies.shorten_prefill(PASS_SHARE)
        return (
            f"passes of at most {passes.max_pass_tokens} tokens, {passes.max_pass_rows} rows, "
            f"prefill chunks a {PASS_SHARE}th as long"
        )

    def restore_passes() -> None:
        passes.max_pass_tokens, passes.max_pass_rows = saved["passes"]
        strategies.shorten_prefill(1)

    graphs = GraphPools(runtime)
    layers = TargetLayers(runtime, host_floor)
    tier = HostTier(runtime)
    return [
        # With a GPU the cache is pinned host RAM: it frees host memory, not the device's.
        Step("prefix_cache", empty_cache, cache.restore, cache.max_bytes > 0, device=not gpu),
        # KV caches, activations and graph pools live on the compute device.
        Step("cached_sessions", drop_sessions, keep_sessions, sessions.capacity > 0, host=not gpu),
        Step("pass_size", shrink_passes, restore_passes, host=not gpu),
        Step("graph_pools", graphs.release, graphs.resume, available=gpu, host=False),
        # Moving layers to host RAM frees the device's memory only.
        Step(
            "resident_layers",
            layers.demote,
            layers.promote,
            available=device_watched and layers.possible() is None,
            host=False,
        ),
        # The streamed layers' RAM tier freed; they stream from the checkpoint's files.
        Step("disk_tier", tier.to_disk, tier.to_ram, tier.possible() is None, device=False),
    ]


class GraphPools:
    """The `graph_pools` step: the CUDA graphs of every model's compiled passes dropped
    (their pools' memory back to the allocator) and none captured while it is in force;
    the models' steps run compiled but uncaptured meanwhile."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def _graphs(self) -> list[Any]:
        models = [self.runtime.target, self.runtime.draft]
        # A model's passes may be any HiddenStatesPass; CompiledPasses are what hold graphs.
        passes = [
            m.compiled for m in models if m is not None and isinstance(m.compiled, CompiledPasses)
        ]
        return [p.graphs for p in passes if p.graphs is not None]

    def release(self) -> str:
        # Looked up when taken: a daemon's passes may have finished compiling since start.
        dropped = sum(g.release() for g in self._graphs())
        return f"{dropped} CUDA graphs dropped, none captured until eased"

    def resume(self) -> None:
        for g in self._graphs():
            g.resume()


class TargetLayers:
    """The `resident_layers` step: half of the target's resident decoder layers (rounded up)
    join the stream, packed into host RAM, so their device memory is freed; undone, they
    are resident again. A target with no streamer gets one over its resident layers (two
    slots), which is worth it only when more than two layers move."""

    def __init__(self, runtime: Runtime, host_floor: int) -> None:
        self.runtime = runtime
        self.host_floor = host_floor
        self.made: LayerStreamer | None = None  # a streamer this step made (none before)
        self.moved: list[int] = []

    def _resident(self) -> list[int]:
        streamer = self.runtime.streamer
        if streamer is not None:
            return sorted(streamer.resident)
        return list(range(len(self.runtime.target.layers)))

    def _count(self) -> int:
        return math.ceil(len(self._resident()) / 2)

    def possible(self) -> str | None:
        """Why the step cannot be taken here, or None."""
        runtime = self.runtime
        if runtime.target.compiled is not None:
            # Compiled passes were traced over the resident layers (and CUDA graphs read
            # their addresses); the layer list must not change under them.
            return "the target's passes are compiled"
        if runtime.draft_kind == "substitute":
            # The substitute shares the target's resident layers: they would stay on the
            # device through it, so nothing would be freed.
            return "the substitute draft shares the resident layers"
        count = self._count()
        if count == 0 or (runtime.streamer is None and count <= STREAM_SLOTS):
            return f"{len(self._resident())} resident layers: too few to free memory by streaming"
        return None

    def demote(self) -> str:
        why = self.possible()
        if why is not None:
            return f"nothing moved: {why}"
        runtime = self.runtime
        resident = self._resident()
        chosen = resident[-self._count() :]  # the last: the plan streams from the end too
        streamer = runtime.streamer
        layer_bytes = (
            streamer.layout.nbytes if streamer is not None else _layer_bytes(runtime.target)
        )
        need = layer_bytes * len(chosen)
        available = psutil.virtual_memory().available
        if available - need < self.host_floor:
            return (
                f"nothing moved: {format_size(need)} of host RAM needed, "
                f"{format_size(available)} available"
            )
        if streamer is None:
            assert isinstance(runtime.target.layers, nn.ModuleList)  # no streamer: its own
            layers = list(runtime.target.layers)
            streamer = LayerStreamer.over_resident(
                layers, chosen, runtime.device, slots=STREAM_SLOTS
            )
            runtime.target.set_layers(streamer)
            runtime.streamer = self.made = streamer
            freed = need - STREAM_SLOTS * layer_bytes
        else:
            freed = streamer.demote(chosen)
        self.moved = chosen
        return f"target layers {chosen} streamed from host RAM, {format_size(freed)} freed"

    def promote(self) -> None:
        if not self.moved:
            return
        streamer = self.runtime.streamer
        assert streamer is not None
        streamer.promote()
        if self.made is not None:
            self.runtime.target.set_layers(nn.ModuleList(streamer.resident_modules()))
            streamer.close()
            self.runtime.streamer = self.made = None
        log.info("target layers %s resident again", self.moved)
        self.moved = []


class HostTier:
    """The `disk_tier` step: a target streamed from RAM streams from its checkpoint's
    files instead (the disk tier, through page-locked staging buffers), and the RAM its
    layers held is freed; undone, they are read back into RAM on a thread of their own
    and streamed from there once complete. Each pass then waits for the disk: the slowest
    step, and the last."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.moved = False

    def possible(self) -> str | None:
        """Why the step cannot be taken here, or None."""
        runtime = self.runtime
        if runtime.streamer is not None and runtime.streamer.reading_back:
            return None  # eased a moment ago, and back: the read-back is cancelled
        if runtime.streamer is None or not isinstance(runtime.streamer.storage, RamStorage):
            return "no target layers stream from RAM"
        if runtime.options.quantize is not None:
            return f"the layers were quantized at load (--quantize {runtime.options.quantize})"
        return None

    def to_disk(self) -> str:
        why = self.possible()
        if why is not None:
            return f"nothing moved: {why}"
        streamer = self.runtime.streamer
        assert streamer is not None
        if streamer.reading_back:
            streamer.cancel_refill()
            self.moved = True
            return "reading the layers back into RAM cancelled: they stay on the disk tier"
        layers = streamer.tier_layers
        names = [e.name for e in streamer.layout.tensors]
        try:
            sources = disk_sources(self.runtime.checkpoint, layers, names, self.runtime.dtype)
            disk = DiskStorage(streamer.layout, sources)
        except (CheckpointError, ValueError) as e:
            return f"nothing moved: {e}"
        freed = streamer.to_disk(disk)
        self.moved = True
        return f"{len(layers)} streamed layers read from disk, {format_size(freed)} of RAM freed"

    def to_ram(self) -> None:
        if self.moved and self.runtime.streamer is not None:
            self.runtime.streamer.to_ram()
            log.info("reading the streamed layers back into RAM")
        self.moved = False


# Device slots of a streamer made by the `resident_layers` step (the fewest that stream).
STREAM_SLOTS = 2


def _layer_bytes(model: Any) -> int:
    return FlatLayout.of(model.layers[0]).nbytes
