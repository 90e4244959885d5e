"""Packed checkpoints laid out as blocks the CPU kernels compute (modeling/weights/
block_layout.py): 4-bit weights with a zero point per group (AWQ, asymmetric GPTQ and
compressed-tensors) as Q4_Z, and GPTQ's act-order with its inputs sorted by group. Random
packed tensors over their whole code range (every zero point GPTQ can store, 16 included),
at a real width; each layout rebuilds the stored weight bit for bit and its products are
the stored weight's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from daemon.footprint import footprint
from modeling.decoder import Transformer
from modeling.weights import cpu_kernels
from modeling.weights.block_layout import BlockQuantizedLinear, layout_type
from modeling.weights.gguf_blocks import GGMLType, SpecdType
from modeling.weights.packed import AWQLinear, CompressedLinear, GPTQLinear, PackedLinear
from modeling.weights.quant import laid_out_for, parse_quantization
from offload.layout import FlatLayout
from tests.test_quant import FORMATS, full_config

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.status())

IN, OUT, GROUP = 1024, 96, 128


def words(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """int32 words of random bits: every code of every position."""
    return torch.randint(-(1 << 31), (1 << 31) - 1, shape, generator=gen, dtype=torch.int32)


def scales(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=gen) * 0.02 + 1e-4).half()


def gptq(symmetric: bool, act_order: bool, seed: int = 0) -> GPTQLinear:
    gen = torch.Generator().manual_seed(seed)
    m = GPTQLinear(IN, OUT, False, 4, GROUP)
    groups = IN // GROUP
    m.qweight.copy_(words(IN // 8, OUT, gen=gen))
    if symmetric:  # every stored zero 7 (zero point 8)
        m.qzeros.fill_(0x77777777)
    else:
        m.qzeros.copy_(words(groups, OUT // 8, gen=gen))
        m.qzeros[0, 0] |= 0xF  # a stored 15: zero point 16
    m.scales.copy_(scales(groups, OUT, gen=gen))
    k = torch.arange(IN)
    if act_order:  # GPTQ's desc_act: the group of input perm[j] is j // group
        perm = torch.randperm(IN, generator=gen)
        m.g_idx[perm] = (k // GROUP).int()
    else:
        m.g_idx.copy_(k // GROUP)
    return m


def awq(seed: int = 0) -> AWQLinear:
    gen = torch.Generator().manual_seed(seed)
    m = AWQLinear(IN, OUT, False, GROUP)
    m.qweight.copy_(words(IN, OUT // 8, gen=gen))
    m.qzeros.copy_(words(IN // GROUP, OUT // 8, gen=gen))
    m.scales.copy_(scales(IN // GROUP, OUT, gen=gen))
    return m


def compressed(
    symmetric: bool, seed: int = 0, dtype: torch.dtype = torch.float16, bits: int = 4
) -> CompressedLinear:
    gen = torch.Generator().manual_seed(seed)
    m = CompressedLinear(IN, OUT, False, bits, GROUP, symmetric, dtype)
    m.weight_packed.copy_(words(OUT, IN * bits // 32, gen=gen))
    m.weight_scale.copy_(scales(OUT, IN // GROUP, gen=gen).to(dtype))
    m.weight_shape.copy_(torch.tensor([OUT, IN]))
    if m.weight_zero_point is not None:
        m.weight_zero_point.copy_(words(OUT // 8, IN // GROUP, gen=gen))
    return m


CASES = {  # name → (the stored projection, symmetric, act-order, the block type)
    "gptq-asym": (lambda: gptq(False, False), False, False, SpecdType.Q4_Z),
    "gptq-asym-act-order": (lambda: gptq(False, True), False, True, SpecdType.Q4_Z),
    "gptq-act-order": (lambda: gptq(True, True), True, True, GGMLType.Q4_0),
    "awq": (awq, False, False, SpecdType.Q4_Z),
    "compressed-asym": (lambda: compressed(False), False, False, SpecdType.Q4_Z),
    # compressed-tensors as published: the model's dtype for the scales
    "compressed-bf16": (
        lambda: compressed(True, dtype=torch.bfloat16),
        True,
        False,
        SpecdType.Q4_0B,
    ),
    "compressed-bf16-8bit": (
        lambda: compressed(True, dtype=torch.bfloat16, bits=8),
        True,
        False,
        SpecdType.Q8_0B,
    ),
    "compressed-bf16-asym": (
        lambda: compressed(False, dtype=torch.bfloat16),
        False,
        False,
        SpecdType.Q4_ZB,
    ),
}
BLOCK_BYTES = {SpecdType.Q4_Z: 19, SpecdType.Q4_ZB: 19, SpecdType.Q8_0B: 34}


@pytest.mark.parametrize("name", list(CASES))
def test_blocks_rebuild_the_stored_weight_bit_for_bit(name: str) -> None:
    make, symmetric, act_order, kind = CASES[name]
    stored = make()
    assert BlockQuantizedLinear.has_block_form(stored, symmetric, act_order)
    blocks = BlockQuantizedLinear.from_packed(stored, symmetric, act_order, rows=20)  # 24, 24, ..
    assert blocks is not None and blocks.ggml_type == kind
    assert (blocks.input_order is not None) == act_order
    want = stored.dequantize(torch.float32)
    assert torch.equal(blocks.dequantize(torch.float32), want)
    assert blocks.blocks.numel() == OUT * IN // 32 * BLOCK_BYTES.get(kind, 18)
    # Products of 1, 3, 20 (the kernels where built) and 80 rows (rebuilt): the stored
    # weight's.
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 20, 80):
        x = torch.randn(rows, IN, generator=gen)
        assert torch.allclose(blocks(x), x @ want.t(), rtol=1e-5, atol=1e-4)


@needs_kernels
def test_zero_point_blocks_are_computed_where_they_lie() -> None:
    assert cpu_kernels.computes(SpecdType.Q4_Z, torch.float32, "cpu")
    blocks = BlockQuantizedLinear.from_packed(awq(), False)
    assert blocks is not None and blocks.computed_in_place(torch.float32, torch.device("cpu"))


def test_what_has_no_block_form_is_said_before_converting() -> None:
    asym = gptq(False, False)
    assert not BlockQuantizedLinear.has_block_form(asym, True)  # zero points not all 8
    assert BlockQuantizedLinear.from_packed(asym, True) is None
    permuted = gptq(True, True)
    assert not BlockQuantizedLinear.has_block_form(permuted, True, False)  # desc_act unsaid
    uneven = gptq(True, True)  # group 1 a single input, group 0 the rest of its own
    uneven.g_idx[uneven.g_idx == 1] = 0
    uneven.g_idx[0] = 1
    assert not BlockQuantizedLinear.has_block_form(uneven, True, True)
    assert not BlockQuantizedLinear.has_block_form(awq(), True)  # AWQ has zero points
    assert not BlockQuantizedLinear.has_block_form(compressed(True), False)
    assert not BlockQuantizedLinear.has_block_form(awq(), False, act_order=True)  # GPTQ's
    fp32 = compressed(False)
    fp32.weight_scale = fp32.weight_scale.float()
    assert not BlockQuantizedLinear.has_block_form(fp32, False)  # no fp32-scaled blocks
    assert layout_type(8, False) is None  # 8-bit codes minus zero points span 9 bits
    with pytest.raises(ValueError, match="with zero points over 1024 inputs are not blocks"):
        BlockQuantizedLinear(IN, OUT, False, 8, GROUP, symmetric=False)


def test_act_order_parts_share_one_gather_or_go_alone() -> None:
    """q/k/v of a GPTQ layer share their inputs' order (one Hessian): one stacked call;
    parts in different orders are applied alone (None), to the same values."""
    same = [BlockQuantizedLinear.from_packed(gptq(True, True, seed=0), True, True)]
    g = gptq(True, True, seed=1)
    g.g_idx.copy_(gptq(True, True, seed=0).g_idx)
    same.append(BlockQuantizedLinear.from_packed(g, True, True))
    other = BlockQuantizedLinear.from_packed(gptq(True, True, seed=2), True, True)
    assert all(m is not None for m in same) and other is not None
    first, second = same  # type: ignore[misc]
    x = torch.randn(2, IN)
    stacked = first.stacked_product([second], x)
    if cpu_kernels.available():
        assert stacked is not None
        assert torch.allclose(stacked, torch.cat([first(x), second(x)], -1), atol=1e-5)
    assert first.stacked_product([other], x) is None
    # A streamer's slot takes the next layer in place (the same addresses): its parts'
    # orders differ now, and the stacked call must see it.
    layer = [BlockQuantizedLinear.from_packed(gptq(True, True, seed=s), True, True) for s in (5, 6)]
    for slot, source in zip(same, layer, strict=True):
        assert slot is not None and source is not None
        for name in ("blocks", "input_order"):
            slot._buffers[name].copy_(source._buffers[name])  # type: ignore[union-attr]
    assert first.stacked_product([second], x) is None
    assert torch.equal(first(x), layer[0](x))  # type: ignore[misc]
    plain = BlockQuantizedLinear.from_packed(gptq(True, False), True)
    assert plain is not None and plain.stacked_product([first], x) is None


@pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels here")
@pytest.mark.parametrize(
    "quantization, kind",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "Q4_Z"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}, "Q4_Z"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": True},
            "Q4_0",
        ),
        (FORMATS["compressed-tensors"], "Q4_0B"),  # bf16 scales, as llmcompressor saves them
    ],
    ids=["awq", "gptq-asym", "gptq-act-order", "compressed-tensors-bf16"],
)
def test_a_real_shaped_checkpoint_is_planned_as_its_blocks(quantization: dict, kind: str) -> None:
    """Llama 3.1 8B's shapes: on a CPU the plan counts the layer as its blocks (Q4_Z 19
    bytes a 32-block, Q4_0 18 and an input order), within 15% of the stored layer a GPU
    holds, and says which blocks."""
    config = full_config("llama-3.1-8b")
    spec = parse_quantization({"quantization_config": quantization}, "8b")
    config = replace(config, quantization=spec)
    cpu = footprint(config, torch.float32, "8b", device_type="cpu")
    gpu = footprint(config, torch.float32, "8b", device_type="cuda")
    held = laid_out_for(spec, torch.float32, "cpu")
    assert held is not None and held.blocks
    with torch.device("meta"):
        layer = Transformer(replace(config, quantization=held)).layers[0]
    assert isinstance(layer, nn.Module)
    projections = [m for m in layer.modules() if isinstance(m, PackedLinear)]
    assert projections and all(isinstance(m, BlockQuantizedLinear) for m in projections)
    assert {m.ggml_type.name for m in projections} == {kind}  # type: ignore[union-attr]
    assert cpu.packed_kernels and cpu.layer_bytes == FlatLayout.of(layer).nbytes
    assert gpu.layer_bytes < cpu.layer_bytes < 1.15 * gpu.layer_bytes  # Q4_Z: 76 / 66.5 B
    assert f"as {kind} blocks" in cpu.quantization


@needs_kernels
@pytest.mark.parametrize("name", ["awq", "gptq-act-order"])
def test_a_compiled_pass_computes_the_blocks(name: str) -> None:
    """In a compiled pass (one graph, as modeling/compiled.py traces a model) Q4_Z blocks
    and the act-order gather are the kernels' operator: the eager products' values."""
    make, symmetric, act_order, _ = CASES[name]
    blocks = BlockQuantizedLinear.from_packed(make(), symmetric, act_order)
    assert blocks is not None
    compiled = torch.compile(blocks, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for rows in (1, 3, 12):
            x = torch.randn(rows, IN, generator=gen)
            assert torch.allclose(compiled(x), blocks(x), rtol=1e-5, atol=1e-5)
