"""Routed experts offloaded by routing (`--experts stream`): every expert of every layer in
host RAM, one flat buffer each (pinned for a GPU), and a pool of device slots holding the
experts routed to most often (`ExpertCache`). A pass asks for the experts its tokens route
to, layer by layer; one already in a slot costs nothing, one that is not is copied into a
slot (never one this layer's pass still needs), one copy of its packed bytes. So a pass moves only the routed experts it lacks, and the bytes it moves
are counted (`ExpertStats`).

`--experts cpu` keeps the experts in host RAM and computes them there (`HostExperts`): the
routed tokens' rows go to the CPU and their outputs come back, a few KB where the expert is
MBs. Attention, norms and router stay on the device either way (the daemon places them).

This module sees an expert as an nn.Module and its tensors; it imports no model code.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from offload.layout import FlatLayout


@dataclass
class ExpertStats:
    """What routing cost so far: experts asked for, found in a slot, copied, their bytes,
    and per layer pass the distinct experts a pass woke (the sum and the count of layer
    passes, for a mean)."""

    asked: int = 0
    hits: int = 0
    copies: int = 0
    bytes_copied: int = 0
    layer_passes: int = 0
    woken: int = 0
    by_layer_pass: list[int] = field(default_factory=list)  # the latest pass's, per layer

    def to_dict(self) -> dict[str, float]:
        return {
            "experts_asked": self.asked,
            "expert_hits": self.hits,
            "expert_copies": self.copies,
            "expert_bytes_copied": self.bytes_copied,
            "hit_rate": self.hits / self.asked if self.asked else 0.0,
            "experts_woken_per_layer_pass": self.woken / self.layer_passes
            if self.layer_passes
            else 0.0,
        }


class ResidentExperts:
    """Every expert where its layer is (the plain model): nothing to fetch."""

    def __init__(self, layers: Sequence[Sequence[nn.Module]]) -> None:
        self.layers = [list(experts) for experts in layers]
        self.stats = ExpertStats()

    def prepare(self, layer: int, wanted: Sequence[int]) -> None:
        self.stats.layer_passes += 1
        self.stats.woken += len(wanted)
        self.stats.asked += len(wanted)
        self.stats.hits += len(wanted)

    def expert(self, layer: int, index: int) -> nn.Module:
        return self.layers[layer][index]


class HostExperts(ResidentExperts):
    """Experts kept in host RAM and computed there (`--experts cpu`): the block moves the
    routed rows to the expert's device and the outputs back."""


