"""GGUF weights as ggml blocks (llama.cpp, Ollama, LM Studio files), decoded in torch.

A GGUF tensor with ne = [in, out] is stored row-major, each of its `out` rows a whole number
of blocks. `dequantize` rebuilds a tensor's [out, in] values from those bytes (uint8
[out, row_bytes]) on the tensor's own device, and `dequantize_rows` only the rows an
embedding lookup asks for. The modules that keep a tensor's blocks (`GGUFLinear`,
`GGUFEmbedding`) are modeling/weights/gguf_modules.py. The block layouts are in ../shared/models/gguf/README.md.

Every type is decoded in float32 with the very operations, in the very order, of gguf-py's
`gguf.quants.dequantize` (which equals llama.cpp's C dequantizers bit for bit): integer codes
first (exact in float32), then the scale products, e.g. Q4_K is (d·sc)·q − dmin·m with d·sc
rounded before it meets q. A fused or reordered product would differ in the last bit. The
float32 result is rounded once to the compute dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from enum import IntEnum

import torch
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as GGMLType

# Elements decoded at once: the temporaries stay a chunk's (64 MiB of float32 values and
# less beside them), not a projection's (a 70B's output matrix is about 4 GiB as float32),
# and a chunk is long enough that launching its few dozen kernels costs little on a GPU.
CHUNK_ELEMENTS = 1 << 24

# Types whose "blocks" are plain values: rebuilding is one dtype conversion.
FLOAT_TYPES: dict[BlockType, torch.dtype] = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
}

IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class UnsupportedGGMLTypeError(ValueError):
    """A GGUF tensor of a ggml type specd cannot decode."""


class SpecdType(IntEnum):
    """Block layouts of specd's own beside ggml's, for packed checkpoints that no ggml type
    holds exactly, so the CPU kernels compute them where they lie (`BlockQuantizedLinear`).
    Never in a file: the GGUF reader (modeling/checkpoints/gguf_file.py) refuses a type
    gguf-py does not size, and gguf_config.py accepts ggml's types alone.

    Q4_Z: 32 weights in 19 bytes, d f16, z u8, qs u8[16] in Q4_0's nibble order; weight
    (q - z) × d, one rounding: AWQ's, asymmetric GPTQ's and compressed-tensors' 4-bit
    groups, whose zero point is an integer per group (GPTQ's up to 16).
    Q4_0B, Q8_0B, Q4_ZB: Q4_0, Q8_0 and Q4_Z with a bf16 scale (compressed-tensors
    checkpoints store their scales in the model's dtype, bf16 as published)."""

    Q4_Z = 1004
    Q4_0B = 1005
    Q8_0B = 1006
    Q4_ZB = 1007


BlockType = GGMLType | SpecdType


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 field at byte `at` of each block, widened: (n, 1) float32."""
    return b[:, at : at + 2].view(torch.float16).float()


def _shifts(step: int, device: torch.device) -> torch.Tensor:
    """Bit positions 0, step, 2·step … below 8, made on the device (a tensor built on the
    host would be copied over, and the copy waits for the stream)."""
    return torch.arange(0, 8, step, dtype=torch.uint8, device=device)


def _nibbles(qs: torch.Tensor, x: torch.Tensor) -> None:
    """Low nibbles of `qs` (..., k) into x[..., 0, :], high ones into x[..., 1, :]: in every
    4-bit type the first half of a run is the low nibbles, not the even elements."""
    x[..., 0, :] = qs & 15
    x[..., 1, :] = qs >> 4


def _q8_0(b: torch.Tensor, x: torch.Tensor) -> None:  # d f16, qs i8[32]
    x.copy_(b[:, 2:].view(torch.int8))
    x *= _half(b, 0)


def _q4_0(b: torch.Tensor, x: torch.Tensor) -> None:  # d f16, qs u8[16]
    _nibbles(b[:, 2:], x.view(-1, 2, 16))
    x -= 8
    x *= _half(b, 0)


def _scale(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 2-byte scale leading each block, widened: (n, 1) float32 (copied: an odd-sized
    block's field is not aligned for a view)."""
    return b[:, :2].contiguous().view(dtype).float()


def _q4_z(b: torch.Tensor, x: torch.Tensor, dtype: torch.dtype = torch.float16) -> None:
    _nibbles(b[:, 3:], x.view(-1, 2, 16))  # d, z u8, qs u8[16]
    x -= b[:, 2:3]  # integers: exact
    x *= _scale(b, dtype)


def _q4_zb(b: torch.Tensor, x: torch.Tensor) -> None:  # d bf16, z u8, qs u8[16]
    _q4_z(b, x, torch.bfloat16)


def _q4_0b(b: torch.Tensor, x: torch.Tensor) -> None:  # d bf16, qs u8[16]
    _nibbles(b[:, 2:], x.view(-1, 2, 16))
    x -= 8
    x *= _scale(b, torch.bfloat16)


def _q8_0b(b: torch.Tensor, x: torch.Tensor) -> None:  # d bf16, qs i8[32]
    x.copy_(b[:, 2:].view(torch.int8))
    x *= _scale(b, torch.bfloat16)


def _q4_1(b: torch.Tensor, x: torch.Tensor) -> None:  # d f16, m f16, qs u8[16]
    _nibbles(b[:, 4:], x.view(-1, 2, 16))
    x *= _half(b, 0)
    x += _half(b, 2)


def _fifth_bits(b: torch.Tensor, x: torch.Tensor, qh: int) -> None:
    """Q5_0/Q5_1: element j gains 16 · bit j of the u32 at byte `qh` (bit j%8 of byte j//8)."""
    high = b[:, qh : qh + 4, None] >> _shifts(1, b.device)  # (n, 4, 8)
    high &= 1
    high <<= 4
    x += high.view(-1, 32)


def _q5_0(b: torch.Tensor, x: torch.Tensor) -> None:  # d f16, qh u8[4], qs u8[16]
    _nibbles(b[:, 6:], x.view(-1, 2, 16))
    _fifth_bits(b, x, 2)
    x -= 16
    x *= _half(b, 0)


def _q5_1(b: torch.Tensor, x: torch.Tensor) -> None:  # d f16, m f16, qh u8[4], qs u8[16]
    _nibbles(b[:, 8:], x.view(-1, 2, 16))
    _fifth_bits(b, x, 4)
    x *= _half(b, 0)
    x += _half(b, 2)


def _crumbs(qs: torch.Tensor, x: torch.Tensor) -> None:
    """2-bit codes: x[:, h, s, l] = (qs[:, h, l] >> 2s) & 3 (Q2_K, Q3_K, Q6_K's high bits)."""
    codes = qs[:, :, None, :] >> _shifts(2, qs.device)[:, None]  # (n, halves, 4, 32)
    codes &= 3
    x.copy_(codes)


def _q2_k(b: torch.Tensor, x: torch.Tensor) -> None:  # scales u8[16], qs u8[64], d, dmin
    _crumbs(b[:, 16:80].view(-1, 2, 32), x.view(-1, 2, 4, 32))
    scales = b[:, :16]
    dl = _half(b, 80) * (scales & 15)  # (n, 16)
    ml = _half(b, 82) * (scales >> 4)
    by_group = x.view(-1, 16, 16)
    by_group *= dl[..., None]
    by_group -= ml[..., None]


def _q3_k(b: torch.Tensor, x: torch.Tensor) -> None:  # hmask u8[32], qs u8[64], scales u8[12], d
    _crumbs(b[:, 32:96].view(-1, 2, 32), x.view(-1, 2, 4, 32))
    # Element 32k + l has bit k of hmask[l] as its third bit, and it is 4 *below* when clear.
    low = b[:, None, :32] >> _shifts(1, b.device)[:, None]  # (n, 8, 32)
    low &= 1
    low ^= 1
    low <<= 2
    x.view(-1, 8, 32).sub_(low)
    del low
    # Scale i (6 bits, minus 32): low 4 bits in byte i%8 (nibble i//8), high 2 bits in
    # byte 8 + i%4 (pair i//4).
    s = b[:, 96:108]
    scale_low = (s[:, None, :8] >> _shifts(4, b.device)[:, None]) & 15  # (n, 2, 8)
    scale_high = (s[:, None, 8:] >> _shifts(2, b.device)[:, None]) & 3  # (n, 4, 4)
    scales = (scale_low.view(-1, 16) | (scale_high.view(-1, 16) << 4)).float() - 32
    x.view(-1, 16, 16).mul_((_half(b, 108) * scales)[..., None])


def _scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins from 12 bytes (n, 12): groups 0-3 in the low
    6 bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7 in the nibbles of bytes 8-11 with
    their top 2 bits in the top of bytes 0-7."""
    sc, mn, both = s[:, :4], s[:, 4:8], s[:, 8:]
    scale = torch.cat([sc & 63, (both & 15) | ((sc >> 2) & 48)], dim=1)
    minimum = torch.cat([mn & 63, (both >> 4) | ((mn >> 2) & 48)], dim=1)
    return scale, minimum


def _q4_k(b: torch.Tensor, x: torch.Tensor) -> None:  # d, dmin, scales u8[12], qs u8[128]
    _nibbles(b[:, 16:].view(-1, 4, 32), x.view(-1, 4, 2, 32))
    _k_scales(b, x)


def _q5_k(b: torch.Tensor, x: torch.Tensor) -> None:  # d, dmin, scales[12], qh[32], qs[128]
    _nibbles(b[:, 48:].view(-1, 4, 32), x.view(-1, 4, 2, 32))
    high = b[:, None, 16:48] >> _shifts(1, b.device)[:, None]  # (n, 8, 32): bit k of qh[l]
    high &= 1
    high <<= 4
    x.view(-1, 8, 32).add_(high)
    del high
    _k_scales(b, x)


def _k_scales(b: torch.Tensor, x: torch.Tensor) -> None:
    """Q4_K/Q5_K: per group of 32, (d·sc)·q − dmin·m, each product rounded as gguf-py does."""
    scale, minimum = _scale_min(b[:, 4:16])
    by_group = x.view(-1, 8, 32)
    by_group *= (_half(b, 0) * scale)[..., None]
    by_group -= (_half(b, 2) * minimum)[..., None]


def _q6_k(b: torch.Tensor, x: torch.Tensor) -> None:  # ql u8[128], qh u8[64], scales i8[16], d
    _nibbles(b[:, :128].view(-1, 2, 64), x.view(-1, 2, 2, 64))
    high = b[:, 128:192].view(-1, 2, 1, 32) >> _shifts(2, b.device)[:, None]  # (n, 2, 4, 32)
    high &= 3
    high <<= 4
    x.view(-1, 2, 4, 32).add_(high)
    del high
    x -= 32
    x.view(-1, 16, 16).mul_((_half(b, 208) * b[:, 192:208].view(torch.int8))[..., None])


@functools.cache
def _iq4_values(device: torch.device) -> torch.Tensor:
    """The IQ4 code book on `device`, made once (a host copy per call would wait for the stream)."""
    return torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=device)


def _iq4_lookup(qs: torch.Tensor, x: torch.Tensor) -> None:
    """x = the IQ4 code book at each nibble of `qs` (n, runs, 16), in `_nibbles`' order."""
    codes = torch.empty((qs.shape[0], qs.shape[1], 2, 16), dtype=torch.int32, device=qs.device)
    _nibbles(qs, codes)
    torch.index_select(_iq4_values(qs.device), 0, codes.view(-1), out=x.view(-1))


def _iq4_nl(b: torch.Tensor, x: torch.Tensor) -> None:  # d f16, qs u8[16]
    _iq4_lookup(b[:, None, 2:], x)
    x *= _half(b, 0)


def _iq4_xs(b: torch.Tensor, x: torch.Tensor) -> None:  # d, scales_h u16, scales_l u8[4], qs[128]
    _iq4_lookup(b[:, 8:].view(-1, 8, 16), x)
    # Scale g (6 bits, minus 32): low 4 in nibble g%2 of scales_l[g//2], high 2 at bit 2g of
    # the u16 scales_h (read as its two bytes: bit 2g is bit 2(g%4) of byte g//4).
    low = (b[:, 4:8, None] >> _shifts(4, b.device)) & 15  # (n, 4, 2)
    high = (b[:, 2:4, None] >> _shifts(2, b.device)) & 3  # (n, 2, 4)
    scales = (low.view(-1, 8) | (high.view(-1, 8) << 4)).float() - 32
    x.view(-1, 8, 32).mul_((_half(b, 0) * scales)[..., None])


# MXFP4's e2m1 code book, doubled (its scale is halved to match: `_mxfp4`)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@functools.cache
def _mxfp4_values(device: torch.device) -> torch.Tensor:
    return torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=device)


def _mxfp4(b: torch.Tensor, x: torch.Tensor) -> None:  # e u8 (E8M0), qs u8[16]
    """gpt-oss's experts: 32 e2m1 codes (IQ4's nibble order) times half of 2^(e - 127),
    built from its bits as ggml does (2^(e - 128) for every e, subnormal below 2)."""
    codes = torch.empty((b.shape[0], 1, 2, 16), dtype=torch.int32, device=b.device)
    _nibbles(b[:, None, 1:], codes)
    torch.index_select(_mxfp4_values(b.device), 0, codes.view(-1), out=x.view(-1))
    del codes
    e = b[:, 0].to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(0x00200000, e), (e - 1) << 23)
    x *= bits.view(torch.float32)[:, None]


