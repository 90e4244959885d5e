"""One layer's tensors as one flat byte buffer, so moving a layer is one copy.

All decoder layers of a model share parameter names, shapes and dtypes, so a single
`FlatLayout` (computed from any one layer) describes every layer: where each tensor lives
inside the flat buffer. `pack` writes a layer into a buffer; `bind` makes a module's
parameters views into a buffer, which is how a device "slot" becomes whichever layer was
last copied into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ALIGN = 64  # bytes; keeps every view aligned for any dtype and for vectorised kernels


@dataclass(frozen=True)
class TensorSlot:
    name: str  # dotted name inside the layer module, e.g. "self_attn.q_proj.weight"
    offset: int  # bytes from the start of the flat buffer
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class FlatLayout:
    tensors: tuple[TensorSlot, ...]
    nbytes: int

    @classmethod
    def of(cls, layer: nn.Module) -> FlatLayout:
        """The layout of `layer` (any device, meta included: only shapes and dtypes count)."""
        entries: list[TensorSlot] = []
        offset = 0
        for name, tensor, is_param in _named_tensors(layer):
            entry = TensorSlot(name, offset, tuple(tensor.shape), tensor.dtype, is_param)
            entries.append(entry)
            offset = _align(offset + entry.nbytes)
        return cls(tuple(entries), offset)

    def check(self, layer: nn.Module) -> None:
        """Refuse a layer whose tensors differ from this layout (streaming relies on it)."""
        got = [(n, tuple(t.shape), t.dtype) for n, t, _ in _named_tensors(layer)]
        want = [(e.name, e.shape, e.dtype) for e in self.tensors]
        if got != want:
            raise ValueError(
                "layers differ in tensor names, shapes or dtypes; only layers of one shape "
                f"can share streaming slots (expected {want[:3]}..., got {got[:3]}...)"
            )

    def empty(self, device: torch.device | str) -> torch.Tensor:
        """A device buffer for one layer (host buffers come from a `HostArena`)."""
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a view into `flat` (a uint8 buffer of `nbytes`)."""
        return {
            e.name: flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
            for e in self.tensors
        }

    def pack(self, layer: nn.Module, flat: torch.Tensor) -> None:
        """Copy `layer`'s tensors into `flat` (casting to the layout's dtypes)."""
        self.check(layer)
        views = self.views(flat)
        for name, tensor, _ in _named_tensors(layer):
            views[name].copy_(tensor)

    def bind(self, layer: nn.Module, flat: torch.Tensor) -> None:
        """Make `layer`'s parameters and buffers views into `flat`: whatever is copied into
        `flat` afterwards is what the layer computes with."""
        views = self.views(flat)
        for e in self.tensors:
            owner_name, _, attr = e.name.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            if e.is_parameter:
                owner._parameters[attr] = nn.Parameter(views[e.name], requires_grad=False)
            else:
                owner._buffers[attr] = views[e.name]


def layer_state(layer: nn.Module) -> list[tuple[str, Any]]:
    """One layer's `stream_state()`s, by submodule name (see `layer_states`)."""
    return [
        (name, m.stream_state()) for name, m in layer.named_modules() if hasattr(m, "stream_state")
    ]


def _named_tensors(layer: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    params = [(n, p, True) for n, p in layer.named_parameters()]
    buffers = [(n, b, False) for n, b in layer.named_buffers()]
    return params + buffers


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layer_states(layers: Sequence[nn.Module]) -> dict[int, list[tuple[str, Any]]]:
    """What the layers' submodules hold besides tensors, per layer, where it differs
    between layers (a GGUF file's block type per projection): submodules with a
    `stream_state()` say what a streaming slot must take on to compute that layer
    (`load_stream_state`). Empty when every layer is alike (nothing to do per layer)."""
    states = {i: layer_state(layer) for i, layer in enumerate(layers)}
    if len({repr(s) for s in states.values()}) <= 1:
        return {}
    return states
