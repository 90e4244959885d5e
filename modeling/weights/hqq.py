"""Half-quadratic quantization (HQQ; Badri and Shaji, 2023): low-bit weights with no
calibration data, for the substitute draft (modeling/substitute.py).

Each group of GROUP input channels of a projection's row gets an affine code book:
w ≈ (code - zero) · scale, codes in 0 .. 2^b - 1. Min-max rounding alone is poor at 2-3
bits, where one outlier stretches a group's range over all of its codes. HQQ keeps the
min-max scale and finds the zero point that minimises the l_p error (p < 1, so a few
large errors cost less than many small ones: the outliers are let go) by half-quadratic
splitting, an alternation with closed-form steps:

    q   = clamp(round(w / s + z), 0, 2^b - 1)          the codes for the current zero
    e   = shrink_p(w - (q - z) s, β)                   the error, sparsified (prox of |.|^p)
    z   = mean over the group of (q - (w - e) / s)     the zero that fits w - e best
    β  *= κ

each group stopping at its first iteration whose mean absolute error |w - (q - z) s| did not
fall, and keeping the zero that had the least. Scales and zeros are stored in fp16 and the final codes are
rounded against those stored values, so dequantization reproduces exactly what was
optimised for.
"""

from __future__ import annotations

import math

import torch

from modeling.weights.packed import (
    PackedLinear,
    _grouped_rebuild_bytes,
    _itemsize,
    _per_group_bytes,
    _work_dtype,
    unpack,
)

GROUP = 64  # input channels per scale and zero (SubSpec's and HQQ's default for 2-4 bits)
LP_NORM = 0.7
BETA = 10.0
KAPPA = 1.01
ITERATIONS = 20
# Weights (rows × inputs) optimised and packed at once: the temporaries stay a block's
# (BUILD_BYTES_PER_WEIGHT each), whatever the projection's size: 4M weights, 1,024 rows
# of a 4,096-wide projection, 146 of a 70B's 28,672-wide down projection.
BLOCK_WEIGHTS = 1 << 22
# Temporaries per weight of a block, traced from `quantize`, `optimise_zero` and `shrink`:
# the fp32 copy of a bf16/fp16 weight (4), and the iteration's fp32 tensors alive at once
# at its peak, inside `shrink` (the codes, the rebuilt weights, their difference, its sign,
# magnitude and power, and the running product: 8 × 4); `pack`'s int64 codes, padded copy
# and shifted words (3 × 8) come after and are fewer. Measured on a CPU: 38 with a bf16
# weight (tests/test_hqq_build_memory.py), so one more fp32 tensor is reserved.
BUILD_BYTES_PER_WEIGHT = 4 + 9 * 4


def shrink(x: torch.Tensor, beta: float, p: float = LP_NORM) -> torch.Tensor:
    """The proximal operator of |x|^p / beta, elementwise (generalised soft thresholding)."""
    return torch.sign(x) * torch.relu(x.abs() - x.abs().pow(p - 1) / beta)


def optimise_zero(
    w: torch.Tensor,  # (..., group) fp32
    scale: torch.Tensor,  # (..., 1)
    zero: torch.Tensor,  # (..., 1) the starting zero point
    bits: int,
) -> torch.Tensor:
    """The zero point (..., 1) minimising the l_p reconstruction error for a fixed scale
    (the module docstring's iteration), each group stopping on its own."""
    top = (1 << bits) - 1
    best_zero = zero.clone()
    best_error = torch.full_like(zero, math.inf)
    active = torch.ones_like(zero, dtype=torch.bool)
    beta = BETA
    for _ in range(ITERATIONS):
        codes = torch.round(w / scale + zero).clamp_(0, top)
        rebuilt = (codes - zero) * scale
        error = (w - rebuilt).abs().mean(-1, keepdim=True)  # (..., 1)
        active &= error < best_error
        if not bool(active.any()):
            break
        best_zero = torch.where(active, zero, best_zero)
        best_error = torch.where(active, error, best_error)
        residual = shrink(w - rebuilt, beta)
        zero = (codes - (w - residual) / scale).mean(-1, keepdim=True)
        beta *= KAPPA
    return best_zero


