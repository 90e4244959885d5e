"""Packed projections: quantized weights kept as a GPTQ (v1), AWQ (GEMM) or
compressed-tensors `pack-quantized` checkpoint stores them.

Each quantized projection is a `PackedLinear` holding the checkpoint's own tensors, under
their own names and in their stored dtypes, as buffers: the offloader packs, streams and
reads them from the files like any other tensors, so a layer moves at its packed size. The
weight is rebuilt just before use (`dequantize`, plain PyTorch ops) into a shared
`RebuildScratch` and never kept.

In all three formats an int32 word holds 32/b codes of b bits, code i at bits i·b (code 0
lowest); the dequantized weight is (code - zero point) × scale per output row and group.
What differs is which dimension is packed, the code order and the zero point's convention
(../shared/models/quantized/README.md describes each on real files). Which format a
checkpoint uses is read from its config.json in modeling/weights/quant.py.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

# The float tensors of a packed module keep their stored dtype through `module.to(dtype)`:
# for the move they are viewed as integers of the same width (see PackedLinear._apply).
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}

# AWQ GEMM stores output 8c + AWQ_ORDER[i] of word c in code i (even outputs in the low
# nibbles, odd ones in the high).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack(
    words: torch.Tensor,
    bits: int,
    dim: int,
    dtype: torch.dtype = torch.int32,
    order: tuple[int, ...] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The codes of int32 `words` (values 0 .. 2^bits - 1) as `dtype`, each word's 32/bits
    codes expanded in place along `dim`: code i at position `order[i]` within its word's
    run (code i at i by default). One code position at a time, so the only temporaries are
    a word-sized slice, not an int32 copy of the whole weight. `out`: a flat buffer of
    `dtype` with room for the codes (a `RebuildScratch`'s), else a new tensor."""
    per_word = 32 // bits
    order = order or tuple(range(per_word))
    dim = dim % words.dim()
    sizes = list(words.shape)
    sizes.insert(dim + 1, per_word)
    if out is None:
        codes = torch.empty(sizes, dtype=dtype, device=words.device)
    else:
        codes = out[: math.prod(sizes)].view(sizes)
    for code, position in enumerate(order):
        # An arithmetic shift fills the high bits with the sign; the mask drops them.
        codes.select(dim + 1, position).copy_((words >> (code * bits)) & ((1 << bits) - 1))
    return codes.flatten(dim, dim + 1)


