"""Loading the target where its memory plan says: planned first (so a model that cannot fit
fails before anything is loaded), then loaded to the device, or loaded to the CPU and
placed: resident layers on the device, the rest handed to offload's streamer, read from RAM
or from the checkpoint's files (the disk tier)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import torch
from torch import nn

from daemon.memory_plan import plan_dtype
from daemon.options import RuntimeOptions
from daemon.pair_plan import DraftPlan, plan_pair, substitute_needs_ram
from daemon.substitute_cache import SubstituteCache
from modeling.checkpoints.checkpoint import DTYPES, Checkpoint, load, open_checkpoint
from modeling.checkpoints.folder_files import CheckpointError
from modeling.checkpoints.gguf_disk import gguf_disk_sources
from modeling.checkpoints.gguf_model import is_gguf, open_gguf
from modeling.config import ModelConfig
from modeling.decoder import Transformer
from modeling.layers.moe import SparseMoE
from modeling.models import architecture
from modeling.substitute import (
    LayerMaker,
    build_substitute,
    routed_copies_layer,
    share_placed,
    shares_packed,
    substitute_config,
)
from modeling.text.tokenizer import Tokenizer
from modeling.weights.projections import stored_names
from offload.experts import ExpertCache, HostExperts
from offload.layout import FlatLayout
from offload.machine import detect_budget
from offload.placement import build_streamer
from offload.plan import MemoryPlan
from offload.planning import PlanError
from offload.storage import TensorSources, tensor_files
from offload.stream import LayerStreamer

log = logging.getLogger("specd.loading")


def disk_sources(
    checkpoint: Checkpoint, layers: list[int], layer_names: list[str], dtype: str
) -> TensorSources:
    """For the disk tier: which file and key hold each streamed layer's tensors (a GGUF
    file's: readers that convert its rows to `dtype` as loading does)."""
    if checkpoint.gguf is not None or is_gguf(checkpoint.path):
        contents = checkpoint.gguf or open_gguf(checkpoint.path)
        config = checkpoint.config
        return gguf_disk_sources(contents, config, DTYPES[dtype], layers, layer_names)
    where = tensor_files(checkpoint.weight_files())
    # Our names → the checkpoint's, by its architecture's name map (`hf_name`).
    arch = architecture(checkpoint.config)
    stored = {ours: key for key in where if (ours := arch.hf_name(key)) is not None}
    sources: dict[int, dict] = {}
    for i in layers:
        # A stacked projection (qkv_proj, gate_up_proj) is read from its stored parts,
        # unless the checkpoint stores it whole (Phi-3).
        keys = {
            name: [
                stored.get(f"layers.{i}.{part}", f"layers.{i}.{part}")
                for part in ([name] if f"layers.{i}.{name}" in stored else stored_names(name))
            ]
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
        sources = disk_sources(checkpoint, streamed, names, plan_dtype(plan))
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
    ckpt: Checkpoint,
    plan: MemoryPlan,
    device: torch.device,
    quantize: str | None = None,
    before_placing: Callable[[Transformer, MemoryPlan], None] | None = None,
) -> tuple[Transformer, Tokenizer, Checkpoint, LayerStreamer | None]:
    """Load the target as `plan` says: to the device, or to the CPU and place it.
    `before_placing(model, plan)` runs once every layer the plan keeps in RAM is loaded,
    before any moves (where the substitute draft is built from them)."""
    dtype = plan_dtype(plan)
    if plan.expert_mode != "device":  # loaded in RAM, then all but the experts placed
        model, tokenizer, ckpt = load(ckpt, dtype, "cpu", computes_on=device)
        if before_placing is not None:
            before_placing(model, plan)
        place_experts(model, plan, device)
        return model, tokenizer, ckpt, None
    if not plan.streamed_layers:
        model, tokenizer, ckpt = load(ckpt, dtype, device)
        if plan.dequantized_resident:
            model.dequantize_layers()
        if before_placing is not None:
            before_placing(model, plan)
        return model, tokenizer, ckpt, None
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
    model, tokenizer, ckpt = load(ckpt, dtype, "cpu", skip=skip, computes_on=device)
    if before_placing is not None:
        before_placing(model, plan)
    return model, tokenizer, ckpt, place_target(model, ckpt, plan, device)


def place_experts(model: Transformer, plan: MemoryPlan, device: torch.device) -> None:
    """Every routed expert of `model` (loaded in RAM) handed to its source as `plan` says
    (offload/experts.py: host copies and a device cache of `plan.expert_slots`, or host RAM
    where they compute on the CPU), or kept with its layer where the plan keeps that
    layer's experts on the device; then the rest of the model moved to `device`."""
    blocks = [cast(SparseMoE, layer.mlp) for layer in cast(nn.ModuleList, model.layers)]
    modes = plan.expert_layer_modes()
    experts: list[list[nn.Module]] = []
    for block, mode in zip(blocks, modes, strict=True):
        if mode == "device":
            experts.append([])  # with its layer: moved to the device below
            continue
        experts.append(list(block.experts))
        block.experts = nn.ModuleList()  # the source holds them now; .to(device) skips them
    source: ExpertCache | HostExperts
    if plan.expert_mode == "stream":
        source = ExpertCache(experts, device, plan.expert_slots, pin=device.type == "cuda")
    else:
        source = HostExperts(experts)
    del experts
    model.to(device)
    for index, (block, mode) in enumerate(zip(blocks, modes, strict=True)):
        if mode != "device":
            block.source, block.layer = source, index


