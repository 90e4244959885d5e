"""Quantized checkpoints as the tools publish them (../shared/models/quantized, made by
GPT-QModel, AutoAWQ and llmcompressor): each loads packed, dequantizes exactly to the tool's
own weight, matches the tool's reference logits and greedy tokens, streams through both host
tiers unchanged, and speculation on it stays token-identical. Plus what the plan counts for
real-shaped quantized configs, and the refusal of formats specd does not load."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from daemon.footprint import footprint
from daemon.memory_plan import OffloadOptions, plan_request
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.checkpoints.checkpoint import load, open_checkpoint
from modeling.checkpoints.folder_files import CheckpointError
from modeling.config import ModelConfig
from modeling.decoder import Transformer
from modeling.weights import cpu_kernels
from modeling.weights.block_layout import BlockQuantizedLinear
from modeling.weights.packed import (
    AWQ_ORDER,
    AWQLinear,
    CompressedLinear,
    GPTQLinear,
    PackedLinear,
    unpack,
)
from modeling.weights.quant import UnsupportedQuantizationError, parse_quantization
from offload.layout import FlatLayout
from offload.plan import MemoryBudget, module_bytes
from offload.planning import make_plan
from scripts.real_shapes import full_config
from speculative.generation import Generation
from speculative.sampling import SamplingParams

FOLDERS = [
    "gptq-w4-g32",
    "gptq-w4-g32-asym",
    "gptq-w4-g32-descact",
    "gptq-w8-g32",
    "awq-w4-g32",
    "autoawq-w4-g32",
    "compressed-tensors-w4a16-gptq",
    "compressed-tensors-w4a16-asym-rtn",
    "compressed-tensors-w8a16-gptq",
]
PROJECTIONS = [
    *(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
    *(f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
]
KINDS = {"gptq": GPTQLinear, "awq": AWQLinear, "compressed-tensors": CompressedLinear}


@pytest.fixture(scope="module")
def quantized(shared_models: Path) -> Path:
    root = shared_models / "quantized"
    if not root.is_dir():
        pytest.fail(f"{root} is missing: the quantized reference checkpoints are required")
    return root


def expected(folder: Path) -> list[tuple[list[int], torch.Tensor, list[int]]]:
    """(prompt ids, last-position logits, 32 greedy tokens) per prompt, from reference.json:
    the fp32 dequantized model for GPTQ/AWQ (their tools' loaders run in fp16 only), the
    tool's own fp32 loader for compressed-tensors (see the folder README)."""
    ref = json.loads((folder / "reference.json").read_text())
    out = []
    for item in ref["items"]:
        dequant = "last_logits_fp32_dequant" in item
        logits = item["last_logits_fp32_dequant" if dequant else "last_logits"]
        tokens = item["greedy_new_token_ids_fp32_dequant" if dequant else "greedy_new_token_ids"]
        out.append((item["prompt_ids"], torch.tensor(logits), tokens))
    return out


def last_logits(runtime: Runtime, ids: list[int]) -> torch.Tensor:
    cache = runtime.target.new_cache(64)
    return runtime.target(torch.tensor(ids), torch.arange(len(ids)), cache)[-1].float()


def greedy(runtime: Runtime, ids: list[int], strategy: str = "autoregressive") -> list[int]:
    strat = runtime.strategy(strategy)
    gen = Generation(
        strat,
        runtime.new_session(strat),
        runtime.tokenizer,
        ids,
        SamplingParams(temperature=0.0),
        max_tokens=32,
        ignore_eos=True,
    ).run()
    return gen.token_ids


@pytest.mark.parametrize("name", FOLDERS)
def test_loads_packed_and_dequantizes_exactly_as_the_tool(quantized: Path, name: str) -> None:
    folder = quantized / name
    # As stored (the layout a GPU holds; on this CPU a symmetric GPTQ is laid out as ggml
    # blocks: test_symmetric_checkpoints_are_computed_as_blocks_on_a_cpu).
    model, _, ckpt = load(folder, "fp32", computes_on="cuda")
    spec = ckpt.config.quantization
    assert spec is not None
    stored = {"gptq": torch.float16, "awq": torch.float16, "compressed-tensors": torch.float32}
    for layer in model.layers:
        assert isinstance(layer, nn.Module)
        for proj in PROJECTIONS:
            module = layer.get_submodule(proj)
            assert isinstance(module, KINDS[spec.method])
            # Packed only: integer codes and the stored scales, no full-precision weight.
            assert not hasattr(module, "weight")
            assert [p for p in module.parameters()] == []  # no bias in these models
            dtypes = {b.dtype for b in module.buffers()}
            assert dtypes <= {torch.int32, torch.int64, stored[spec.method]}
            assert torch.int32 in dtypes
    ref = torch.load(folder / "down_proj_dequant.pt")
    down = model.layers[0].mlp.down_proj  # type: ignore[index]
    assert isinstance(down, PackedLinear)
    weight = down.dequantize(torch.float32)
    assert weight.shape == (32, 96) == tuple(ref["shape"])
    assert torch.equal(weight, ref["weight"])  # bit for bit
    if "weight_fp16_kernel" in ref:  # what the tool's fp16 module computes
        assert torch.equal(down.dequantize(torch.float16), ref["weight_fp16_kernel"].half())
    # The plain tensors are the checkpoint's (AWQ's rescaled fp16 norms), not the source's.
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert torch.equal(model.layers[0].input_layernorm.weight, norm.float())  # type: ignore[index]


OFFLOAD = {
    "resident": {"offload": "none"},
    "stream-ram": {"offload": "stream", "resident_layers": 0, "slots": 2, "host_tier": "ram"},
    "stream-disk": {"offload": "stream", "resident_layers": 0, "slots": 2, "host_tier": "disk"},
}


@pytest.mark.parametrize("placement", list(OFFLOAD))
@pytest.mark.parametrize("name", FOLDERS)
def test_logits_and_greedy_tokens_match_the_reference(
    quantized: Path, name: str, placement: str
) -> None:
    options = RuntimeOptions(
        model=str(quantized / name), device="cpu", dtype="fp32", context=64,
        **OFFLOAD[placement],  # type: ignore[arg-type]
    )  # fmt: skip
    runtime = Runtime(options)
    if placement != "resident":
        assert runtime.streamer is not None
        assert runtime.plan.host_tier == OFFLOAD[placement]["host_tier"]
        assert runtime.plan.streamed_layers == 2
    for ids, logits, tokens in expected(quantized / name):
        assert (last_logits(runtime, ids) - logits).abs().max().item() <= 1e-4
        assert greedy(runtime, ids) == tokens
    if placement != "resident":
        stats = runtime.offload_stats()
        assert stats["stream_passes"] > 0
        # The layers travel packed: one layer's bytes are its stored tensors (+ alignment).
        layer = runtime.streamer.layout  # type: ignore[union-attr]
        names = {e.name for e in layer.tensors}
        assert "mlp.down_proj.weight" not in names
        # (int32 words as stored; uint8 ggml blocks where this CPU lays a symmetric one out)
        assert any(e.dtype in (torch.int32, torch.uint8) for e in layer.tensors)


@pytest.mark.parametrize("strategy", ["linear", "tree"])
@pytest.mark.parametrize(
    "name", ["gptq-w4-g32-descact", "autoawq-w4-g32", "compressed-tensors-w4a16-asym-rtn"]
)
def test_speculation_on_a_quantized_target_is_its_own_greedy_output(
    quantized: Path, stories_draft: Path, name: str, strategy: str
) -> None:
    """The fp32 source model drafts for its quantized version (same tokenizer): the output
    is the quantized target's, whatever the draft proposes."""
    runtime = Runtime(
        RuntimeOptions(
            model=str(quantized / name), draft=str(stories_draft), device="cpu", dtype="fp32",
            context=128, budget=8, offload="stream", resident_layers=0, slots=2,
        )
    )  # fmt: skip
    for ids, _, tokens in expected(quantized / name):
        assert greedy(runtime, ids, strategy) == tokens


def with_quantization(folder: Path, tmp_path: Path, quantization: dict) -> Path:
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    raw = json.loads((copy / "config.json").read_text())
    raw["quantization_config"] = quantization
    (copy / "config.json").chmod(0o644)
    (copy / "config.json").write_text(json.dumps(raw))
    return copy


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "exl2", "bits": 4.0}, "quant_method 'exl2'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "gguf"}, "quant_method 'gguf'"),
        ({"quant_method": "fp8"}, "quant_method 'fp8'"),
        (
            {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
            "checkpoint_format 'marlin'",
        ),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with 3 bits"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version 'gemv'"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"format": "float-quantized", "targets": ["Linear"]}},
            },
            "format 'float-quantized'",
        ),
    ],
)
def test_unsupported_formats_are_refused_naming_them(
    quantized: Path, tmp_path: Path, quantization: dict, named: str
) -> None:
    folder = with_quantization(quantized / "gptq-w4-g32", tmp_path, quantization)
    with pytest.raises(UnsupportedQuantizationError) as err:
        open_checkpoint(folder)
    message = str(err.value)
    assert named in message and str(folder / "config.json") in message
    for supported in ("gptq", "awq", "compressed-tensors", "pack-quantized"):
        assert supported in message