class RebuildScratch:
    """The flat buffers packed projections rebuild their weights into: one for the codes
    (in the work dtype) and one for the result (in the compute dtype) per device. A model's
    projections share one scratch (`Transformer` hands it to them), so rebuilding costs the
    largest projection's bytes once (the plan's `dequant_bytes`), allocated once rather
    than per projection per pass; each rebuilt weight is used by its matmul before the next
    projection overwrites it. Shared, never copied: deep-copying a module (the streamer's
    slots are copies of a layer) keeps the same scratch."""

    def __init__(self) -> None:
        self._flat: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> RebuildScratch:
        return self

    @torch.inference_mode(False)  # reused outside passes too (tests, kept-dense layers)
    def take(self, role: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `n` elements for `role` ("codes" | "result"), grown
        to the largest request seen."""
        key = (role, dtype, device)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < n:
            self._flat.pop(key, None)  # the smaller one goes before the larger one comes
            flat = torch.empty(n, dtype=dtype, device=device)
            self._flat[key] = flat
        return flat

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flat.values())


class PackedLinear(nn.Module, ABC):
    """A Linear whose weight is stored packed; `dequantize(dtype)` rebuilds it ([out, in])
    for one use. Each format is a subclass holding that format's stored tensors.

    `traceable`: whether `dequantize` is tensor operations alone (no branch on the data, no
    Python loop over chunks), so a compiled pass traces it and fuses the unpacking into a
    few kernels; there the weight is rebuilt into the graph's own temporary, not into the
    model's scratch (which eager passes grow and share)."""

    traceable = False

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        # Where `dequantize` writes (set by the model that owns this projection); None: a
        # new tensor per call.
        self.scratch: RebuildScratch | None = None

    def _codes_buffer(self, n: int, work: torch.dtype, device: torch.device) -> torch.Tensor | None:
        if self.scratch is None or torch.compiler.is_compiling():
            return None
        return self.scratch.take("codes", n, work, device)

    def _finish(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rebuilt [out, in] weight in `dtype`: the codes themselves when they are in
        `dtype` already, else converted into the scratch's result buffer (or a new one)."""
        if weight.dtype == dtype:
            return weight
        if self.scratch is None or torch.compiler.is_compiling():
            return weight.to(dtype)
        flat = self.scratch.take("result", weight.numel(), dtype, weight.device)
        return flat[: weight.numel()].view(weight.shape).copy_(weight)

    @abstractmethod
    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight, [out, in], in `dtype`: a temporary, never kept."""

    @abstractmethod
    def rebuild_bytes(self, dtype: torch.dtype) -> int:
        """The most bytes `dequantize(dtype)` holds at once, traced from its code: what
        the memory plan reserves for rebuilding the largest projection."""

    def _codes_bytes(self, work: torch.dtype) -> int:
        """Unpacking: the codes in the work dtype, plus one code position's two word-sized
        temporaries (a shift and a mask) while they are written."""
        n = self.in_features * self.out_features
        return n * _itemsize(work) + 2 * n * self.bits // 8

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b: the weight rebuilt in x's dtype for this product (a format with a
        kernel on its packed form overrides this)."""
        return nn.functional.linear(x, self.dequantize(x.dtype), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def stacked_product(
        self, others: Sequence[nn.Module | None], x: torch.Tensor
    ) -> torch.Tensor | None:
        """The products of x by this projection and `others` (more projections of the same
        input: a layer's q/k/v, its gate/up) side by side, (..., the outputs summed), where
        a format computes them in one call (`GGUFLinear` on the CPU kernels); None here and
        wherever it does not (each is then applied alone, with the same values)."""
        return None

    def computed_in_place(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a model computing in `dtype` on `device` multiplies this projection
        from its packed form, never rebuilding it into the model's shared scratch (the
        condition for compiling its passes)."""
        return False

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # `model.to(bf16)` sets the compute dtype; the packed tensors are data in the
        # checkpoint's layout (fp16 scales stay fp16: the plan counts and the disk tier
        # reads their stored bytes). Hidden as same-width integers, they move but keep
        # their bits.
        floats = {}
        for name, buf in self._buffers.items():
            if buf is not None and buf.is_floating_point():
                floats[name] = buf.dtype
                self._buffers[name] = buf.view(_SAME_WIDTH_INT[buf.element_size()])
        super()._apply(fn, recurse)
        for name, dtype in floats.items():
            buf = self._buffers[name]
            assert buf is not None
            self._buffers[name] = buf.view(dtype)
        return self

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _work_dtype(stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """Dequantize in a dtype that holds both the stored scales and the compute dtype exactly
    ((code - zero) × scale then rounds once), e.g. fp32 for fp16 scales and bf16 compute."""
    return torch.promote_types(stored, dtype) if stored != dtype else dtype


class GPTQLinear(PackedLinear):
    """GPTQ v1: `qweight` int32 [in·b/32, out] packed along the input (input 8r+i in code i
    of row r, 4-bit), `qzeros` int32 [G, out·b/32] packed along the output and storing the
    zero point minus one, `scales` [G, out], `g_idx` int32 [in]: the group of each input
    (permuted under desc_act, so it is looked up per input, never assumed contiguous).
    weight[j, k] = scales[g_idx[k], j] × (code[k, j] - (qzeros code[g_idx[k], j] + 1))."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, bias: bool, bits: int, group: int
    ) -> None:
        super().__init__(in_features, out_features, bias, bits)
        groups = in_features // group
        self.register_buffer(
            "qweight", torch.zeros(in_features * bits // 32, out_features, dtype=torch.int32)
        )
        self.register_buffer(
            "qzeros", torch.zeros(groups, out_features * bits // 32, dtype=torch.int32)
        )
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16))
        self.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        work = _work_dtype(self.scales.dtype, dtype)
        zeros = unpack(self.qzeros, self.bits, 1, work) + 1  # (G, out): v1 stores zero - 1
        n = self.in_features * self.out_features
        codes = self._codes_buffer(n, work, self.qweight.device)
        weight = unpack(self.qweight, self.bits, 0, work, out=codes)  # (in, out) codes
        if self._groups_contiguous():
            # Without desc_act every group is a run of inputs: broadcast per group in
            # place (the same values as the gathers below, about twice as fast).
            by_group = weight.view(zeros.shape[0], -1, self.out_features)  # (G, group, out)
            by_group -= zeros[:, None, :]
            by_group *= self.scales.to(work)[:, None, :]
        else:
            group = self.g_idx.long()  # (in,)
            weight -= zeros[group]  # integers: exact
            weight *= self.scales.to(work)[group]  # the one rounding
        return self._finish(weight.t(), dtype)  # (out, in)

    def _groups_contiguous(self) -> bool:
        """Whether g_idx is input // group (no desc_act permutation). Asked each time (a few
        microseconds, against a rebuild's milliseconds): a streamer's slot holds one layer's
        g_idx after another, and a file may permute some layers' groups and not others."""
        groups = self.qzeros.shape[0]
        run = torch.arange(self.in_features, device=self.g_idx.device) // (
            self.in_features // groups
        )
        return bool(torch.equal(self.g_idx.long(), run))

    def rebuild_bytes(self, dtype: torch.dtype) -> int:
        # Planned for desc_act (config.json does not say whether g_idx is a permutation):
        # the codes, and beside them a per-input gather of the zeros, then of the scales,
        # (in, out) each in the work dtype; then the codes and the result in `dtype`.
        work = _work_dtype(self.scales.dtype, dtype)
        n = self.in_features * self.out_features
        gathered = n * _itemsize(work)
        peak = max(self._codes_bytes(work), 2 * gathered, gathered + n * _itemsize(dtype))
        return peak + _per_group_bytes(self.qzeros.shape[0], self.out_features, work)


class AWQLinear(PackedLinear):
    """AWQ GEMM, 4-bit: `qweight` int32 [in, out/8] packed along the output with the
    interleave AWQ_ORDER, `qzeros` int32 [G, out/8] packed the same way (unsigned, no
    offset), `scales` [G, out], groups contiguous along the input.
    weight[j, k] = (code[k, j] - zero[k div group, j]) × scales[k div group, j]."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool, group: int) -> None:
        super().__init__(in_features, out_features, bias, 4)
        groups = in_features // group
        self.group = group
        self.register_buffer(
            "qweight", torch.zeros(in_features, out_features // 8, dtype=torch.int32)
        )
        self.register_buffer("qzeros", torch.zeros(groups, out_features // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        work = _work_dtype(self.scales.dtype, dtype)
        n = self.in_features * self.out_features
        codes = self._codes_buffer(n, work, self.qweight.device)
        weight = unpack(self.qweight, 4, 1, work, AWQ_ORDER, out=codes)  # (in, out) codes
        zeros = unpack(self.qzeros, 4, 1, work, AWQ_ORDER)  # (G, out)
        by_group = weight.view(zeros.shape[0], self.group, -1)  # (G, group, out)
        by_group -= zeros[:, None, :]
        by_group *= self.scales.to(work)[:, None, :]
        return self._finish(weight.t(), dtype)  # (out, in)

    def rebuild_bytes(self, dtype: torch.dtype) -> int:
        groups = self.qzeros.shape[0]
        return _grouped_rebuild_bytes(self, self.scales.dtype, dtype, groups)


class CompressedLinear(PackedLinear):
    """compressed-tensors `pack-quantized`: `weight_packed` int32 [out, in·b/32] packed
    along the input in plain order, codes stored as the signed value + 2^(b-1);
    `weight_scale` [out, G]; `weight_shape` int64 [2]; asymmetric: `weight_zero_point` int32
    [out·b/32, G], packed along the output, also stored + 2^(b-1).
    weight[j, k] = (value[j, k] - zero[j, k div group]) × weight_scale[j, k div group]."""

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_shape: torch.Tensor
    weight_zero_point: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        bits: int,
        group: int,
        symmetric: bool,
        scale_dtype: torch.dtype,
    ) -> None:
        super().__init__(in_features, out_features, bias, bits)
        groups = in_features // group
        self.group = group
        words = -(-in_features * bits // 32)  # whole words; a stored checkpoint has no padding
        self.register_buffer("weight_packed", torch.zeros(out_features, words, dtype=torch.int32))
        self.register_buffer("weight_scale", torch.zeros(out_features, groups, dtype=scale_dtype))
        self.register_buffer("weight_shape", torch.zeros(2, dtype=torch.int64))
        zero = (
            None if symmetric else torch.zeros(out_features * bits // 32, groups, dtype=torch.int32)
        )
        self.register_buffer("weight_zero_point", zero)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        work = _work_dtype(self.weight_scale.dtype, dtype)
        offset = 1 << (self.bits - 1)  # codes are the signed value + 2^(b-1)
        n = self.out_features * self.weight_packed.shape[1] * (32 // self.bits)
        codes = self._codes_buffer(n, work, self.weight_packed.device)
        weight = unpack(self.weight_packed, self.bits, 1, work, out=codes)  # (out, in) codes
        if weight.shape[1] != self.in_features:  # a padded last word (on-load only)
            weight = weight[:, : self.in_features].contiguous()
        by_group = weight.view(self.out_features, -1, self.group)  # (out, G, group)
        if self.weight_zero_point is None:
            by_group -= offset
        else:
            # value - zero = (code - offset) - (zero code - offset) = code - zero code
            by_group -= unpack(self.weight_zero_point, self.bits, 0, work)[:, :, None]
        by_group *= self.weight_scale.to(work)[:, :, None]
        return self._finish(weight, dtype)

    def rebuild_bytes(self, dtype: torch.dtype) -> int:
        groups = self.weight_scale.shape[1]
        grouped = _grouped_rebuild_bytes(self, self.weight_scale.dtype, dtype, groups)
        if self.weight_packed.shape[1] * 32 // self.bits == self.in_features:
            return grouped
        # A padded last word: the unpacked codes and their unpadded copy, side by side.
        work = _work_dtype(self.weight_scale.dtype, dtype)
        pair = 2 * self.in_features * self.out_features * _itemsize(work)
        return max(grouped, pair + _per_group_bytes(groups, self.out_features, work))

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor, rows: int = 1024) -> None:
        """Fill the packed tensors from a full-precision [out, in] weight (on-load
        quantization, symmetric): per row and group, scale = max|w| / (2^(b-1) - 1) stored
        in the scales' dtype, code = round(w / scale) + 2^(b-1). Rows a block at a time, so
        the temporaries stay a block's, not the projection's."""
        if self.weight_zero_point is not None:
            raise ValueError("on-load quantization is symmetric: no zero point")
        out, inp = self.out_features, self.in_features
        if tuple(weight.shape) != (out, inp):
            raise ValueError(f"weight {tuple(weight.shape)} is not ({out}, {inp})")
        qmax = (1 << (self.bits - 1)) - 1
        per_word = 32 // self.bits
        shifts = torch.arange(per_word, dtype=torch.int64, device=weight.device) * self.bits
        words_per_row = self.weight_packed.shape[1]
        pad = words_per_row * per_word - inp  # codes of zero in the last word
        packed = torch.empty(out, words_per_row, dtype=torch.int32, device=weight.device)
        scales = torch.empty(
            out, inp // self.group, dtype=self.weight_scale.dtype, device=weight.device
        )
        for r0 in range(0, out, rows):
            w = weight[r0 : r0 + rows].float().view(-1, inp // self.group, self.group)  # (r, G, g)
            values, scale = symmetric_values(w, self.bits, scales.dtype)
            codes = values + qmax + 1
            codes = torch.nn.functional.pad(codes.view(codes.shape[0], inp), (0, pad))
            words = (codes.view(codes.shape[0], -1, per_word) << shifts).sum(-1)  # (r, words)
            packed[r0 : r0 + rows] = torch.where(words >= 1 << 31, words - (1 << 32), words).int()
            scales[r0 : r0 + rows] = scale
        self._buffers["weight_packed"] = packed
        self._buffers["weight_scale"] = scales
        self._buffers["weight_shape"] = torch.tensor([out, inp], device=weight.device)


def symmetric_values(
    w: torch.Tensor, bits: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`--quantize`'s rounding, for every layout it is stored in: w (rows, G, group) fp32;
    per row and group, scale = max|w| / (2^(b-1) - 1) rounded to `scale_dtype`, and the
    value round(w / scale) in [-2^(b-1), 2^(b-1) - 1] (int64): the stored, rounded scale is
    the one dequantization multiplies by, and a group of zeros is zeros."""
    qmax = (1 << (bits - 1)) - 1
    scale = (w.abs().amax(-1) / qmax).to(scale_dtype)  # (r, G)
    safe = scale.float().masked_fill(scale == 0, 1.0)
    values = torch.round(w / safe[:, :, None]).clamp_(-qmax - 1, qmax).long()  # (r, G, g)
    return values, scale


def _per_group_bytes(groups: int, out_features: int, work: torch.dtype) -> int:
    """The small tensors beside the codes: zero points and scales in the work dtype."""
    return 2 * groups * out_features * _itemsize(work)


def _grouped_rebuild_bytes(
    module: PackedLinear, stored: torch.dtype, dtype: torch.dtype, groups: int
) -> int:
    """Formats with contiguous groups: the codes are shifted and scaled in place by
    broadcast (group-sized temporaries only); then the codes and the result in `dtype`
    (none when the work dtype is `dtype`: `.to` returns the codes)."""
    work = _work_dtype(stored, dtype)
    n = module.in_features * module.out_features
    result = n * _itemsize(dtype) if work != dtype else 0
    peak = max(module._codes_bytes(work), n * _itemsize(work) + result)
    return peak + _per_group_bytes(groups, module.out_features, work)
