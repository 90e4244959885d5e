"""GGUF block decoding in torch (modeling/weights/gguf_blocks.py) against gguf-py's reference
dequantizers (`gguf.quants.dequantize`, which equal llama.cpp's C ones bit for bit): every
type on random blocks, every tensor of the real files in ../shared/models/gguf, compared
bit for bit; `GGUFLinear` as a projection; and the temporaries against `rebuild_bytes`."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as GGMLType
from gguf.quants import dequantize as reference_dequantize
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from modeling.weights import cpu_kernels
from modeling.weights.gguf_blocks import (
    BLOCK_SIZES,
    FLOAT_TYPES,
    SpecdType,
    UnsupportedGGMLTypeError,
    dequantize,
    dequantize_bytes,
    dequantize_rows,
    row_bytes,
)
from modeling.weights.gguf_modules import GGUFEmbedding, GGUFLinear
from modeling.weights.packed import RebuildScratch

# Byte offsets of each type's float16 fields (d, and dmin or m) within its block: random
# bytes there could be NaN or infinite, which compare unequal to themselves.
HALF_FIELDS = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
    GGMLType.MXFP4: (),  # its scale is a byte: kept in range below
    SpecdType.Q4_Z: (0,),
    SpecdType.Q4_0B: (),  # bf16 scales: kept finite below
    SpecdType.Q8_0B: (),
    SpecdType.Q4_ZB: (),
}
BF16_SCALED = (SpecdType.Q4_0B, SpecdType.Q8_0B, SpecdType.Q4_ZB)
TYPES = list(BLOCK_SIZES)


def finite_halves(n: int, gen: torch.Generator) -> torch.Tensor:
    """n random float16 bit patterns over the whole range, subnormals and signs included,
    with the all-ones exponent (inf, NaN) folded onto finite ones: (n, 2) uint8."""
    bits = torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32)
    bits = torch.where((bits & 0x7C00) == 0x7C00, bits ^ 0x4000, bits)
    return bits.to(torch.int16).view(torch.uint8).view(n, 2)


def random_blocks(ggml_type: GGMLType, rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """(rows, row_bytes) of random blocks: every byte random but the float fields finite."""
    gen = torch.Generator().manual_seed(seed)
    size = BLOCK_SIZES[ggml_type][1]
    if ggml_type in FLOAT_TYPES:
        values = torch.randn(rows, columns, generator=gen).to(FLOAT_TYPES[ggml_type])
        return values.view(torch.uint8).clone()
    blocks = torch.randint(
        0, 256, (rows, row_bytes(ggml_type, columns)), generator=gen, dtype=torch.uint8
    )
    by_block = blocks.view(-1, size)
    for at in HALF_FIELDS[ggml_type]:
        by_block[:, at : at + 2] = finite_halves(by_block.shape[0], gen)
    if ggml_type in BF16_SCALED:  # the exponent's top bit clear: finite, subnormals too
        by_block[:, 1] &= 0xBF
    if ggml_type == GGMLType.MXFP4:  # 2^(e - 128) x 12 within float16 (and a subnormal e)
        by_block[:, 0] = torch.randint(98, 140, (by_block.shape[0],), generator=gen).to(torch.uint8)
        by_block[0, 0] = 1
    return blocks


def reference(blocks: torch.Tensor | np.ndarray, ggml_type: GGMLType) -> torch.Tensor:
    raw = blocks.numpy() if isinstance(blocks, torch.Tensor) else blocks
    if ggml_type in SpecdType:  # specd's own: codes less 8 or the zero point, times d
        size = BLOCK_SIZES[ggml_type][1]
        b = raw.reshape(-1, size)
        if ggml_type in BF16_SCALED:  # a bf16 is a float32's top half
            d = (b[:, :2].copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            d = b[:, :2].copy().view(np.float16).astype(np.float32)  # (n, 1)
        if ggml_type == SpecdType.Q8_0B:
            return torch.from_numpy(
                (b[:, 2:].view(np.int8).astype(np.float32) * d).reshape(raw.shape[0], -1)
            )
        zeroed = ggml_type in (SpecdType.Q4_Z, SpecdType.Q4_ZB)
        qs = b[:, 3:] if zeroed else b[:, 2:]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
        z = b[:, 2:3].astype(np.float32) if zeroed else np.float32(8)
        return torch.from_numpy(((q - z) * d).reshape(raw.shape[0], -1))
    return torch.from_numpy(np.array(reference_dequantize(raw, ggml_type), dtype=np.float32))


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # signed zeros too


def columns_for(ggml_type: GGMLType) -> int:
    return 512 if BLOCK_SIZES[ggml_type][0] == 256 else 96  # 96: 32-blocks, not of 256


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_random_blocks_decode_as_gguf_py_does(ggml_type: GGMLType) -> None:
    columns = columns_for(ggml_type)
    blocks = random_blocks(ggml_type, 7, columns)
    want = reference(blocks, ggml_type)
    assert_same_bits(dequantize(blocks, ggml_type, columns), want)
    # Chunks of two rows, the last one short: the same values.
    assert_same_bits(dequantize(blocks, ggml_type, columns, chunk_elements=2 * columns), want)


def test_every_tensor_of_the_files_decodes_as_gguf_py_does(shared_models: Path) -> None:
    paths = sorted((shared_models / "gguf").glob("*.gguf"))
    assert len(paths) == 13, paths
    seen = set()
    for path in paths:
        for tensor in GGUFReader(path).tensors:
            columns = int(tensor.shape[0])  # ne[0]: the contiguous dimension
            rows = int(np.prod(tensor.shape[1:]))
            raw = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
            assert raw.shape[1] == row_bytes(tensor.tensor_type, columns), tensor.name
            got = dequantize(torch.from_numpy(raw.copy()), tensor.tensor_type, columns)
            want = reference(raw, tensor.tensor_type).view(rows, columns)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (path, tensor.name)
            seen.add(tensor.tensor_type.name)
    assert seen == {
        "F32",
        "F16",
        "BF16",
        "Q8_0",
        "Q4_0",
        "Q5_0",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    }


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_other_dtypes_are_the_float32_values_rounded_once_into_out(
    ggml_type: GGMLType, dtype: torch.dtype
) -> None:
    columns = columns_for(ggml_type)
    blocks = random_blocks(ggml_type, 5, columns, seed=1)
    out = torch.full((5 * columns + 13,), 7.0, dtype=dtype)  # room to spare, as a scratch's
    got = dequantize(blocks, ggml_type, columns, dtype, out, chunk_elements=3 * columns)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, reference(blocks, ggml_type).to(dtype))
    assert torch.equal(out[-13:], torch.full((13,), 7.0, dtype=dtype))  # nothing past it


def linear_of(
    ggml_type: GGMLType, in_features: int, out_features: int, bias: bool = False
) -> tuple[GGUFLinear, torch.Tensor]:
    """A GGUFLinear over random blocks, and its weight as gguf-py decodes them."""
    module = GGUFLinear(in_features, out_features, bias, ggml_type)
    blocks = random_blocks(ggml_type, out_features, in_features, seed=2)
    module.blocks.copy_(blocks)
    if bias:
        assert module.bias is not None
        module.bias.data.normal_()
    return module, reference(blocks, ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_forward_is_f_linear_with_the_reference_weight(ggml_type: GGMLType) -> None:
    """A pass longer than the CPU kernels take rebuilds the weight: F.linear's very values
    (tests/test_cpu_kernels.py checks the kernels' shorter passes)."""
    module, weight = linear_of(ggml_type, columns_for(ggml_type), 24, bias=True)
    x = torch.randn(3, cpu_kernels.max_product_rows() // 3 + 1, module.in_features)
    assert torch.equal(module(x), F.linear(x, weight, module.bias))


def test_projections_rebuild_into_the_shared_scratch() -> None:
    scratch = RebuildScratch()
    small, small_weight = linear_of(GGMLType.Q4_K, 512, 16)
    large, large_weight = linear_of(GGMLType.Q6_K, 512, 32)
    small.scratch = large.scratch = scratch
    first = large.dequantize(torch.float32)
    assert torch.equal(first, large_weight)
    second = small.dequantize(torch.float32)
    assert second.data_ptr() == first.data_ptr()  # the same buffer, reused
    assert torch.equal(second, small_weight)
    assert scratch.nbytes == 512 * 32 * 4


def test_bf16_compute_keeps_the_blocks_and_rounds_the_weight() -> None:
    module, weight = linear_of(GGMLType.Q5_K, 512, 16, bias=True)
    stored = module.blocks.clone()
    module.to(torch.bfloat16)
    assert module.blocks.dtype == torch.uint8 and torch.equal(module.blocks, stored)
    assert module.bias is not None and module.bias.dtype == torch.bfloat16
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    assert torch.equal(module(x), F.linear(x, weight.to(torch.bfloat16), module.bias))


@pytest.mark.parametrize("ggml_type", list(FLOAT_TYPES), ids=lambda t: t.name)
def test_a_float_tensor_in_the_compute_dtype_is_its_own_weight(ggml_type: GGMLType) -> None:
    module, weight = linear_of(ggml_type, 64, 8)
    dtype = FLOAT_TYPES[ggml_type]
    own = module.dequantize(dtype)
    assert own.data_ptr() == module.blocks.data_ptr() and own.shape == (8, 64)
    assert torch.equal(own.float(), weight)
    assert module.rebuild_bytes(dtype) == 0


def test_embedding_rows_decode_only_the_rows_asked_for() -> None:
    blocks = random_blocks(GGMLType.Q4_K, 40, 256, seed=3)
    ids = torch.tensor([[3, 39, 3], [0, 17, 5]])
    got = dequantize_rows(blocks, GGMLType.Q4_K, 256, ids, torch.bfloat16)
    assert got.shape == (2, 3, 256)
    assert torch.equal(got, reference(blocks, GGMLType.Q4_K)[ids].to(torch.bfloat16))


def test_refusals_say_what_is_wrong() -> None:
    with pytest.raises(
        UnsupportedGGMLTypeError, match=r"IQ2_XXS \(16\) cannot be decoded; supported: F32"
    ):
        GGUFLinear(256, 4, False, GGMLType.IQ2_XXS)
    with pytest.raises(UnsupportedGGMLTypeError, match="ggml type 99"):
        row_bytes(99, 256)
    with pytest.raises(ValueError, match="not whole Q4_K blocks of 256"):
        row_bytes(GGMLType.Q4_K, 172)
    with pytest.raises(ValueError, match=r"uint8 \(rows, 144\)"):
        dequantize(torch.zeros(2, 145, dtype=torch.uint8), GGMLType.Q4_K, 256)


class LiveTensorBytes(TorchDispatchMode):
    """The most bytes that tensors made inside the block held at once: each new storage is
    counted from the op that made it until it is freed (a weakref on the storage object,
    which PyTorch keeps for as long as the storage lives). Storages of `known` tensors,
    and views of them, are not counted."""

    def __init__(self, *known: torch.Tensor) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.known or key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_rebuild_bytes_is_the_traced_peak(ggml_type: GGMLType) -> None:
    columns = columns_for(ggml_type)
    for dtype in (torch.float32, torch.bfloat16):
        # In chunks of three rows (the last one short), into a scratch-like buffer:
        blocks = random_blocks(ggml_type, 8, columns)
        out = torch.empty(8 * columns, dtype=dtype)
        dequantize(blocks, ggml_type, columns, dtype, out)  # the IQ4 table is made once
        with LiveTensorBytes(blocks, out) as live:
            dequantize(blocks, ggml_type, columns, dtype, out, chunk_elements=3 * columns)
        planned = dequantize_bytes(8, columns, ggml_type, dtype, chunk_elements=3 * columns)
        # The trace is exact but for the small tensors' allowance (4 KiB).
        assert live.peak <= planned <= live.peak + 4096, (dtype, live.peak, planned)
        # A projection, whole, with its result:
        module, _ = linear_of(ggml_type, columns, 16)
        with LiveTensorBytes(module.blocks) as live:
            module.dequantize(dtype)
        assert live.peak <= module.rebuild_bytes(dtype) <= live.peak + 4096, dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_on_cuda_the_values_are_the_cpus(ggml_type: GGMLType) -> None:
    columns = 4096
    blocks = random_blocks(ggml_type, 64, columns, seed=4)
    want = dequantize(blocks, ggml_type, columns)
    assert_same_bits(dequantize(blocks.cuda(), ggml_type, columns).cpu(), want)
    module, _ = linear_of(ggml_type, columns, 512)
    module.cuda()
    for dtype in (torch.float32, torch.bfloat16):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        weight = module.dequantize(dtype)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        # The allocator may hand out a cached block up to 1 MiB larger than asked for.
        assert peak <= module.rebuild_bytes(dtype) + (1 << 20), (dtype, peak)
        expected = dequantize(module.blocks.cpu(), ggml_type, columns, dtype)
        assert torch.equal(weight.cpu(), expected)


def test_an_embedding_lookup_compiles_for_any_number_of_tokens() -> None:
    """The lookup decodes the gathered rows in one go: a compiled pass does not specialise
    on its token count (a loop over row chunks made torch.compile pin it: a small GGUF
    target's compiled passes failed)."""
    table = GGUFEmbedding(512, 256, GGMLType.Q8_0)
    table._buffers["blocks"] = torch.randint(0, 256, table.blocks.shape, dtype=torch.uint8)
    scales = torch.full((table.blocks.numel() // 34, 1), 0.01, dtype=torch.float16)
    table.blocks.view(-1, 34)[:, 0:2] = scales.view(torch.uint8)
    compiled = torch.compile(table, dynamic=True, fullgraph=True)
    for n in (2, 5, 9):
        ids = torch.randint(0, 512, (n,))
        torch._dynamo.mark_dynamic(ids, 0)  # a constraint violation if it specialises
        assert torch.equal(compiled(ids), table(ids))