# type → (fills x (n, elements) float32 from blocks b (n, bytes), the most bytes per block it
# holds beside x at once, traced from the code above). Each decoder has an element-sized
# phase (u8 nibbles, bits or 2-bit codes: half a byte or a byte per element; IQ4's int32
# codes: four more) that is freed before its per-block scale tensors are made, and those
# are fewer bytes (Q8_0, which has no such phase, holds its d alone).
_DECODERS: dict[BlockType, tuple[Callable[[torch.Tensor, torch.Tensor], None], int]] = {
    GGMLType.Q8_0: (_q8_0, 4),  # d
    GGMLType.Q4_0: (_q4_0, 16),  # one nibble half
    GGMLType.Q4_1: (_q4_1, 16),
    GGMLType.Q5_0: (_q5_0, 32),  # the fifth bits
    GGMLType.Q5_1: (_q5_1, 32),
    GGMLType.Q2_K: (_q2_k, 256),  # the 2-bit codes
    GGMLType.Q3_K: (_q3_k, 256),  # the 2-bit codes, then the hmask bits
    GGMLType.Q4_K: (_q4_k, 128),  # one nibble half
    GGMLType.Q5_K: (_q5_k, 256),  # the fifth bits
    GGMLType.Q6_K: (_q6_k, 256),  # the high bits
    GGMLType.IQ4_NL: (_iq4_nl, 4 * 32 + 16),  # int32 codes and one nibble half
    GGMLType.IQ4_XS: (_iq4_xs, 4 * 256 + 128),
    GGMLType.MXFP4: (_mxfp4, 4 * 32 + 4),  # int32 codes, then the scales' bits
    SpecdType.Q4_Z: (_q4_z, 16),  # one nibble half
    SpecdType.Q4_0B: (_q4_0b, 16),
    SpecdType.Q8_0B: (_q8_0b, 4),
    SpecdType.Q4_ZB: (_q4_zb, 16),
}