def test_packed_tensors_keep_their_stored_dtypes_through_to(quantized: Path) -> None:
    model, _, _ = load(quantized / "gptq-w4-g32", "fp32", computes_on="cuda")  # as stored
    down = model.layers[0].mlp.down_proj  # type: ignore[index]
    assert isinstance(down, GPTQLinear)
    scales = down.scales.clone()
    model.to(torch.bfloat16)  # the compute dtype changes; fp16 scales are data, not compute
    assert down.scales.dtype == torch.float16 and torch.equal(down.scales, scales)
    assert down.qweight.dtype == torch.int32
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    x = torch.randn(3, 96).to(torch.bfloat16)
    exact = down.dequantize(torch.float32).to(torch.bfloat16)  # one rounding, from fp32
    assert torch.equal(down.dequantize(torch.bfloat16), exact)
    assert torch.equal(down(x), torch.nn.functional.linear(x, exact))


def test_awq_interleave_puts_even_outputs_in_the_low_nibbles() -> None:
    # One word whose code i holds the value i: output 8c + AWQ_ORDER[i] gets i.
    word = sum(i << (4 * i) for i in range(8))  # 0x76543210
    codes = unpack(torch.tensor([[word]], dtype=torch.int32), 4, 1, order=AWQ_ORDER)
    assert codes.tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    # Top bit set: the stored int32 is negative, the codes are still unsigned nibbles.
    word = sum((15 - i) << (4 * i) for i in range(8)) - (1 << 32)
    codes = unpack(torch.tensor([[word]], dtype=torch.int32), 4, 1)
    assert codes.tolist() == [[15, 14, 13, 12, 11, 10, 9, 8]]


