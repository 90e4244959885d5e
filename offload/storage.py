"""Host tiers: where streamed layers wait between target passes.

- `RamStorage` (tier "ram"): each streamed layer packed once into its own flat buffer,
  pinned when the compute device is a GPU so the host→device copy is a single DMA.
- `DiskStorage` (tier "disk"): nothing kept in RAM; each time a layer is needed its tensors
  are read from the memory-mapped safetensors files into a pinned staging buffer (one per
  slot) and copied from there. Slower (bounded by the disk), but RAM holds only the staging.

Both hand the streamer a flat host buffer laid out by the same `FlatLayout`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn

from offload.layout import FlatLayout


class LayerStorage(Protocol):
    tier: str  # "ram" | "disk"
    layout: FlatLayout
    needs_staging: bool  # True: `host_buffer` fills the staging buffer it is given

    def host_buffer(self, layer: int, staging: torch.Tensor | None) -> torch.Tensor:
        """Layer `layer`'s flat bytes in host memory, ready to copy to the device."""
        ...

    @property
    def host_bytes(self) -> int:
        """RAM this tier holds (not counting staging)."""
        ...


class RamStorage:
    tier = "ram"
    needs_staging = False

    def __init__(self, layout: FlatLayout, pin: bool) -> None:
        self.layout = layout
        self.pinned = pin
        self.buffers: dict[int, torch.Tensor] = {}

    def add(self, index: int, module: nn.Module) -> None:
        """Pack layer `index` into its own flat host buffer. The module is not kept: the
        caller can free it right after (packing one layer at a time bounds peak RAM)."""
        flat = self.layout.empty("cpu", pin=self.pinned)
        self.layout.pack(module, flat)
        self.buffers[index] = flat

    def host_buffer(self, layer: int, staging: torch.Tensor | None) -> torch.Tensor:
        return self.buffers[layer]

    @property
    def host_bytes(self) -> int:
        return sum(int(b.numel()) for b in self.buffers.values())


# layer index → {tensor name in the layer (as in the layout) → (safetensors file, key)}
TensorSources = Mapping[int, Mapping[str, tuple[Path, str]]]


class DiskStorage:
    tier = "disk"
    needs_staging = True

    def __init__(self, layout: FlatLayout, sources: TensorSources) -> None:
        self.layout = layout
        wanted = {e.name for e in layout.tensors}
        for index, names in sources.items():
            missing = wanted - set(names)
            if missing:
                raise ValueError(
                    f"disk tier: layer {index} has no file source for {sorted(missing)[:3]}"
                )
        self.sources = {i: dict(s) for i, s in sources.items()}
        self._files: dict[Path, Any] = {}  # open safetensors handles (memory-mapped)

    def _file(self, path: Path) -> Any:
        handle = self._files.get(path)
        if handle is None:
            handle = safe_open(str(path), framework="pt", device="cpu")
            self._files[path] = handle
        return handle

    def host_buffer(self, layer: int, staging: torch.Tensor | None) -> torch.Tensor:
        if staging is None:
            raise ValueError("the disk tier reads through a staging buffer; none was given")
        views = self.layout.views(staging)
        for name, (path, key) in self.sources[layer].items():
            views[name].copy_(self._file(path).get_tensor(key))  # casts to the run dtype
        return staging

    @property
    def host_bytes(self) -> int:
        return 0


def tensor_files(files: Sequence[Path]) -> dict[str, Path]:
    """Which safetensors file holds each checkpoint key (headers only, no tensor data)."""
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                where[key] = path
    return where