# Beside those, a handful of small tensors (bit positions, a short chunk's scales), each
# rounded up to 512 bytes by the CUDA allocator.
_SMALL_TENSORS_BYTES = 8 * 512

# (elements, bytes) per block of every type this module decodes.
BLOCK_SIZES: dict[BlockType, tuple[int, int]] = {
    **{t: GGML_QUANT_SIZES[t] for t in (*FLOAT_TYPES, *_DECODERS) if isinstance(t, GGMLType)},
    SpecdType.Q4_Z: (32, 19),
    SpecdType.Q4_0B: (32, 18),
    SpecdType.Q8_0B: (32, 34),
    SpecdType.Q4_ZB: (32, 19),
}


def block_type(value: int | BlockType) -> BlockType | None:
    """`value` as ggml's type or specd's own, None for neither (no exception raised: a
    compiled pass traces this)."""
    if isinstance(value, GGMLType | SpecdType):
        return value
    for enum in (GGMLType, SpecdType):
        member = enum._value2member_map_.get(int(value))
        if member is not None:
            return member  # type: ignore[return-value]
    return None


def supported_type(value: int | BlockType) -> BlockType:
    """`value` as a type this module decodes, else UnsupportedGGMLTypeError."""
    kind = block_type(value)
    if kind is None or kind not in BLOCK_SIZES:
        name = value if kind is None else f"{kind.name} ({int(kind)})"
        supported = ", ".join(t.name for t in BLOCK_SIZES if isinstance(t, GGMLType))
        raise UnsupportedGGMLTypeError(
            f"ggml type {name} cannot be decoded; supported: {supported}"
        )
    return kind