# --- the plan: packed bytes from config.json alone -------------------------------------

GROUP = 128


def quantized_config(shape: str, quantization: dict) -> ModelConfig:
    spec = parse_quantization({"quantization_config": quantization}, shape)
    return replace(full_config(shape), quantization=spec)


FORMATS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm"},
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "format": "pack-quantized",
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "strategy": "group",
                    "group_size": GROUP,
                    "symmetric": True,
                    "scale_dtype": "bfloat16",
                },
            }
        },
    },
}


def true_projection_bytes(method: str, n_in: int, n_out: int) -> int:
    """A 4-bit projection's stored tensors, from the format's shapes (README of the folder)."""
    groups = n_in // GROUP
    if (
        method == "gptq"
    ):  # qweight [in/8, out] i32, qzeros [G, out/8] i32, scales [G, out] f16, g_idx [in] i32
        return n_in // 8 * n_out * 4 + groups * n_out // 8 * 4 + groups * n_out * 2 + n_in * 4
    if method == "awq":  # qweight [in, out/8] i32, qzeros [G, out/8] i32, scales [G, out] f16
        return n_in * n_out // 8 * 4 + groups * n_out // 8 * 4 + groups * n_out * 2
    # weight_packed [out, in/8] i32, weight_scale [out, G] bf16, weight_shape [2] i64
    return n_out * n_in // 8 * 4 + n_out * groups * 2 + 2 * 8


@pytest.mark.parametrize("method", list(FORMATS))
@pytest.mark.parametrize("shape", ["llama-3.1-8b", "llama-3.1-70b"])
def test_plan_counts_packed_bytes_per_layer(shape: str, method: str) -> None:
    config = quantized_config(shape, FORMATS[method])
    plain = footprint(full_config(shape), torch.bfloat16, shape)
    packed = footprint(config, torch.bfloat16, shape)
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    projections = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    true = sum(true_projection_bytes(method, i, o) for i, o in projections) + 2 * d * 2  # + norms
    assert abs(packed.layer_bytes - true) <= 0.01 * true
    # A quarter of bf16 and a little more (scales, zero points), the rest of the model as is.
    assert 0.25 < packed.layer_bytes / plain.layer_bytes < 0.27
    assert packed.resident_bytes == plain.resident_bytes
    # The meta build the plan measures is the one that loads: same layout as a loaded layer.
    with torch.device("meta"):
        layer = Transformer(config).to(torch.bfloat16).layers[0]  # type: ignore[index]
    assert FlatLayout.of(layer).nbytes == packed.layer_bytes


