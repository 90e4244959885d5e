"""Loading the target where its memory plan says: planned first (so a model that cannot fit
fails before anything is loaded), then loaded to the device, or loaded to the CPU and
placed: resident layers on the device, the rest handed to offload's streamer, read from RAM
or from the checkpoint's files (the disk tier)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from daemon.memory_plan import (
    OffloadRequest,
    choose_plan,
    offload_request,
    plan_dtype,
    planned_tree_budget,
)
from offload.layout import FlatLayout
from offload.machine import detect_budget
from offload.placement import build_streamer
from offload.plan import Budget, MemoryPlan
from offload.planning import PlanError
from offload.storage import TensorSources, tensor_files
from offload.stream import LayerStreamer
from speculative.checkpoint import Checkpoint, CheckpointError, load, open_checkpoint
from speculative.config import ModelConfig
from speculative.model import Transformer
from speculative.projections import stored_names
from speculative.tokenizer import Tokenizer

if TYPE_CHECKING:  # daemon.runtime imports this module
    from daemon.runtime import RuntimeOptions


def disk_sources(
    checkpoint: Checkpoint, layers: list[int], layer_names: list[str]
) -> TensorSources:
    """For the disk tier: which file and key hold each streamed layer's tensors."""
    where = tensor_files(checkpoint.weight_files())
    sources: dict[int, dict] = {}
    for i in layers:
        # A stacked projection (qkv_proj, gate_up_proj) is read from its stored parts.
        keys = {
            name: [f"model.layers.{i}.{part}" for part in stored_names(name)]
            for name in layer_names
        }
        missing = [k for parts in keys.values() for k in parts if k not in where]
        if missing:
            raise CheckpointError(f"{checkpoint.path}: disk tier cannot find {missing[:3]}")
        sources[i] = {name: [(where[k], k) for k in parts] for name, parts in keys.items()}
    return sources


def place_target(
    model: Transformer, checkpoint: Checkpoint, plan: MemoryPlan, device: torch.device
) -> LayerStreamer:
    """`model` is loaded on the CPU; afterwards its non-layer parts and resident layers are
    on `device` and its layer list is a streamer over the rest."""
    if not isinstance(model.layers, nn.ModuleList):
        raise ValueError(
            "the target's layers are already a streamer: place a freshly loaded model only once"
        )
    layers = list(model.layers)
    resident = list(range(plan.resident_layers))
    streamed = list(range(plan.resident_layers, len(layers)))
    sources = None
    if plan.host_tier == "disk":
        # Every tensor the streamer moves, packed projections' buffers included.
        names = [entry.name for entry in FlatLayout.of(layers[0]).tensors]
        sources = disk_sources(checkpoint, streamed, names)
    streamer = build_streamer(
        layers, resident, device, plan.slots, plan.host_tier or "ram", sources
    )
    model.set_layers(streamer)
    model.to(device)  # embeddings, norm, head, RoPE table; the streamer is not a module
    return streamer


def _is_streamed_layer(name: str, first_streamed: int) -> bool:
    """'layers.7.mlp.up_proj.weight' is streamed when 7 >= first_streamed."""
    parts = name.split(".")
    return parts[0] == "layers" and int(parts[1]) >= first_streamed


def load_target(
    model_ref: str,
    dtype: str,
    device: torch.device,
    context: int | str,
    draft_config: ModelConfig | None,
    options: OffloadRequest,
    budget: Budget,
    tree_budget: int | str = "auto",
    quantize: str | None = None,
) -> tuple[Transformer, Tokenizer, Checkpoint, MemoryPlan, LayerStreamer | None]:
    """Plan before loading (choosing `auto` dtype and context); then load to the device, or
    to the CPU and place it."""
    ckpt = open_checkpoint(model_ref, quantize)
    plan = choose_plan(
        ckpt.config, draft_config, str(ckpt.path), dtype, context, device.type, options, budget,
        tree_budget,
    )  # fmt: skip
    dtype = plan_dtype(plan)
    if not plan.streamed_layers:
        model, tokenizer, ckpt = load(ckpt, dtype, device)
        if plan.dequantized_resident:
            model.dequantize_layers()
        return model, tokenizer, ckpt, plan, None
    if quantize is not None and plan.host_tier == "disk":
        raise PlanError(
            f"--quantize {quantize} keeps the quantized layers in RAM, but they do not fit "
            f"there ({plan.host_tier_reason}): give more --ram-budget, or use a pre-quantized "
            "GPTQ, AWQ or compressed-tensors checkpoint, whose packed layers stream from disk"
        )
    skip = None
    if plan.host_tier == "disk":
        # Streamed layers are read from the files at every pass: never load them into RAM.
        skip = partial(_is_streamed_layer, first_streamed=plan.resident_layers)
    model, tokenizer, ckpt = load(ckpt, dtype, "cpu", skip=skip)
    return model, tokenizer, ckpt, plan, place_target(model, ckpt, plan, device)


def load_placed_target(
    options: RuntimeOptions, device: torch.device, draft: Checkpoint | None
) -> tuple[Transformer, Tokenizer, Checkpoint, MemoryPlan, LayerStreamer | None]:
    """The Runtime's target, planned first (so a model that cannot fit fails before anything
    is loaded, and `auto` dtype and context are settled), then loaded and placed. `draft`:
    the draft model's checkpoint, opened (its config is planned for), or None."""
    draft_config = draft.config if draft is not None else None
    budget = detect_budget(
        device, options.gpu_budget, options.ram_budget, options.bandwidth, measure=False
    )
    return load_target(
        options.model, options.dtype, device, options.context, draft_config,
        offload_request(options), budget, planned_tree_budget(options), options.quantize,
    )  # fmt: skip