def expert_source(model: Transformer) -> ExpertCache | HostExperts | None:
    """The source `place_experts` gave `model`'s experts, or None (with their layers)."""
    layers = model.layers
    for layer in layers if isinstance(layers, nn.ModuleList) else ():
        source = getattr(getattr(layer, "mlp", None), "source", None)
        if isinstance(source, (ExpertCache, HostExperts)):
            return source
    return None


@dataclass
class PlacedTarget:
    """The Runtime's target as loaded and placed, its plan, and what it drafts with when
    that is built from the target itself (the substitute)."""

    model: Transformer
    tokenizer: Tokenizer
    checkpoint: Checkpoint
    plan: MemoryPlan
    streamer: LayerStreamer | None
    draft: DraftPlan
    substitute: Transformer | None = None


def load_placed_target(
    options: RuntimeOptions, device: torch.device, draft: Checkpoint | None
) -> PlacedTarget:
    """The Runtime's target, planned first (so a model that cannot fit fails before anything
    is loaded, and `auto` dtype, context and substitute bits are settled), then loaded and
    placed. `draft`: the draft model's checkpoint, opened (its config is planned for), or
    None; with `--draft substitute` the substitute is built from the target's layers."""
    # (its template and tensors are checked as they load: not a second time here)
    ckpt = open_checkpoint(options.model, options.quantize, verify=False)
    # `--experts auto` weighs the bus against the CPU for a mixture on a GPU: measured then
    # (a fraction of a second), where they are not given.
    routed = ckpt.config.moe is not None and options.experts == "auto"
    budget = detect_budget(
        device, options.gpu_budget, options.ram_budget, options.bandwidth,
        measure=routed and device.type == "cuda", cpu_rate=options.cpu_rate,
    )  # fmt: skip
    draft_config = draft.config if draft is not None else None
    plan, drafting = plan_pair(options, ckpt, draft_config, budget, device.type, str(ckpt.path))
    built: list[Transformer] = []

    def build_substitute_draft(model: Transformer, plan: MemoryPlan) -> None:
        assert drafting.substitute_bits is not None
        cache = Path(options.substitute_cache) if options.substitute_cache else None
        built.append(
            substitute_from(
                model, ckpt, plan, drafting.substitute_bits, device, cache, options.on_progress
            )
        )

    hook = build_substitute_draft if drafting.substitute else None
    model, tokenizer, ckpt, streamer = load_target(ckpt, plan, device, options.quantize, hook)
    for substitute in built:
        share_placed(substitute, model)
    return PlacedTarget(model, tokenizer, ckpt, plan, streamer, drafting, *built)


def _routed_copies(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, index: int, dense: nn.Module
) -> nn.Module:
    return routed_copies_layer(config, index, dense, device, dtype)


def substitute_from(
    model: Transformer,
    checkpoint: Checkpoint,
    plan: MemoryPlan,
    bits: int,
    device: torch.device,
    cache: Path | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> Transformer:
    """The substitute for a target loaded as `plan` says, before placement: its streamed
    layers quantized from their copies in RAM, one at a time, onto `device` (or read from
    the file `cache` keeps of an earlier build: daemon/substitute_cache.py); its resident
    layers shared. The disk tier keeps streamed layers out of RAM: refused, saying why."""
    substitute_needs_ram(plan)
    layers = list(cast(nn.ModuleList, model.layers))
    # A mixture whose routed experts live in RAM: every layer is resident but its experts,
    # so every layer gets low-bit copies of its experts (and shares the rest).
    routed = plan.expert_mode != "device"
    first_streamed = 0 if routed else plan.resident_layers if plan.streamed_layers else len(layers)
    quantized = list(range(first_streamed, len(layers)))
    stored = None
    # Shared packed layers are copied as stored: nothing to quantize, nothing to keep.
    if cache is not None and quantized and not shares_packed(model.config, bits):
        stored = SubstituteCache(
            cache, checkpoint, substitute_config(model.config, bits), bits, model.dtype,
            device, quantized, routed_only=routed,
        )  # fmt: skip
    make: LayerMaker | None = stored
    if make is None and routed:
        config = substitute_config(model.config, bits)
        make = partial(_routed_copies, config, device, model.dtype)
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        note = f"building the {bits}-bit substitute draft: {done} of {total} layers"
        log.info(note)
        if on_progress is not None:
            on_progress(note)

    substitute = build_substitute(
        model, bits, layers, lambda i: i >= first_streamed, device, progress, make=make
    )
    how = "read from " + str(stored.path) if stored is not None and stored.hit else "built"
    kind = "packed layers copied as stored" if shares_packed(model.config, bits) else "HQQ"
    what = "the routed experts of %d layers" if routed else "%d streamed layers"
    log.info(
        "substitute draft: %d-bit %s of " + what + ", %s in %.1f s",
        bits, kind, len(quantized), how, time.perf_counter() - started,
    )  # fmt: skip
    if stored is not None:
        stored.save()
    return substitute
