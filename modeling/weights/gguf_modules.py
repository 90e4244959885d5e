"""The modules that keep GGUF tensors as their ggml blocks (modeling/weights/gguf_blocks.py
decodes them): `GGUFLinear` holds a projection's bytes as they are (uint8 [out, row_bytes])
and rebuilds the [out, in] weight in torch right before its matmul, like the GPTQ/AWQ
projections of modeling/weights/packed.py; `GGUFEmbedding` decodes only the rows a lookup asks
for."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from gguf.constants import GGMLQuantizationType as GGMLType
from torch import nn

from modeling.weights import cpu_kernels
from modeling.weights.gguf_blocks import (
    BLOCK_SIZES,
    FLOAT_TYPES,
    dequantize,
    dequantize_bytes,
    dequantize_rows,
    row_bytes,
    supported_type,
)
from modeling.weights.packed import (
    CompressedLinear,
    GPTQLinear,
    PackedLinear,
    _itemsize,
    symmetric_values,
    unpack,
)


@functools.lru_cache(maxsize=256)
def _row_bytes(kind: int, columns: int) -> int:
    """`row_bytes`, remembered (every product asks for its projection's)."""
    return row_bytes(kind, columns)


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
        ggml_type: int | GGMLType,
        kinds: tuple[int | GGMLType, ...] = (),
    ) -> None:
        ggml_type = supported_type(ggml_type)
        elements, size = BLOCK_SIZES[ggml_type]
        # PackedLinear's bits per weight, rounded down (Q4_K stores 4.5).
        super().__init__(in_features, out_features, bias, bits=8 * size // elements)
        self.ggml_type = ggml_type
        self.kinds = tuple(supported_type(k) for k in {ggml_type, *kinds})
        room = max(row_bytes(k, in_features) for k in self.kinds)
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
        width = _row_bytes(self.ggml_type, self.in_features)
        if width == self.blocks.shape[1]:
            return self.blocks
        return self.blocks.view(-1)[: self.out_features * width].view(self.out_features, width)

    def stream_state(self) -> int:
        return int(self.ggml_type)

    def load_stream_state(self, kind: int) -> None:
        self.ggml_type = GGMLType(kind)

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
                return super().product(x)
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
        calls the kernels' operator (`cpu_kernels.gguf_products`) with every part."""
        parts = [self]
        for other in others:
            if not isinstance(other, GGUFLinear) or other.in_features != self.in_features:
                return None
            parts.append(other)
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


# `--quantize`'s bits → the ggml block type that holds its values exactly: a group of 128
# inputs with one fp16 scale is four 32-blocks with that scale each.
BLOCK_TYPES = {8: GGMLType.Q8_0, 4: GGMLType.Q4_0}


class BlockQuantizedLinear(GGUFLinear):
    """Symmetric group-wise integer weights laid out as ggml Q8_0 / Q4_0 blocks, where the
    CPU kernels compute those where they lie (modeling/weights/quant.py decides): each
    32-block holds its group's fp16 scale and values in [-128, 127] or [-8, 7], so it
    rebuilds bit for bit the weight of the layout it replaces, for 2 bytes more per 32
    weights than one scale per 128 (Q8_0 34 bytes a block: +4.6%; Q4_0 18: +9%), which the
    plan counts as it counts any layer: by this module's bytes. Made by `--quantize`
    (`quantize_from`: compressed-tensors' rounding, `symmetric_values`) and from a
    symmetric GPTQ or compressed-tensors checkpoint's projection (`from_packed`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int, group: int):
        if bits not in BLOCK_TYPES or group % 32 or in_features % group:
            raise ValueError(
                f"{bits}-bit groups of {group} over {in_features} inputs are not ggml blocks"
            )
        super().__init__(in_features, out_features, bias, BLOCK_TYPES[bits])
        self.group = group

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor, rows: int = 1024) -> None:
        """Fill the blocks from a full-precision [out, in] weight, `rows` at a time."""
        out, inp = self.out_features, self.in_features
        if tuple(weight.shape) != (out, inp):
            raise ValueError(f"weight {tuple(weight.shape)} is not ({out}, {inp})")
        blocks = self._new_blocks(weight.device)
        for r0 in range(0, out, rows):
            w = weight[r0 : r0 + rows].float().view(-1, inp // self.group, self.group)
            values, scale = symmetric_values(w, self.bits, torch.float16)  # (r, G, g), (r, G)
            self._write(blocks[r0 : r0 + rows], values, scale)
        self._buffers["blocks"] = blocks.view(out, -1)

    @staticmethod
    @torch.no_grad()
    def has_block_form(module: PackedLinear) -> bool:
        """Whether `module`'s weight is exactly Q4_0/Q8_0 blocks: a GPTQ (v1) projection
        whose zero points are all 2^(b-1) (symmetric) and whose groups are runs of inputs
        (no act-order permutation), or a symmetric compressed-tensors one, with fp16
        scales and groups of a multiple of 32 inputs."""
        bits, inp = module.bits, module.in_features
        if bits not in BLOCK_TYPES or inp % 32:
            return False
        if isinstance(module, GPTQLinear):
            groups = module.qzeros.shape[0]
            if module.scales.dtype != torch.float16 or not module._groups_contiguous():
                return False
            zeros = unpack(module.qzeros, bits, 1, torch.int16) + 1  # (G, out): zero - 1
            if not bool((zeros == 1 << (bits - 1)).all()):
                return False
        elif isinstance(module, CompressedLinear):
            groups = module.weight_scale.shape[1]
            if module.weight_zero_point is not None or module.weight_scale.dtype != torch.float16:
                return False
        else:
            return False
        return groups * (inp // groups) == inp and (inp // groups) % 32 == 0

    @classmethod
    @torch.no_grad()
    def from_packed(cls, module: PackedLinear, rows: int = 1024) -> BlockQuantizedLinear | None:
        """The same weight as blocks, or None where it has none (`has_block_form`). `rows`
        outputs at a time, so the unpacked codes are a block of rows' (a 70B projection's
        whole would be GBs)."""
        if not cls.has_block_form(module):
            return None
        bits, out, inp = module.bits, module.out_features, module.in_features
        offset = 1 << (bits - 1)
        if isinstance(module, GPTQLinear):

            def codes(r0: int, r1: int) -> torch.Tensor:  # (r, in): packed along the input
                return unpack(module.qweight[:, r0:r1], bits, 0, torch.int16).t()

            scale = module.scales.t()  # (out, G)
        else:
            assert isinstance(module, CompressedLinear)

            def codes(r0: int, r1: int) -> torch.Tensor:  # (r, in), a padded last word cut
                return unpack(module.weight_packed[r0:r1], bits, 1, torch.int16)[:, :inp]

            scale = module.weight_scale  # (out, G)
        groups = scale.shape[1]
        group = inp // groups
        converted = cls(inp, out, module.bias is not None, bits, group)
        blocks = converted._new_blocks(scale.device)
        for r0 in range(0, out, rows):
            r1 = min(out, r0 + rows)
            values = (codes(r0, r1) - offset).view(r1 - r0, groups, group)
            converted._write(blocks[r0:r1], values, scale[r0:r1].contiguous())
        converted._buffers["blocks"] = blocks.view(out, -1)
        if module.bias is not None:
            converted.bias = module.bias
        converted.scratch = module.scratch
        return converted

    def _new_blocks(self, device: torch.device) -> torch.Tensor:
        size = BLOCK_SIZES[self.ggml_type][1]
        shape = (self.out_features, self.in_features // 32, size)
        return torch.empty(shape, dtype=torch.uint8, device=device)

    def _write(self, blocks: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> None:
        """Rows of `blocks` (r, in/32, block bytes) from values (r, G, group) in the type's
        range and their fp16 scales (r, G)."""
        values = values.reshape(values.shape[0], -1, 32)  # (r, blocks, 32)
        d = scale.repeat_interleave(self.group // 32, dim=1)  # each block its group's
        blocks[:, :, :2] = d.contiguous().view(torch.uint8).view(*d.shape, 2)
        if self.bits == 8:  # qs: the values as int8
            blocks[:, :, 2:] = values.to(torch.int8).view(torch.uint8)
        else:  # qs[j]: value j + 8 in the low nibble, value j + 16 + 8 in the high
            q = (values + 8).to(torch.uint8)
            blocks[:, :, 2:] = q[:, :, :16] | (q[:, :, 16:] << 4)


class GGUFEmbedding(nn.Module):
    """An embedding table kept as a GGUF tensor's blocks (`blocks` uint8 [rows,
    row_bytes]): a lookup decodes only the rows asked for (`dequantize_rows`), in fp32,
    so a 70B's Q4_K table holds 0.6 GiB rather than 2 GiB in bf16. (A tied table is also
    the output matrix, which every pass needs whole: the loader keeps that one dense.)"""

    blocks: torch.Tensor

    def __init__(self, rows: int, dim: int, ggml_type: int | GGMLType) -> None:
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
