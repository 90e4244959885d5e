"""Packed checkpoints laid out as blocks the CPU kernels multiply where they lie.

No kernel reads the GPTQ, AWQ or compressed-tensors packing, so on a CPU every product
would rebuild the float matrix (a 4-bit projection decoded no faster than fp32). Their
group-wise integer weights are instead rewritten at load, value for value, as blocks of 32
that modeling/weights/cpu_kernels.c computes: symmetric ones (zero point 2^(b-1)) as ggml
Q4_0 / Q8_0, 4-bit ones with a zero point per group (AWQ, asymmetric GPTQ and
compressed-tensors) as specd's Q4_Z (`gguf_blocks.SpecdType`), each block holding its
group's fp16 scale (and zero point). A GPTQ checkpoint quantized with act-order
(`desc_act`: each input's group looked up in `g_idx`, groups not runs of inputs) has its
inputs sorted by group at load, so the groups are runs again; each product takes its input
in that order (`input_order`), one gather of a few rows. `quant.laid_out_for` decides when
(the plan and the loader ask it alike); `has_block_form` checks a stored projection
against what its config says before anything is converted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from modeling.weights.gguf_blocks import BLOCK_SIZES, BlockType, GGMLType, SpecdType
from modeling.weights.gguf_modules import GGUFLinear
from modeling.weights.packed import (
    AWQ_ORDER,
    AWQLinear,
    CompressedLinear,
    GPTQLinear,
    PackedLinear,
    _itemsize,
    symmetric_values,
    unpack,
)

# (bits, symmetric, the scales' dtype) → the block type that holds a group-wise layout's
# values exactly: symmetric (zero point 2^(b-1): ggml's, or specd's with a bf16 scale), and
# with an integer zero point per group (specd's own). A group of 128 inputs with one
# scale is four 32-blocks with that scale each.
LAYOUTS: dict[tuple[int, bool, torch.dtype], BlockType] = {
    (8, True, torch.float16): GGMLType.Q8_0,
    (4, True, torch.float16): GGMLType.Q4_0,
    (4, False, torch.float16): SpecdType.Q4_Z,
    (8, True, torch.bfloat16): SpecdType.Q8_0B,
    (4, True, torch.bfloat16): SpecdType.Q4_0B,
    (4, False, torch.bfloat16): SpecdType.Q4_ZB,
}


def layout_type(
    bits: int, symmetric: bool, scale_dtype: torch.dtype = torch.float16
) -> BlockType | None:
    """The block type of `bits`-bit groups with `scale_dtype` scales, None where there is
    none (8 bits with a zero point: codes minus zero points span 9 bits; fp32 scales)."""
    return LAYOUTS.get((bits, symmetric, scale_dtype))


class BlockQuantizedLinear(GGUFLinear):
    """Group-wise integer weights laid out as 32-blocks (`layout_type`): each holds its
    group's fp16 scale, and for Q4_Z its zero point, so it rebuilds bit for bit the weight
    of the layout it replaces. Per 32 weights that is 2 bytes of scale beside the codes
    (Q8_0 34 bytes, Q4_0 18, Q4_Z 19 with its zero point) where a checkpoint holds one
    scale (and zero point) per 128 (+4.6%, +9%; Q4_Z +14% against AWQ's or GPTQ's 66.5
    bytes a 128-group), which the plan counts as it counts any layer: by this module's
    bytes. Made by `--quantize` (`quantize_from`: compressed-tensors' rounding,
    `symmetric_values`) and from a GPTQ, AWQ or compressed-tensors projection
    (`from_packed`). `input_order`: with act-order, the stored input each block column
    holds (None: the inputs' own order)."""

    input_order: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        bits: int,
        group: int,
        symmetric: bool = True,
        act_order: bool = False,
        scale_dtype: torch.dtype = torch.float16,
    ) -> None:
        kind = layout_type(bits, symmetric, scale_dtype)
        if kind is None or group % 32 or in_features % group:
            zero = "" if symmetric else " with zero points"
            raise ValueError(
                f"{bits}-bit groups of {group}{zero} over {in_features} inputs are not blocks"
            )
        super().__init__(in_features, out_features, bias, kind)
        self.group, self.bits_stored, self.symmetric = group, bits, symmetric
        self.scale_dtype = scale_dtype
        order = torch.arange(in_features, dtype=torch.int32) if act_order else None
        self.register_buffer("input_order", order)

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor, rows: int = 1024) -> None:
        """Fill the blocks from a full-precision [out, in] weight, `rows` at a time
        (symmetric: `--quantize`)."""
        out, inp = self.out_features, self.in_features
        if tuple(weight.shape) != (out, inp):
            raise ValueError(f"weight {tuple(weight.shape)} is not ({out}, {inp})")
        if not self.symmetric or self.input_order is not None or self.scale_dtype != torch.float16:
            raise ValueError("quantizing on load is symmetric, fp16-scaled, in the inputs' order")
        blocks = self._new_blocks(weight.device)
        offset = 1 << (self.bits_stored - 1)
        for r0 in range(0, out, rows):
            w = weight[r0 : r0 + rows].float().view(-1, inp // self.group, self.group)
            values, scale = symmetric_values(w, self.bits_stored, torch.float16)  # (r, G, g)
            self._write(blocks[r0 : r0 + rows], values + offset, None, scale)
        self._buffers["blocks"] = blocks.view(out, -1)

    @staticmethod
    @torch.no_grad()
    def has_block_form(module: PackedLinear, symmetric: bool, act_order: bool = False) -> bool:
        """Whether `module`'s weight is exactly blocks of `layout_type(bits, symmetric,
        its scales' dtype)`: fp16 scales (bf16 too for compressed-tensors), groups of a
        multiple of 32 inputs; symmetric: every zero point 2^(b-1) (GPTQ stores them;
        compressed-tensors has none); groups in runs of inputs, or with `act_order` (GPTQ's
        `desc_act`) groups of equal size in any order. What a checkpoint's config says is
        checked against its tensors here, before anything is converted."""
        bits, inp, dtype = module.bits, module.in_features, _scale_dtype(module)
        if dtype is None or layout_type(bits, symmetric, dtype) is None or inp % 32:
            return False
        if act_order and not isinstance(module, GPTQLinear):  # (GPTQ's option alone)
            return False
        if isinstance(module, GPTQLinear):
            groups = module.qzeros.shape[0]
            if act_order:
                g_idx = module.g_idx.long()
                if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
                    return False
                sizes = torch.bincount(g_idx, minlength=groups)
                if sizes.numel() != groups or not bool((sizes == inp // groups).all()):
                    return False
            elif not module._groups_contiguous():
                return False
            if symmetric:
                zeros = unpack(module.qzeros, bits, 1, torch.int16) + 1  # (G, out): zero - 1
                if not bool((zeros == 1 << (bits - 1)).all()):
                    return False
        elif isinstance(module, AWQLinear):
            groups = module.qzeros.shape[0]
            if symmetric:
                return False
        elif isinstance(module, CompressedLinear):
            groups = module.weight_scale.shape[1]
            if (module.weight_zero_point is None) != symmetric:
                return False
        else:
            return False
        return groups * (inp // groups) == inp and (inp // groups) % 32 == 0

    @classmethod
    @torch.no_grad()
    def from_packed(
        cls, module: PackedLinear, symmetric: bool, act_order: bool = False, rows: int = 1024
    ) -> BlockQuantizedLinear | None:
        """The same weight as blocks, or None where it has none (`has_block_form`). `rows`
        outputs at a time (rounded up to 8, AWQ's word), so the unpacked codes are a block
        of rows' (a 70B projection's whole would be GBs)."""
        if not cls.has_block_form(module, symmetric, act_order):
            return None
        bits, out, inp = module.bits, module.out_features, module.in_features
        rows = -(-rows // 8) * 8
        order: torch.Tensor | None = None
        codes: Callable[[int, int], torch.Tensor]  # rows r0..r1: (r, in) codes as stored
        zeros: Callable[[int, int], torch.Tensor] | None = None  # (r, G) zero points
        if isinstance(module, GPTQLinear):
            packed_gptq = module
            if act_order:  # the inputs sorted by group (stably): groups are runs again
                order = torch.sort(module.g_idx.long(), stable=True).indices

            def codes(r0: int, r1: int) -> torch.Tensor:  # packed along the input
                c = unpack(packed_gptq.qweight[:, r0:r1], bits, 0, torch.uint8)  # (in, r)
                return (c if order is None else c.index_select(0, order)).t()

            def zeros(r0: int, r1: int) -> torch.Tensor:  # v1 stores zero - 1
                per_word = 32 // bits  # (4 bits alone: zero points are symmetric at 8)
                words = packed_gptq.qzeros[:, r0 // per_word : -(-r1 // per_word)]
                return unpack(words, bits, 1, torch.uint8)[:, : r1 - r0].t() + 1

            scale = module.scales.t()  # (out, G)
        elif isinstance(module, AWQLinear):
            packed_awq = module

            def codes(r0: int, r1: int) -> torch.Tensor:  # packed along the output
                words = packed_awq.qweight[:, r0 // 8 : -(-r1 // 8)]
                return unpack(words, 4, 1, torch.uint8, AWQ_ORDER).t()

            def zeros(r0: int, r1: int) -> torch.Tensor:
                words = packed_awq.qzeros[:, r0 // 8 : -(-r1 // 8)]
                return unpack(words, 4, 1, torch.uint8, AWQ_ORDER).t()

            scale = module.scales.t()
        else:
            assert isinstance(module, CompressedLinear)
            packed_ct = module

            def codes(r0: int, r1: int) -> torch.Tensor:  # a padded last word cut
                return unpack(packed_ct.weight_packed[r0:r1], bits, 1, torch.uint8)[:, :inp]

            if module.weight_zero_point is not None:

                def zeros(r0: int, r1: int) -> torch.Tensor:  # packed along the output
                    assert packed_ct.weight_zero_point is not None
                    per_word = 32 // bits
                    words = packed_ct.weight_zero_point[r0 // per_word : -(-r1 // per_word)]
                    z = unpack(words, bits, 0, torch.uint8)
                    return z[r0 % per_word : r0 % per_word + r1 - r0]

            scale = module.weight_scale
        if symmetric:
            zeros = None
        groups = scale.shape[1]
        converted = cls(
            inp, out, module.bias is not None, bits, inp // groups, symmetric, act_order,
            scale.dtype,
        )  # fmt: skip
        blocks = converted._new_blocks(scale.device)
        for r0 in range(0, out, rows):
            r1 = min(out, r0 + rows)
            q = codes(r0, r1)  # (r, in), in the blocks' order
            z = None if zeros is None else zeros(r0, r1)
            converted._write(blocks[r0:r1], q, z, scale[r0:r1].contiguous())
        converted._buffers["blocks"] = blocks.view(out, -1)
        if order is not None:
            converted._buffers["input_order"] = order.to(torch.int32)
        if module.bias is not None:
            converted.bias = module.bias
        converted.scratch = module.scratch
        return converted

    def _new_blocks(self, device: torch.device) -> torch.Tensor:
        size = BLOCK_SIZES[self.ggml_type][1]
        shape = (self.out_features, self.in_features // 32, size)
        return torch.empty(shape, dtype=torch.uint8, device=device)

    def _write(
        self,
        blocks: torch.Tensor,
        codes: torch.Tensor,
        zeros: torch.Tensor | None,
        scale: torch.Tensor,
    ) -> None:
        """Rows of `blocks` (r, in/32, block bytes) from unsigned codes (r, in) in [0,
        2^b) as stored (symmetric: value + 2^(b-1)), their groups' zero points (r, G)
        (None: symmetric) and scales (r, G) in the layout's dtype (fp16 or bf16)."""
        codes = codes.to(torch.uint8).reshape(codes.shape[0], -1, 32)  # (r, blocks, 32)
        per_group = self.group // 32
        d = scale.repeat_interleave(per_group, dim=1)  # each block its group's
        blocks[:, :, :2] = d.contiguous().view(torch.uint8).view(*d.shape, 2)
        if self.bits_stored == 8:  # Q8_0's qs: the values c - 128 as int8, i.e. c ^ 0x80
            blocks[:, :, 2:] = codes ^ 128
            return
        # qs[j]: code j in the low nibble, code j + 16 in the high
        nibbles = codes[:, :, :16] | (codes[:, :, 16:] << 4)
        if zeros is None:
            blocks[:, :, 2:] = nibbles
        else:
            blocks[:, :, 2] = zeros.repeat_interleave(per_group, dim=1).to(torch.uint8)
            blocks[:, :, 3:] = nibbles

    # ---- act-order: each product takes its input in the blocks' order ----

    def product(self, x: torch.Tensor) -> torch.Tensor:
        order = self.input_order
        if order is None:
            return super().product(x)
        return super().product(x.index_select(-1, order))

    def stacked_product(
        self, others: Sequence[nn.Module | None], x: torch.Tensor
    ) -> torch.Tensor | None:
        order = self.input_order
        parts = self._stackable(others)
        if order is None or parts is None:
            return super().stacked_product(others, x)
        # GPTQ sorts a layer's inputs by one Hessian's diagonal, so q/k/v (and gate/up)
        # share an order: one gather for all; parts in other orders are applied alone.
        if torch.compiler.is_compiling() or not self._orders_agree(parts):
            return None
        return self._stacked_call(parts, x.index_select(-1, order))

    def _orders_agree(self, parts: Sequence[nn.Module]) -> bool:
        """Whether every part takes its input in this one's order: compared at each call
        (a few microseconds), since a streamer's slot keeps its tensors' addresses while
        it holds each layer in turn."""
        orders = [getattr(p, "input_order", None) for p in parts]
        if not all(isinstance(o, torch.Tensor) for o in orders):
            return False
        first = orders[0]
        return all(torch.equal(first, o) for o in orders[1:])  # type: ignore[arg-type]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        weight = self._block_weight(dtype)  # (out, in), columns in the blocks' order
        order = self.input_order
        if order is None:
            return weight
        restored = torch.empty_like(weight)
        restored[:, order.long()] = weight
        return restored

    def rebuild_bytes(self, dtype: torch.dtype) -> int:
        extra = 0
        if self.input_order is not None:  # `dequantize`'s copy in the inputs' order
            extra = self.out_features * self.in_features * _itemsize(dtype)
        return super().rebuild_bytes(dtype) + extra


def _scale_dtype(module: PackedLinear) -> torch.dtype | None:
    """The dtype of a packed projection's stored scales (None: not a format laid out)."""
    if isinstance(module, GPTQLinear | AWQLinear):
        return module.scales.dtype
    if isinstance(module, CompressedLinear):
        return module.weight_scale.dtype
    return None