class ExpertCache:
    """Host copies of every routed expert and `slots` device slots (see the module), kept
    by routing frequency: each expert counts the layer passes it was routed in (halved
    every `AGE_EVERY` x the experts' count of requests, so the counts follow a changing
    text), a slot is worth its expert's count, and a missing expert evicts the least
    worth slot this layer pass does not need. An expert routed less often than that slot's
    goes to the bypass slot instead (the last one), so a rarely used expert does not push
    out a frequent one (TinyLFU's admission rule)."""

    AGE_EVERY = 8

    def __init__(
        self,
        layers: Sequence[Sequence[nn.Module]],  # experts of each layer, in host RAM
        device: torch.device | str,
        slots: int,
        pin: bool = False,
    ) -> None:
        if slots < 1:
            raise ValueError("an expert cache needs at least one device slot")
        template = layers[0][0]
        self.layout = FlatLayout.of(template)
        self.device = torch.device(device)
        self.expert_bytes = self.layout.nbytes
        # Host: one flat buffer per expert, packed once (the modules' own tensors then go).
        self.host: list[list[torch.Tensor]] = []
        for experts in layers:
            row = []
            for expert in experts:
                flat = torch.empty(self.layout.nbytes, dtype=torch.uint8, pin_memory=pin)
                self.layout.pack(expert, flat)
                row.append(flat)
            self.host.append(row)
        self.total = sum(len(row) for row in self.host)
        # Device: `slots` modules shaped like an expert, each bound to its own flat buffer.
        self.slots = min(slots, self.total)
        self.modules: list[nn.Module] = []
        self.flats: list[torch.Tensor] = []
        for _ in range(self.slots):
            module = copy.deepcopy(template)
            flat = self.layout.empty(self.device)
            self.layout.bind(module, flat)
            self.modules.append(module)
            self.flats.append(flat)
        self.holder: list[tuple[int, int] | None] = [None] * self.slots
        self.where: dict[tuple[int, int], int] = {}
        self.count: dict[tuple[int, int], float] = {}  # layer passes each expert was routed in
        self.worth = [-1.0] * self.slots  # each slot's expert's count (-1: empty)
        # The slots by worth, least first, for the victim of a miss: (worth, slot) entries,
        # an entry stale once its slot's worth changed (pushed again then). A miss scanned
        # every slot in Python: 33 ms per one-token layer pass over 1,383 slots, 0.6 s for
        # a tree's (a real-shape audit, 48 layers of 128 experts).
        self._by_worth = [(-1.0, s) for s in range(self.slots)]
        self.bypass = self.slots - 1 if self.slots > 1 else None
        self.pinned: set[int] = set()  # slots this layer pass still needs
        self.requests = 0
        self.stats = ExpertStats()

    def prepare(self, layer: int, wanted: Sequence[int]) -> None:
        """A layer pass will ask for `wanted` (distinct): counted, and the slots already
        holding them kept from eviction while it runs, as far as the slots allow (one to
        evict and the bypass stay free)."""
        self.stats.layer_passes += 1
        self.stats.woken += len(wanted)
        self.pinned = set()
        for e in wanted:
            key = (layer, e)
            self.count[key] = self.count.get(key, 0.0) + 1.0
            slot = self.where.get(key)
            if slot is not None:
                self._set_worth(slot, self.count[key])
                if len(self.pinned) < self.slots - 2:
                    self.pinned.add(slot)
        self.requests += len(wanted)
        if self.requests >= self.AGE_EVERY * self.total:  # older routing counts for less
            self.requests = 0
            self.count = {k: v / 2 for k, v in self.count.items() if v >= 0.5}
            self.worth = [w / 2 if w > 0 else w for w in self.worth]
            self._by_worth = [(w, s) for s, w in enumerate(self.worth)]
            heapq.heapify(self._by_worth)

    def _set_worth(self, slot: int, worth: float) -> None:
        if self.worth[slot] != worth:
            self.worth[slot] = worth
            heapq.heappush(self._by_worth, (worth, slot))
            if len(self._by_worth) > 4 * self.slots:  # mostly stale entries: rebuilt
                self._by_worth = [(w, s) for s, w in enumerate(self.worth)]
                heapq.heapify(self._by_worth)

    def _victim(self, key: tuple[int, int]) -> int:
        """The least worth slot this layer pass does not need, the lowest of equals (the
        bypass slot where the expert is rarer than it, or where no other is free)."""
        heap, skipped = self._by_worth, []
        victim = None
        while heap:
            worth, slot = heap[0]
            if worth != self.worth[slot]:
                heapq.heappop(heap)  # stale (the slot's current entry is further on)
                continue
            if slot in self.pinned or slot == self.bypass:
                skipped.append(heapq.heappop(heap))
                continue
            victim = slot
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        if victim is None:
            return self.bypass if self.bypass is not None else 0
        if self.bypass is not None and self.worth[victim] > self.count.get(key, 0.0):
            return self.bypass  # rarer than what it would push out
        return victim

    def expert(self, layer: int, index: int) -> nn.Module:
        """Expert `index` of `layer` on the device: its slot, after copying it there if no
        slot held it (see the class)."""
        key = (layer, index)
        self.stats.asked += 1
        slot = self.where.get(key)
        if slot is not None:
            self.stats.hits += 1
        else:
            slot = self._victim(key)
            old = self.holder[slot]
            if old is not None:
                del self.where[old]
            self.flats[slot].copy_(self.host[layer][index], non_blocking=True)
            self.holder[slot] = key
            self.where[key] = slot
            self.stats.copies += 1
            self.stats.bytes_copied += self.expert_bytes
        self._set_worth(slot, self.count.get(key, 0.0))
        self.pinned.discard(slot)  # used now: an expert is asked for once per layer pass
        return self.modules[slot]

    @property
    def device_bytes(self) -> int:
        return self.slots * self.expert_bytes

    @property
    def host_bytes(self) -> int:
        return self.total * self.expert_bytes
