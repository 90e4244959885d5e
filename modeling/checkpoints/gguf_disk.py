"""A GGUF target's streamed layers read from its file at every pass (the disk tier,
offload/storage.py `DiskStorage`), for a model larger than the RAM left for it: each tensor
of a layer is a `GGUFTensorReader`, which reads its rows with one positioned read (never
through the loader's memory map: a file cut short under a running daemon is then an
error, not a SIGBUS) and converts them exactly as loading does (`gguf_model.held`: the
converter's row order undone, blocks kept in their room, float tensors decoded)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from modeling.checkpoints.gguf_file import GGUFContents, TensorInfo
from modeling.checkpoints.gguf_model import GGUFError, gguf_parts, held
from modeling.config import ModelConfig
from modeling.decoder import Transformer
from modeling.models import architecture
from modeling.weights.gguf_blocks import FLOAT_TYPES, block_type
from modeling.weights.projections import fused_parts

# Reads `len(buffer)` bytes of the file at `path` from byte `start` into `buffer`.
ReadBytes = Callable[[Path, int, memoryview], None]


@dataclass(frozen=True)
class GGUFTensorReader:
    """One tensor of a streamed layer (or its rows of a stacked one) in a GGUF file."""

    path: Path
    key: str  # the file's tensor name, for messages
    shape: tuple[int, ...]  # as the layer holds it, in `dtype`
    dtype: torch.dtype
    start: int  # the bytes of the file read (absolute offsets)
    end: int
    convert: Callable[[torch.Tensor], torch.Tensor]  # the stored rows → the layer's tensor
    # The stored bytes are the layer's, at its start (blocks in a wider room: the rest is
    # zeros): read straight into the staging buffer.
    direct: bool

    def read_into(self, dest: torch.Tensor, read: ReadBytes) -> None:
        """Fill `dest` (this tensor's view of a staging buffer, `shape` in `dtype`). Bytes
        as stored are read in place; others (rows reordered, a float tensor of another
        dtype) through a scratch copy and their conversion (`disk_scratch_bytes`)."""
        if self.direct:
            flat = dest.view(-1).view(torch.uint8)
            n = self.end - self.start
            read(self.path, self.start, flat[:n].numpy().data)
            flat[n:].zero_()
            return
        raw = torch.empty(self.end - self.start, dtype=torch.uint8)
        read(self.path, self.start, raw.numpy().data)
        dest.copy_(self.convert(raw).view(self.shape))


def gguf_disk_sources(
    contents: GGUFContents,
    cfg: ModelConfig,
    dtype: torch.dtype,
    layers: list[int],
    layer_names: list[str],
) -> dict[int, dict[str, list[GGUFTensorReader]]]:
    """For each of `layers`, each tensor the streamer moves (`layer_names`, relative to the
    layer) as the readers of its stored parts, in the order their bytes follow one another
    in the layer's tensor (a fused projection's parts by row)."""
    arch = architecture(cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    parts = fused_parts(model)
    experts = cfg.moe.experts if cfg.moe is not None else 0
    stored: dict[str, tuple[TensorInfo, int, int, tuple[int, ...]]] = {}
    for info in contents.tensors:
        for name, first, end, ne in gguf_parts(info, arch, experts):
            if name is not None and name.startswith("layers."):
                stored[name] = (info, first, end, ne)

    def reader(name: str, module: torch.nn.Module | None) -> GGUFTensorReader:
        if name not in stored:
            raise GGUFError(f"{contents.path}: the disk tier finds no tensor for {name}")
        info, first, end, ne = stored[name]
        row_bytes = info.n_bytes // max(prod(info.ne[1:]), 1)
        if module is not None:
            shape, held_dtype = tuple(module.get_buffer("blocks").shape), torch.uint8
        elif name in parts:
            fused, row, last = parts[name]
            shape = (last - row, *model.get_parameter(fused).shape[1:])
            held_dtype = dtype
        else:
            shape, held_dtype = tuple(model.get_parameter(name).shape), dtype

        def convert(raw: torch.Tensor) -> torch.Tensor:
            rows = arch.gguf_tensor(cfg, name, raw.view(end - first, row_bytes), ne)
            return held(cfg, name, rows, info.ggml_type, ne, module, dtype, "cpu")

        # Rows the architecture leaves in the stored order (it returns the very rows it was
        # given) need no conversion where they are blocks, or floats in the run's dtype.
        probe = torch.empty(end - first, row_bytes, dtype=torch.uint8, device="meta")
        in_order = arch.gguf_tensor(cfg, name, probe, ne) is probe
        kind = block_type(info.ggml_type)
        stored_float = FLOAT_TYPES.get(kind) if kind is not None else None
        as_held = module is not None or (stored_float == dtype and not arch.gguf_offset(cfg, name))
        direct = in_order and as_held
        return GGUFTensorReader(
            contents.path, info.name, shape, held_dtype, info.offset + first * row_bytes,
            info.offset + end * row_bytes, convert, direct,
        )  # fmt: skip

    by_row = sorted(parts.items(), key=lambda item: item[1][1])
    sources: dict[int, dict[str, list[GGUFTensorReader]]] = {}
    for i in layers:
        sources[i] = {}
        for entry in layer_names:
            full = f"layers.{i}.{entry}"
            try:
                if full.endswith(".blocks"):
                    owner = full.removesuffix(".blocks")
                    readers = [reader(f"{owner}.weight", model.get_submodule(owner))]
                elif any(fused == full for fused, _, _ in parts.values()):
                    readers = [reader(p, None) for p, (fused, _, _) in by_row if fused == full]
                else:
                    readers = [reader(full, None)]
            except AttributeError:  # (layers held otherwise: dequantized at load)
                raise GGUFError(
                    f"{contents.path}: the streamed layers hold {entry}, which the file's layers "
                    "do not (they were dequantized at load): the disk tier reads the file's own "
                    "blocks"
                ) from None
            sources[i][entry] = readers
    return sources
