"""Placing a loaded model's decoder layers: some resident on the compute device, the rest
packed into a host tier and streamed (see stream.py). Knows layers only as modules of one
shape, nothing about any architecture."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from offload.layout import FlatLayout, layer_states
from offload.storage import DiskStorage, LayerStorage, RamStorage, TensorSources
from offload.stream import LayerStreamer

HOST_TIERS = ("ram", "disk")


def build_streamer(
    layers: Sequence[nn.Module],
    resident: Sequence[int],
    device: torch.device | str,
    slots: int,
    tier: str = "ram",
    disk_sources: TensorSources | None = None,
) -> LayerStreamer:
    """Move the `resident` layers to `device`, hand the others to the host tier, and return
    the streamer that replaces the model's layer list. Streamed modules are moved to the
    meta device as they are packed, so their original host copies are freed."""
    device = torch.device(device)
    streamed = [i for i in range(len(layers)) if i not in set(resident)]
    if not streamed:
        raise ValueError("nothing to stream: every layer is resident")
    if tier not in HOST_TIERS:
        raise ValueError(f"host tier {tier!r} is not one of {', '.join(HOST_TIERS)}")
    layout = FlatLayout.of(layers[streamed[0]])
    states = {i: s for i, s in layer_states(layers).items() if i in streamed}
    for layer in layers:
        layout.check(layer)
    storage: LayerStorage
    if tier == "ram":
        ram = RamStorage(layout, streamed)
        for i in streamed:
            ram.add(i, layers[i])
            layers[i].to("meta")
        ram.pin(device)  # page-locks the whole arena at once, now that it is filled
        storage = ram
    else:
        if disk_sources is None:
            raise ValueError("the disk tier needs the checkpoint files the layers come from")
        storage = DiskStorage(layout, {i: disk_sources[i] for i in streamed})
        for i in streamed:
            layers[i].to("meta")
    resident_modules = {i: layers[i].to(device) for i in resident}
    return LayerStreamer(
        resident_modules, streamed, storage, layers[streamed[0]], device, slots, states
    )
