"""What one model takes in memory, measured before any weight exists: `footprint` builds it on
the meta device from its config and sizes what is outside the layers, one layer as the
streamer lays it out, its KV cache per token, and the rebuild room of packed projections;
`activation_footprint` follows the model code's temporaries per token, per attention key
and per logit row. daemon/memory_plan.py plans with these sizes."""

from __future__ import annotations

from dataclasses import replace
from math import prod
from typing import cast

import torch
from torch import nn

from modeling.checkpoints.gguf_model import keeps_head_packed, pack_head
from modeling.config import ModelConfig
from modeling.decoder import Transformer
from modeling.kv_cache import WINDOW_ROOM
from modeling.layers.attention import ATTENTION_CHUNK_BYTES, attention_row_bytes
from modeling.layers.norms import norm_bytes
from modeling.models import (
    architecture,
    kv_bytes_per_token,
    layer_activations,
    window_kv_bytes_per_token,
)
from modeling.weights import cpu_kernels
from modeling.weights.gguf_blocks import FLOAT_TYPES, row_bytes
from modeling.weights.gguf_modules import GGUFLinear
from modeling.weights.packed import PackedLinear
from modeling.weights.quant import EMBEDDING, laid_out_for
from offload.activations import ActivationFootprint
from offload.layout import FlatLayout
from offload.machine import gemm_copies_output
from offload.plan import ModelFootprint, module_bytes
from offload.storage import CAST_CHUNK_BYTES
from speculative.sampling import DRAW_BYTES_PER_ENTRY


def footprint(
    config: ModelConfig,
    dtype: torch.dtype,
    name: str,
    vocab_width: int | None = None,
    device_type: str = "cuda",
) -> ModelFootprint:
    """Sizes of one model in `dtype`, from a meta-device instance (no memory, no weights).
    `vocab_width`: the width its logits are given (a draft speaks its target's, see
    `Transformer.set_vocab_width`); None: its own vocabulary. `device_type`: where it
    computes (a CPU's matrix products may hold more, `gemm_copies_output`; `--quantize`'s
    layout follows it, as loading lays it out: `laid_out_for`)."""
    spec = laid_out_for(config.quantization, dtype, device_type)
    config = replace(config, quantization=spec)
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
    if config.quantization is not None and keeps_head_packed(config, dtype, device_type):
        # The output matrix stays its blocks, as loading keeps it (the CPU kernels).
        kind = config.quantization.head_type
        rows = torch.empty(
            config.vocab_size, row_bytes(kind, config.hidden_size), dtype=torch.uint8,
            device="meta",
        )  # fmt: skip
        pack_head(model, rows, kind, config)
    # A freshly built Transformer holds its own blocks: a ModuleList, never a streamer.
    block = cast(nn.ModuleList, model.layers)[0]
    outside_layers = module_bytes(model) - config.num_layers * module_bytes(block)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    stored_forms: list[PackedLinear] = []
    if spec is not None and spec.blocks and not spec.on_load:
        stored = replace(config, quantization=replace(spec, blocks=False))
        stored_forms = _larger_of_each_projection(block, stored)
    # A layer's bytes as the streamer lays them out (slots, host arenas): the parameters
    # with each tensor's alignment padding, so the plan's figures are what gets allocated.
    layer = FlatLayout.of(block).nbytes
    dense_layer = 0
    if config.quantization is not None:
        with torch.device("meta"):
            dense = Transformer(replace(config, quantization=None)).to(dtype)
        dense_layer = FlatLayout.of(cast(nn.ModuleList, dense.layers)[0]).nbytes
    ring, window = window_kv_bytes_per_token(config, dtype)
    expert_bytes = 0
    if config.moe is not None:  # one routed expert as the expert cache lays one out
        expert_bytes = FlatLayout.of(block.get_submodule("mlp.experts.0")).nbytes
    # A layer read from the disk tier: what converting one tensor holds besides the staging
    # buffer (a GGUF's; a safetensors file's, at most a cast's piece).
    scratch = (
        disk_scratch_bytes(config, block, dtype) if config.gguf else min(CAST_CHUNK_BYTES, layer)
    )
    return ModelFootprint(
        name=name,
        disk_scratch_bytes=scratch,
        dtype=str(dtype).removeprefix("torch."),
        resident_bytes=outside_layers,
        layer_bytes=layer,
        num_layers=config.num_layers,
        kv_bytes_per_token=kv_bytes_per_token(config, dtype),
        window_kv_bytes_per_slot=ring,
        window=window,
        window_room=WINDOW_ROOM,
        activations=activation_footprint(
            config, dtype, vocab_width, gemm_copies_output(dtype, device_type)
        ),
        quantization=config.quantization.label if config.quantization is not None else "",
        dense_layer_bytes=dense_layer,
        dequant_bytes=max((m.rebuild_bytes(dtype) for m in packed + stored_forms), default=0),
        traced_dequant_bytes=max(
            (m.rebuild_bytes(dtype) for m in packed if m.traceable), default=0
        ),
        packed_kernels=packed_kernels(config, dtype, device_type, packed),
        expert_bytes=expert_bytes,
        experts=config.moe.experts if config.moe is not None else 0,
        experts_per_token=config.moe.top_k if config.moe is not None else 0,
    )


