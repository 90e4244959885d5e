"""Where the target's weights live: the bridge between `speculative` (which knows the model)
and `offload` (which knows memory). Footprints come from meta-device models built from
config.json alone, so a plan needs no weights; placing a loaded target hands its layers to
the streamer."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol, cast

import torch
from torch import nn

from offload.machine import detect_budget
from offload.placement import build_streamer
from offload.plan import (
    Budget,
    MemoryPlan,
    ModelFootprint,
    PlanRequest,
    make_plan,
    module_bytes,
)
from offload.storage import TensorSources, tensor_files
from offload.stream import LayerStreamer
from speculative.checkpoint import DTYPES, Checkpoint, load, open_checkpoint
from speculative.config import ModelConfig
from speculative.generation import PREFILL_CHUNK
from speculative.kv_cache import KVCache
from speculative.model import Transformer
from speculative.tokenizer import Tokenizer

# Bytes per (new token, visible slot) pair: the boolean mask and the additive bias fused
# attention kernels build from it. Per-head scores are not materialised by those kernels.
ATTENTION_BYTES_PER_PAIR = 1 + 4


def footprint(config: ModelConfig, dtype: torch.dtype, name: str) -> ModelFootprint:
    """Sizes of one model in `dtype`, from a meta-device instance (no memory, no weights)."""
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
    # A freshly built Transformer holds its own blocks: a ModuleList, never a streamer.
    layer = module_bytes(cast(nn.ModuleList, model.layers)[0])
    total = module_bytes(model)
    item = torch.empty((), dtype=dtype).element_size()
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    # One token's live tensors in a layer: residual, norm output and attention output (d
    # each), q/k/v and the attention result (q + 2kv + q), the MLP's gate/up/product (3f);
    # plus its logits in the model dtype and in fp32.
    per_token = item * (3 * d + 2 * q + 2 * kv + 3 * f) + config.vocab_size * (item + 4)
    return ModelFootprint(
        name=name,
        dtype=str(dtype).removeprefix("torch."),
        resident_bytes=total - config.num_layers * layer,
        layer_bytes=layer,
        num_layers=config.num_layers,
        kv_bytes_per_token=KVCache.bytes_for(config, 1, dtype),
        activation_bytes_per_token=per_token,
        attention_bytes_per_pair=ATTENTION_BYTES_PER_PAIR,
    )


@dataclass(frozen=True)
class OffloadRequest:
    """The offload options of a run (RuntimeOptions / CLI flags / config keys)."""

    offload: str = "auto"
    resident_layers: int | str = "auto"
    slots: int = 2
    host_tier: str = "auto"
    sequences: int = 1  # KV caches that may coexist (see PlanRequest)


def plan_request(
    target: ModelFootprint,
    draft: ModelFootprint | None,
    context: int,
    options: OffloadRequest,
    tree_budget: int | str = "auto",
    prefix_cache_bytes: int = 0,
) -> PlanRequest:
    # The largest pass is a prefill chunk, or a tree when the budget asks for more nodes.
    largest = (
        PREFILL_CHUNK if not isinstance(tree_budget, int) else max(PREFILL_CHUNK, tree_budget + 1)
    )
    resident = options.resident_layers
    return PlanRequest(
        target=target,
        draft=draft,
        context=context,
        pass_tokens=min(largest, context),
        offload=options.offload,
        resident_layers=None if resident == "auto" else int(resident),
        slots=options.slots,
        host_tier=options.host_tier,
        sequences=options.sequences,
        prefix_cache_bytes=prefix_cache_bytes,
    )


def disk_sources(
    checkpoint: Checkpoint, layers: list[int], layer_names: list[str]
) -> TensorSources:
    """For the disk tier: which file and key hold each streamed layer's tensors."""
    where = tensor_files(checkpoint.weight_files())
    sources: dict[int, dict] = {}
    for i in layers:
        keys = {name: f"model.layers.{i}.{name}" for name in layer_names}
        missing = [k for k in keys.values() if k not in where]
        if missing:
            raise ValueError(f"{checkpoint.path}: disk tier cannot find {missing[:3]}")
        sources[i] = {name: (where[key], key) for name, key in keys.items()}
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
        names = [name for name, _ in layers[0].named_parameters()]
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
    context: int | None,
    draft_config: ModelConfig | None,
    options: OffloadRequest,
    budget: Budget,
    tree_budget: int | str = "auto",
    prefix_cache_bytes: int = 0,
) -> tuple[Transformer, Tokenizer, Checkpoint, MemoryPlan, LayerStreamer | None]:
    """Plan before loading; then load to the device, or to the CPU and place it."""
    ckpt = open_checkpoint(model_ref)
    torch_dtype = DTYPES[dtype]
    target_fp = footprint(ckpt.config, torch_dtype, str(ckpt.path))
    draft_fp = footprint(draft_config, torch_dtype, "draft") if draft_config else None
    ctx = min(context or ckpt.config.max_context, ckpt.config.max_context)
    request = plan_request(target_fp, draft_fp, ctx, options, tree_budget, prefix_cache_bytes)
    plan = make_plan(request, budget)
    if not plan.streamed_layers:
        model, tokenizer, ckpt = load(model_ref, dtype, device)
        return model, tokenizer, ckpt, plan, None
    skip = None
    if plan.host_tier == "disk":
        # Streamed layers are read from the files at every pass: never load them into RAM.
        skip = partial(_is_streamed_layer, first_streamed=plan.resident_layers)
    model, tokenizer, ckpt = load(model_ref, dtype, "cpu", skip=skip)
    return model, tokenizer, ckpt, plan, place_target(model, ckpt, plan, device)


class OffloadOptions(Protocol):
    """The fields of RuntimeOptions that placement reads."""

    model: str
    draft: str | None
    dtype: str
    context: int | None
    budget: int | str
    offload: str
    resident_layers: int | str
    slots: int
    gpu_budget: str
    host_tier: str
    ram_budget: str
    bandwidth: str | None
    sequences: int
    prefix_cache: int


def load_placed_target(
    options: OffloadOptions, device: torch.device, draft_is_model: bool
) -> tuple[Transformer, Tokenizer, Checkpoint, MemoryPlan | None, LayerStreamer | None]:
    """The Runtime's target: loaded straight to the device with --offload none, otherwise
    planned first (so a model that cannot fit fails before anything is loaded)."""
    if options.offload == "none":
        model, tokenizer, ckpt = load(options.model, options.dtype, device)
        return model, tokenizer, ckpt, None, None
    draft_config = (
        open_checkpoint(options.draft).config if draft_is_model and options.draft else None
    )
    budget = detect_budget(
        device, options.gpu_budget, options.ram_budget, options.bandwidth, measure=False
    )
    request = OffloadRequest(
        options.offload, options.resident_layers, options.slots, options.host_tier,
        options.sequences,
    )  # fmt: skip
    return load_target(
        options.model, options.dtype, device, options.context, draft_config, request, budget,
        options.budget, options.prefix_cache,
    )  # fmt: skip