def row_bytes(ggml_type: int | BlockType, columns: int) -> int:
    """Bytes of one stored row of `columns` values: a GGUF row is whole blocks."""
    kind = supported_type(ggml_type)
    elements, size = BLOCK_SIZES[kind]
    if columns % elements:
        raise ValueError(f"{columns} columns are not whole {kind.name} blocks of {elements}")
    return columns // elements * size


def _chunk_rows(columns: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // columns)


def dequantize(
    blocks: torch.Tensor,  # (rows, row_bytes) uint8
    ggml_type: int | BlockType,
    columns: int,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """The (rows, columns) values of a GGUF tensor's rows, in `dtype`: decoded in float32
    bit for bit as gguf-py does, then rounded once. `out`: a flat buffer of `dtype` with
    room for them (a `RebuildScratch`'s), else a new tensor. Rows are decoded a chunk of
    about `chunk_elements` at a time, so beside the result the temporaries are a chunk's
    (`dequantize_bytes`)."""
    ggml_type = supported_type(ggml_type)
    rows, width = blocks.shape[0], row_bytes(ggml_type, columns)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (rows, width):
        raise ValueError(
            f"{ggml_type.name} blocks of {columns} columns are uint8 (rows, {width}),"
            f" not {blocks.dtype} {tuple(blocks.shape)}"
        )
    if out is None:
        result = torch.empty(rows, columns, dtype=dtype, device=blocks.device)
    else:
        result = out.view(-1)[: rows * columns].view(rows, columns)
    if ggml_type in FLOAT_TYPES:
        return result.copy_(blocks.view(FLOAT_TYPES[ggml_type]))
    elements, size = BLOCK_SIZES[ggml_type]
    decode = _DECODERS[ggml_type][0]
    step = _chunk_rows(columns, chunk_elements)
    for start in range(0, rows, step):
        part = result[start : start + step]  # (r, columns)
        b = blocks[start : start + step].view(-1, size)  # (r · blocks per row, size)
        if dtype == torch.float32:
            decode(b, part.view(-1, elements))
            continue
        x = torch.empty(part.shape, dtype=torch.float32, device=part.device)
        decode(b, x.view(-1, elements))
        part.copy_(x)
        del x  # before the next chunk's is made
    return result


def dequantize_bytes(
    rows: int,
    columns: int,
    ggml_type: int | BlockType,
    dtype: torch.dtype,
    *,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> int:
    """The most bytes `dequantize` holds at once beside its result (which is `out` or
    rows × columns × itemsize(dtype) more): for a float type none; else, for a chunk of
    r = min(rows, chunk_elements // columns) rows, 4·r·columns for its float32 values
    unless `dtype` is float32 (then they are decoded in place), plus the decoder's bytes per
    block (`_DECODERS`) times the chunk's blocks, plus 4 KiB of small tensors."""
    ggml_type = supported_type(ggml_type)
    if ggml_type in FLOAT_TYPES:
        return 0
    elements, _ = BLOCK_SIZES[ggml_type]
    chunk = min(rows, _chunk_rows(columns, chunk_elements)) * columns
    work = 0 if dtype == torch.float32 else 4 * chunk
    return work + chunk // elements * _DECODERS[ggml_type][1] + _SMALL_TENSORS_BYTES


def dequantize_rows(
    blocks: torch.Tensor,  # (vocab, row_bytes) uint8
    ggml_type: int | BlockType,
    columns: int,
    ids: torch.Tensor,  # (...) int
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """An embedding lookup of a quantized table: rows `ids` (..., columns) in `dtype`,
    only those rows gathered and decoded, in one go (a lookup is a pass's tokens: no
    chunking, and no loop over them for a compiler to specialise on)."""
    kind = supported_type(ggml_type)
    picked = blocks.index_select(0, ids.reshape(-1))  # (k, row_bytes)
    if kind in FLOAT_TYPES:
        values = picked.view(FLOAT_TYPES[kind]).to(dtype)
    else:
        elements, size = BLOCK_SIZES[kind]
        decoded = torch.empty(picked.shape[0], columns, dtype=torch.float32, device=blocks.device)
        _DECODERS[kind][0](picked.view(-1, size), decoded.view(-1, elements))
        values = decoded.to(dtype)
    return values.view(*ids.shape, columns)