def test_a_4bit_70b_streams_from_ram_on_a_desktop() -> None:
    """24 GB GPU, 64 GB RAM, a 1B draft: the bf16 70B's streamed layers do not fit in RAM
    (disk tier); the 4-bit one's do."""
    draft = footprint(full_config("llama-3.2-1b"), torch.bfloat16, "1B")
    gpu = MemoryBudget("cuda", int(24e9), "configured", int(64e9), "configured", 25e9, "configured")
    tiers = {}
    for label, config in (
        ("bf16", full_config("llama-3.1-70b")),
        ("gptq-4bit", quantized_config("llama-3.1-70b", FORMATS["gptq"])),
    ):
        target = footprint(config, torch.bfloat16, label)
        plan = make_plan(plan_request(target, draft, 8192, OffloadOptions()), gpu)
        assert plan.streamed_layers > 0
        tiers[label] = plan.host_tier
    assert tiers == {"bf16": "disk", "gptq-4bit": "ram"}


def test_a_folder_holding_a_gguf_names_the_file_to_give(quantized: Path, tmp_path: Path) -> None:
    folder = tmp_path / "gguf"
    folder.mkdir()
    shutil.copy(quantized / "gptq-w4-g32" / "config.json", folder / "config.json")
    (folder / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"model-Q4_K_M\.gguf: give --model the \.gguf file"):
        open_checkpoint(folder).weight_files()


