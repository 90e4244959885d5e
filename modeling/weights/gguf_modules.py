"""The modules that keep GGUF tensors as their ggml blocks (modeling/weights/gguf_blocks.py
decodes them): `GGUFLinear` holds a projection's bytes as they are (uint8 [out, row_bytes])
and rebuilds the [out, in] weight in torch right before its matmul, like the GPTQ/AWQ
projections of modeling/weights/packed.py; `GGUFEmbedding` decodes only the rows a lookup asks
for."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from modeling.weights import cpu_kernels
from modeling.weights.gguf_blocks import (
    BLOCK_SIZES,
    FLOAT_TYPES,
    BlockType,
    dequantize,
    dequantize_bytes,
    dequantize_rows,
    row_bytes,
    supported_type,
)
from modeling.weights.packed import PackedLinear, _itemsize


class GGUFLinear(PackedLinear):
    """A projection whose weight is a GGUF tensor's blocks, as stored: `blocks` uint8
    [out, row_bytes] (ne = [in, out]), `ggml_type` their type. Float types are blocks too,
    so one class holds every tensor of a file; one stored in the compute dtype is its own
    weight (a view, nothing rebuilt).

    A file may store one projection in different types in different layers (a Q4_K_M mix
    gives some layers' ffn_down Q6_K): `kinds` are all of them, and `blocks` has room for
    the largest (its first out × row_bytes bytes hold this layer's rows, whole), so every
    layer has one shape and streams through the same slots; a slot takes on the type of
    the layer it computes (`load_stream_state`)."""

    blocks: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        ggml_type: int | BlockType,
        kinds: tuple[int | BlockType, ...] = (),
    ) -> None:
        ggml_type = supported_type(ggml_type)
        elements, size = BLOCK_SIZES[ggml_type]
        # PackedLinear's bits per weight, rounded down (Q4_K stores 4.5).
        super().__init__(in_features, out_features, bias, bits=8 * size // elements)
        self.ggml_type = ggml_type
        self.kinds = tuple(supported_type(k) for k in {ggml_type, *kinds})
        # Each kind's stored row (every product asks for its own kind's): a dict, not an
        # lru_cache, which a compiled pass traces through with a warning that alarms.
        self.row_widths = {k: row_bytes(k, in_features) for k in self.kinds}
        room = max(self.row_widths.values())
        self.register_buffer("blocks", torch.zeros(out_features, room, dtype=torch.uint8))
        # The kernel's product for the blocks as they were last seen: (their address,
        # shape and type) → a BlockProduct, or None where no kernel takes them.
        self._kernel: tuple[tuple[int, torch.Size, int], cpu_kernels.BlockProduct | None] = (
            (0, torch.Size(), -1),
            None,
        )
        # The same for this projection stacked with others (`stacked_product`): keyed on
        # every part's blocks.
        self._stacked: tuple[
            tuple[tuple[int, torch.Size, int], ...], cpu_kernels.BlockProduct | None
        ] = ((), None)

    def stored(self) -> torch.Tensor:
        """This layer's rows as stored, (out, row_bytes) uint8."""
        width = self.row_widths.get(self.ggml_type) or row_bytes(self.ggml_type, self.in_features)
        if width == self.blocks.shape[1]:
            return self.blocks
        return self.blocks.view(-1)[: self.out_features * width].view(self.out_features, width)

    def stream_state(self) -> int:
        return int(self.ggml_type)

    def load_stream_state(self, kind: int) -> None:
        self.ggml_type = supported_type(kind)

    def _is_own_weight(self, dtype: torch.dtype) -> bool:
        return FLOAT_TYPES.get(self.ggml_type) == dtype

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """A product of a few rows on the CPU reads the blocks where they lie
        (modeling/weights/cpu_kernels.py); others rebuild the weight first. In a compiled
        pass every product is one opaque operator that chooses so when it runs."""
        if torch.compiler.is_compiling() and self.computed_in_place(x.dtype, x.device):
            y = torch.ops.specd.gguf_products(x, [self.stored()], [int(self.ggml_type)])
        else:
            blocks = self._buffers["blocks"]  # (held here while the kernel reads it)
            assert blocks is not None
            key = (blocks.data_ptr(), blocks.shape, int(self.ggml_type))
            seen, kernel = self._kernel
            if seen != key:
                kernel = self._block_product([self])
                self._kernel = (key, kernel)
            found = None if kernel is None else kernel(x)
            if found is None:
                return nn.functional.linear(x, self._block_weight(x.dtype), self.bias)
            y = found
        return y if self.bias is None else y + self.bias

    @staticmethod
    def _block_product(parts: list[GGUFLinear]) -> cpu_kernels.BlockProduct | None:
        """The kernel's product on these projections' rows (`stored()`, which begin where
        their blocks do), or None where no kernel computes them all here."""
        if not cpu_kernels.available():
            return None
        stored = []
        for part in parts:
            rows = part.stored()
            if (
                not cpu_kernels.supports(part.ggml_type)
                or not rows.is_contiguous()
                or rows.device.type != "cpu"
                or part.in_features != parts[0].in_features
            ):
                return None
            stored.append((rows, part.ggml_type))
        return cpu_kernels.BlockProduct(stored, parts[0].in_features)

    def stacked_product(
        self, others: Sequence[nn.Module | None], x: torch.Tensor
    ) -> torch.Tensor | None:
        """One kernel call for this projection and `others` where each is GGUF blocks the
        CPU kernels compute here and x is a few fp32 rows (the plan kept on this one, keyed
        on every part's blocks); each part's bias added to its columns. A compiled pass
        calls the kernels' operator (`cpu_kernels.gguf_products`) with every part. Parts
        that take their input in another order (`BlockQuantizedLinear.input_order`) are
        stacked by that class."""
        parts = self._stackable(others)
        if parts is None or any(getattr(p, "input_order", None) is not None for p in parts):
            return None
        return self._stacked_call(parts, x)

    def _stackable(self, others: Sequence[nn.Module | None]) -> list[GGUFLinear] | None:
        parts = [self]
        for other in others:
            if not isinstance(other, GGUFLinear) or other.in_features != self.in_features:
                return None
            parts.append(other)
        return parts

    def _stacked_call(self, parts: list[GGUFLinear], x: torch.Tensor) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            if not all(p.computed_in_place(x.dtype, x.device) for p in parts):
                return None
            y = torch.ops.specd.gguf_products(
                x, [p.stored() for p in parts], [int(p.ggml_type) for p in parts]
            )
        else:
            held = [part._buffers["blocks"] for part in parts]  # (while the kernel reads them)
            key = tuple(
                (b.data_ptr(), b.shape, int(p.ggml_type))  # type: ignore[union-attr]
                for b, p in zip(held, parts, strict=True)
            )
            seen, kernel = self._stacked
            if seen != key:
                kernel = self._block_product(parts)
                self._stacked = (key, kernel)
            y = None if kernel is None else kernel(x)
        if y is not None:
            column = 0
            for part in parts:
                if part.bias is not None:  # the values of y + b, in y's columns
                    y[..., column : column + part.out_features].add_(part.bias)
                column += part.out_features
        return y

    def computed_in_place(self, dtype: torch.dtype, device: torch.device) -> bool:
        return all(cpu_kernels.computes(kind, dtype, device) for kind in self.kinds)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._block_weight(dtype)

    def _block_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight its blocks hold, (out, in) in `dtype`, its columns in their order."""
        if self._is_own_weight(dtype):
            return self.stored().view(dtype)  # (out, in)
        n = self.out_features * self.in_features
        out = self._codes_buffer(n, dtype, self.blocks.device)
        return dequantize(self.stored(), self.ggml_type, self.in_features, dtype, out)

    def rebuild_bytes(self, dtype: torch.dtype) -> int:
        """The most of any type this projection may hold (a slot computes them all)."""
        rows, columns = self.out_features, self.in_features
        result = rows * columns * _itemsize(dtype)
        return max(
            0 if FLOAT_TYPES.get(k) == dtype else result + dequantize_bytes(rows, columns, k, dtype)
            for k in self.kinds
        )

    def extra_repr(self) -> str:
        kinds = "/".join(k.name for k in self.kinds if k != self.ggml_type)
        also = f" (in other layers {kinds})" if kinds else ""
        return f"in={self.in_features}, out={self.out_features}, type={self.ggml_type.name}{also}"


class GGUFEmbedding(nn.Module):
    """An embedding table kept as a GGUF tensor's blocks (`blocks` uint8 [rows,
    row_bytes]): a lookup decodes only the rows asked for (`dequantize_rows`), in fp32,
    so a 70B's Q4_K table holds 0.6 GiB rather than 2 GiB in bf16. (A tied table is also
    the output matrix, which every pass needs whole: the loader keeps that one dense.)"""

    blocks: torch.Tensor

    def __init__(self, rows: int, dim: int, ggml_type: int | BlockType) -> None:
        super().__init__()
        self.ggml_type = supported_type(ggml_type)
        self.num_embeddings, self.embedding_dim = rows, dim
        self.register_buffer(
            "blocks", torch.zeros(rows, row_bytes(self.ggml_type, dim), dtype=torch.uint8)
        )

    def stored(self) -> torch.Tensor:
        """The table as stored, (rows, row_bytes) uint8 (GGUFLinear's counterpart)."""
        return self.blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.blocks, self.ggml_type, self.embedding_dim, ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.ggml_type.name}"