def quantize(
    weight: torch.Tensor, bits: int, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (out, in) int64, scale (out, G) fp16, zero (out, G) fp16) of a [out, in]
    weight: min-max scales, HQQ zero points, rows a block at a time."""
    out, inp = weight.shape
    if inp % group:
        raise ValueError(f"{inp} input channels are not a multiple of the group size {group}")
    top = (1 << bits) - 1
    codes = torch.empty(out, inp, dtype=torch.long, device=weight.device)
    scales = torch.empty(out, inp // group, dtype=torch.float16, device=weight.device)
    zeros = torch.empty_like(scales)
    rows = block_rows(inp)
    for r0 in range(0, out, rows):
        w = weight[r0 : r0 + rows].float().view(-1, inp // group, group)  # (r, G, g)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        # A constant group (hi == lo) still needs a finite scale: any, its codes are 0.
        scale = ((hi - lo) / top).clamp(min=1e-8)
        zero = optimise_zero(w, scale, -lo / scale, bits)
        # What dequantization will use, and the codes rounded against exactly that.
        scale16, zero16 = scale.half(), zero.half()
        q = torch.round(w / scale16.float() + zero16.float()).clamp_(0, top)
        codes[r0 : r0 + rows] = q.view(-1, inp).long()
        scales[r0 : r0 + rows] = scale16.squeeze(-1)
        zeros[r0 : r0 + rows] = zero16.squeeze(-1)
    return codes, scales, zeros


def block_rows(inputs: int) -> int:
    """Rows of a projection with `inputs` inputs quantized at once (BLOCK_WEIGHTS)."""
    return max(1, BLOCK_WEIGHTS // inputs)


def build_bytes(in_features: int, out_features: int) -> int:
    """The most bytes `HQQLinear.quantize_from` holds at once besides its input weight and
    its packed result: one block's temporaries."""
    rows = min(out_features, block_rows(in_features))
    return rows * in_features * BUILD_BYTES_PER_WEIGHT


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(out, in) codes → (out, words) int32, 32 // bits codes a word from the lowest bits
    (3 bits: ten a word, the top two bits unused), the last word padded with zeros."""
    per_word = 32 // bits
    out, inp = codes.shape
    words = -(-inp // per_word)
    padded = torch.nn.functional.pad(codes, (0, words * per_word - inp))
    shifts = torch.arange(per_word, device=codes.device) * bits  # (per_word,)
    packed = (padded.view(out, words, per_word) << shifts).sum(-1)  # (out, words) int64
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).int()


class HQQLinear(PackedLinear):
    """A projection quantized by HQQ: `codes` int32 [out, words] packed along the input,
    `scale` and `zero` fp16 [out, G]. weight[j, k] = (code[j, k] - zero[j, k div group])
    · scale[j, k div group]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    traceable = True  # (the substitute draft's steps compile: modeling/compiled.py)

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int, group: int):
        super().__init__(in_features, out_features, bias, bits)
        if in_features % group:
            raise ValueError(f"{in_features} inputs are not a multiple of the group {group}")
        self.group = group
        words = -(-in_features // (32 // bits))
        groups = in_features // group
        self.register_buffer("codes", torch.zeros(out_features, words, dtype=torch.int32))
        self.register_buffer("scale", torch.zeros(out_features, groups, dtype=torch.float16))
        self.register_buffer("zero", torch.zeros(out_features, groups, dtype=torch.float16))

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor) -> None:
        """Fill the packed tensors from a full-precision [out, in] weight."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight {tuple(weight.shape)} is not ({self.out_features}, {self.in_features})"
            )
        # Quantized and packed a block of rows at a time: never the whole projection's
        # codes as int64 (8 bytes a weight: 1.9 GB for a 70B's down projection).
        out, device = self.out_features, weight.device
        packed = torch.empty(out, self.codes.shape[1], dtype=torch.int32, device=device)
        scale = torch.empty(out, self.scale.shape[1], dtype=torch.float16, device=device)
        zero = torch.empty_like(scale)
        rows = block_rows(self.in_features)
        for r0 in range(0, out, rows):
            codes, scale[r0 : r0 + rows], zero[r0 : r0 + rows] = quantize(
                weight[r0 : r0 + rows], self.bits, self.group
            )
            packed[r0 : r0 + rows] = pack(codes, self.bits)
            del codes
        self._buffers["codes"] = packed
        self._buffers["scale"] = scale
        self._buffers["zero"] = zero

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        work = _work_dtype(torch.float16, dtype)
        n = self.out_features * self.codes.shape[1] * (32 // self.bits)
        buffer = self._codes_buffer(n, work, self.codes.device)
        weight = unpack(self.codes, self.bits, 1, work, out=buffer)  # (out, words · per_word)
        if weight.shape[1] != self.in_features:  # a padded last word
            weight = weight[:, : self.in_features].contiguous()
        by_group = weight.view(self.out_features, -1, self.group)  # (out, G, group)
        by_group -= self.zero.to(work)[:, :, None]
        by_group *= self.scale.to(work)[:, :, None]
        return self._finish(weight, dtype)

    def rebuild_bytes(self, dtype: torch.dtype) -> int:
        groups = self.scale.shape[1]
        grouped = _grouped_rebuild_bytes(self, torch.float16, dtype, groups)
        if self.codes.shape[1] * (32 // self.bits) == self.in_features:
            return grouped
        # A padded last word: the unpacked codes and their unpadded copy, side by side.
        work = _work_dtype(torch.float16, dtype)
        pair = 2 * self.in_features * self.out_features * _itemsize(work)
        return max(grouped, pair + _per_group_bytes(groups, self.out_features, work))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group={self.group}, hqq"