def with_biases(folder: Path, tmp_path: Path, value: float) -> Path:
    """The folder with a `<m>.bias` stored for every quantized projection, as AutoGPTQ and
    GPTQ-for-LLaMa export Llama checkpoints (zeros: Llama has no projection bias)."""
    copy = tmp_path / f"{folder.name}-bias"
    shutil.copytree(folder, copy)
    tensors = load_file(str(folder / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(".scales")]:
        out = tensors[key].shape[1]
        tensors[key.removesuffix("scales") + "bias"] = torch.full((out,), value).half()
    (copy / "model.safetensors").chmod(0o644)
    save_file(tensors, str(copy / "model.safetensors"))
    return copy


def test_gptq_exporters_zero_biases_are_accepted(quantized: Path, tmp_path: Path) -> None:
    folder = quantized / "gptq-w4-g32"
    model, _, _ = load(with_biases(folder, tmp_path, 0.0), "fp32")
    reference, _, _ = load(folder, "fp32")
    ids = torch.tensor(expected(folder)[0][0])
    positions = torch.arange(len(ids))
    assert torch.equal(
        model(ids, positions, model.new_cache(16)),
        reference(ids, positions, reference.new_cache(16)),
    )
    with pytest.raises(CheckpointError, match=r"down_proj\.bias \(non-zero"):
        load(with_biases(folder, tmp_path / "nonzero", 0.5), "fp32")


CONVERTED = {  # folder → the block type every projection is laid out as (None: as stored)
    "gptq-w4-g32": "Q4_0",
    "gptq-w8-g32": "Q8_0",
    "gptq-w4-g32-descact": "Q4_0",  # desc_act: inputs sorted by group (down_proj's permuted)
    "gptq-w4-g32-asym": "Q4_Z",  # a zero point per group
    "awq-w4-g32": "Q4_Z",
    "autoawq-w4-g32": "Q4_Z",
    "compressed-tensors-w4a16-asym-rtn": None,  # fp32 scales: no fp16 block form
    "compressed-tensors-w4a16-gptq": None,
}


@pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels here")
@pytest.mark.parametrize("name", list(CONVERTED))
def test_symmetric_checkpoints_are_computed_as_blocks_on_a_cpu(quantized: Path, name: str) -> None:
    """On a CPU with the kernels, a symmetric GPTQ projection (zero points 2^(b-1), groups
    in runs, fp16 scales) is laid out as Q4_0/Q8_0 blocks that rebuild the stored weight bit
    for bit; any other stays as stored. The plan counts the layer as it is loaded."""
    folder = quantized / name
    model = load(folder, "fp32", "cpu")[0]
    stored = load(folder, "fp32", "cpu", computes_on="cuda")[0]
    for layer, reference in zip(model.layers, stored.layers, strict=True):
        assert isinstance(layer, nn.Module) and isinstance(reference, nn.Module)
        kinds = set()
        for proj in PROJECTIONS:
            module, as_stored = layer.get_submodule(proj), reference.get_submodule(proj)
            assert isinstance(module, PackedLinear) and isinstance(as_stored, PackedLinear)
            kinds.add(module.ggml_type.name if isinstance(module, BlockQuantizedLinear) else None)
            assert torch.equal(
                module.dequantize(torch.float32), as_stored.dequantize(torch.float32)
            )
            x = torch.randn(3, module.in_features)  # the kernels' product, every input order
            assert torch.allclose(module(x), as_stored(x), rtol=1e-5, atol=1e-5)
        assert kinds == {CONVERTED[name]}
    spec = open_checkpoint(folder).config.quantization
    assert spec is not None
    gate = stored.layers[0].mlp.gate_proj  # type: ignore[index]
    in_rows = BlockQuantizedLinear.from_packed(  # 96 outputs: 40, 40, 16
        gate, spec.symmetric, spec.act_order, rows=40
    )
    if in_rows is not None:  # (one model's projections rebuild into one shared scratch)
        rebuilt = in_rows.dequantize(torch.float32).clone()
        assert torch.equal(rebuilt, gate.dequantize(torch.float32))
    # Planned at the larger of each projection's two forms (which one loads depends on
    # its values): on this toy GPTQ's per-input group index makes the stored form the
    # larger, AWQ's has none (its blocks are larger).
    config = open_checkpoint(folder).config
    fp = footprint(config, torch.float32, name, device_type="cpu")
    forms = [FlatLayout.of(m.layers[0]).nbytes for m in (model, stored)]  # type: ignore[index]
    assert fp.layer_bytes == max(forms)
    layers = len(model.layers)  # type: ignore[arg-type]
    assert fp.resident_bytes == module_bytes(model) - layers * module_bytes(model.layers[0])  # type: ignore[index]
    rebuilds = [
        m.rebuild_bytes(torch.float32) for m in stored.modules() if isinstance(m, PackedLinear)
    ]
    assert fp.dequant_bytes >= max(rebuilds)  # either form's rebuild is held


@pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels here")
@pytest.mark.parametrize("bits", [4, 8])
def test_a_real_shaped_symmetric_gptq_is_planned_as_blocks_on_a_cpu(bits: int) -> None:
    """At a real width the blocks are the larger form (2 bytes a 32-block against 2 a
    128-group): the plan counts them, computed where they lie; on a GPU, as stored."""
    config = quantized_config("llama-3.1-8b", {**FORMATS["gptq"], "bits": bits})
    cpu = footprint(config, torch.float32, "8b", device_type="cpu")
    gpu = footprint(config, torch.float32, "8b", device_type="cuda")
    with torch.device("meta"):
        blocks = Transformer(
            replace(config, quantization=replace(config.quantization, blocks=True))
        ).layers[0]  # type: ignore[index]
    assert cpu.packed_kernels and not gpu.packed_kernels
    assert cpu.layer_bytes == FlatLayout.of(blocks).nbytes > gpu.layer_bytes
    assert cpu.layer_bytes < 1.1 * gpu.layer_bytes


@pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels here")
def test_a_checkpoint_whose_zero_points_belie_its_config_loads_as_stored(
    quantized: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """sym: true, but one zero point is not 2^(b-1): no projection has a block form it can
    be trusted with, so every layer loads as stored (one layout for a streamer), the same
    weights, and the log names the projection."""
    folder = tmp_path / "lying"
    shutil.copytree(quantized / "gptq-w4-g32", folder)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.qzeros"
    tensors[name] = tensors[name] ^ 1  # one code's lowest bit in every word: zero 8 → 9
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="specd.checkpoint"):
        model = load(folder, "fp32", "cpu")[0]
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(isinstance(m, GPTQLinear) for m in packed)
    assert "layers.1.mlp.up_proj" in caplog.text


def damaged(quantized: Path, tmp_path: Path, source: str, edit: Any) -> Path:
    """A copy of a shared checkpoint with `edit` applied to its tensors."""
    folder = tmp_path / "damaged"
    shutil.copytree(quantized / source, folder)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("value", [99, -1])
def test_a_group_index_past_the_groups_is_refused_naming_it(
    quantized: Path, tmp_path: Path, value: int
) -> None:
    """A damaged (or hostile) GPTQ file whose g_idx names a group it has no scales for (or
    a negative one, which would wrap to the last) is refused at load, naming the tensor, on
    every device's layout and from the disk tier, whose layers are read as they stream."""
    name = "model.layers.1.mlp.down_proj.g_idx"
    folder = damaged(
        quantized, tmp_path, "gptq-w4-g32-descact", lambda t: t[name].__setitem__(5, value)
    )
    for computes_on in ("cpu", "cuda"):
        with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.down_proj\.g_idx"):
            load(folder, "fp32", "cpu", computes_on=computes_on)
    disk = RuntimeOptions(
        model=str(folder), device="cpu", dtype="fp32", context=64, **OFFLOAD["stream-disk"],  # type: ignore[arg-type]
    )  # fmt: skip
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.down_proj\.g_idx"):
        Runtime(disk)


@pytest.mark.parametrize("source, scale", [("gptq-w4-g32", "scales"), ("awq-w4-g32", "scales")])
def test_a_nan_scale_is_refused_naming_it(
    quantized: Path, tmp_path: Path, source: str, scale: str
) -> None:
    """One NaN scale makes every logit NaN (greedy then repeats token 0): refused at load."""
    name = f"model.layers.1.mlp.up_proj.{scale}"
    folder = damaged(
        quantized, tmp_path, source, lambda t: t[name].view(-1).__setitem__(0, math.nan)
    )
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.up_proj\.scales holds NaN"):
        load(folder, "fp32", "cpu")


def test_a_truncated_file_is_named_not_a_traceback(quantized: Path, tmp_path: Path) -> None:
    folder = tmp_path / "cut"
    shutil.copytree(quantized / "gptq-w4-g32", folder)
    data = (folder / "model.safetensors").read_bytes()
    for length in (100, len(data) - 1000):  # inside the header; inside the tensors
        (folder / "model.safetensors").write_bytes(data[:length])
        with pytest.raises(CheckpointError, match=r"model\.safetensors: .*download it again"):
            load(folder, "fp32", "cpu")


def test_a_streamed_slot_sees_each_layers_group_order() -> None:
    """A streamer's slot holds one layer's g_idx after another in the same tensor: whether
    its groups are runs is asked again for each (it was remembered from the first)."""
    m = GPTQLinear(64, 16, False, 4, 32)
    m.qweight.random_(-(1 << 31), (1 << 31) - 1)
    m.qzeros.random_(-(1 << 31), (1 << 31) - 1)
    m.scales.copy_(torch.rand(2, 16).half())
    m.g_idx.copy_(torch.arange(64) // 32)
    first = m.dequantize(torch.float32).clone()
    m.g_idx.copy_(torch.arange(64) % 2)  # the next layer's, in place: groups interleaved
    codes = unpack(m.qweight, 4, 0, torch.float32)  # (in, out)
    zeros = unpack(m.qzeros, 4, 1, torch.float32) + 1
    want = ((codes - zeros[m.g_idx.long()]) * m.scales.float()[m.g_idx.long()]).t()
    assert torch.equal(m.dequantize(torch.float32), want)
    assert not torch.equal(want, first)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"group_size": 0}, "group_size 0 is neither -1"),
        ({"group_size": -32}, "group_size -32 is neither -1"),
        ({"group_size": "abc"}, "group_size is 'abc', not an int"),
        ({"bits": "four"}, "bits is 'four', not an int"),
        ({"sym": "false"}, "sym is 'false', not a bool"),
        ({"desc_act": 1}, "desc_act is 1, not a bool"),
        ({"quant_method": ["gptq"]}, "quant_method is \\['gptq'\\], not a str"),
    ],
)
def test_hostile_quantization_configs_are_refused_naming_the_key(
    change: dict, message: str
) -> None:
    raw = {"quantization_config": {**FORMATS["gptq"], **change}}
    with pytest.raises(UnsupportedQuantizationError, match=message):
        parse_quantization(raw, "config.json")
    ct = json.loads(json.dumps(FORMATS["compressed-tensors"]))
    ct["config_groups"]["group_0"]["weights"].pop("group_size")
    with pytest.raises(UnsupportedQuantizationError, match="needs group_size"):
        parse_quantization({"quantization_config": ct}, "config.json")
    for bad in ("gptq", {**ct, "config_groups": [1]}, {**ct, "ignore": 5}):
        with pytest.raises(UnsupportedQuantizationError, match=r"config\.json: "):
            parse_quantization({"quantization_config": bad}, "config.json")