def _larger_of_each_projection(block: nn.Module, stored: ModelConfig) -> list[PackedLinear]:
    """A checkpoint to be laid out as blocks on this CPU loads as stored where its values
    turn out to have no exact block form (`packed_layers.to_blocks`), so each
    projection of `block` (layer 0, which the layer's bytes are measured on) is planned at
    the larger of its two forms (blocks are larger at real widths; GPTQ's per-input group
    index makes the stored form larger on a toy). Returns the stored forms, whose rebuild
    the plan also holds."""
    with torch.device("meta"):
        other = cast(nn.ModuleList, Transformer(stored).layers)[0]
    forms = []
    for name, module in list(block.named_modules()):
        if isinstance(module, PackedLinear):
            alternative = other.get_submodule(name)
            assert isinstance(alternative, PackedLinear)
            forms.append(alternative)
            if module_bytes(alternative) > module_bytes(module):
                parent, _, attr = name.rpartition(".")
                setattr(block.get_submodule(parent), attr, alternative)
    return forms


def packed_kernels(
    config: ModelConfig, dtype: torch.dtype, device_type: str, packed: list[PackedLinear]
) -> bool:
    """Whether every packed projection of `config` (`packed`, its model's) computes from
    its blocks on `device_type` in `dtype` (modeling/weights/cpu_kernels.py: GGUF types and
    `--quantize`'s blocks, fp32, a CPU whose kernels are built here)."""
    spec = config.quantization
    if device_type != "cpu" or dtype != torch.float32 or spec is None:
        return False
    if spec.blocks:  # (a projection too narrow for 32-blocks stays packed: rebuilt)
        return all(m.computed_in_place(dtype, torch.device(device_type)) for m in packed)
    if spec.method != "gguf":
        return False
    kinds = {kind for name, kind in spec.tensor_types if name != EMBEDDING}
    return all(kind in FLOAT_TYPES or cpu_kernels.supports(kind) for kind in kinds)


def disk_scratch_bytes(cfg: ModelConfig, layer: nn.Module, dtype: torch.dtype) -> int:
    """A GGUF layer's most that one tensor's read holds besides the staging buffer, on
    the disk tier (modeling/checkpoints/gguf_disk.py `GGUFTensorReader`),
    from a layer's shapes alone (the meta device): blocks whose rows the architecture
    reorders (Llama's q and k), their bytes and the reordered copy; a float tensor, at
    most its stored bytes (F32 at worst), a reordered copy, fp32 values and an offset taken
    off them, and the result in `dtype`. Blocks in order, in place or in a room, hold
    nothing; a float tensor in order with no offset, at most its stored bytes and result."""
    arch = architecture(cfg)
    most = 0
    for entry in FlatLayout.of(layer).tensors:
        name = f"layers.0.{entry.name}"
        if name.endswith(".blocks"):
            owner = cast(GGUFLinear, layer.get_submodule(entry.name.removesuffix(".blocks")))
            shape: tuple[int, ...] = (owner.in_features, owner.out_features)
            probe = torch.empty(entry.shape, dtype=torch.uint8, device="meta")
            weight = name.removesuffix(".blocks") + ".weight"
            if arch.gguf_tensor(cfg, weight, probe, shape) is not probe:
                most = max(most, 2 * entry.nbytes)
            continue
        numel = prod(entry.shape)
        rows = entry.shape[0] if len(entry.shape) > 1 else 1
        probe = torch.empty(rows, 4 * numel // rows, dtype=torch.uint8, device="meta")
        shape = tuple(reversed(entry.shape))  # (as the file lists it)
        in_order = arch.gguf_tensor(cfg, name, probe, shape) is probe
        plain = in_order and not arch.gguf_offset(cfg, name)
        per_value = 4 + dtype.itemsize if plain else 4 + 4 + 4 + 4 + dtype.itemsize
        most = max(most, numel * per_value)
    return most


def activation_footprint(
    config: ModelConfig,
    dtype: torch.dtype,
    vocab_width: int | None = None,
    gemm_output_copy: bool = False,
) -> ActivationFootprint:
    """What a pass of modeling.decoder allocates, traced through its code (a layer's, by its
    architecture module: `Architecture.layer_activations`). Per token, in bytes.
    `gemm_output_copy`: each matrix product holds an fp32 copy of its output while it runs
    (offload.machine.gemm_copies_output: bf16 on a CPU without bf16 instructions)."""
    item = torch.empty((), dtype=dtype).element_size()
    d, hd, q = config.hidden_size, config.head_dim, config.num_heads * config.head_dim
    # Logits (Transformer._to_vocab_width): the head's rows, then fp32 at the given width: a
    # copy unless the model is fp32 and not widened (a wider result is always a new tensor).
    rows = config.vocab_size
    width = vocab_width or rows
    fp32_logits = 4 * width if width > rows or item != 4 else 0
    copy = 4 if gemm_output_copy else 0  # a product's own fp32 output buffer, per column

    layer = layer_activations(config, item, copy)
    windows = {kv.window for kv in architecture(config).kv_layout(config) if kv.window is not None}
    return ActivationFootprint(
        # RoPE cos and sin, of each table (Gemma 3's sliding layers have their own)
        persistent_bytes_per_token=2 * hd * item * (2 if config.local_rope is not None else 1),
        layer_bytes_per_token=layer.layer,
        attention_bytes_per_token=layer.attention,
        # torch.bool: the pass's mask, and one more per distinct sliding window
        # (SequenceSlots.mask_for keeps each window's mask for the whole pass)
        mask_bytes_per_pair=1 + len(windows),
        score_bytes_per_key=attention_row_bytes(config.num_heads, 1),
        score_bytes_per_query=2 * item * q,  # a chunk's copy of its queries and its output
        chunk_bytes=ATTENTION_CHUNK_BYTES,
        hidden_bytes_per_token=item * d,
        # The head's output in the model dtype and its fp32 logits, after the final norm.
        logit_bytes_per_row=max(
            norm_bytes(d, item), item * d + item * rows + max(fp32_logits, copy * rows)
        ),
        fp32_row_bytes=4 * width,
        draw_bytes_per_row=DRAW_BYTES_PER_ENTRY * width,
    )
