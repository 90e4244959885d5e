"""The architecture registry: config.json's `model_type` and a GGUF file's
`general.architecture` → the architecture module that runs it (modeling/architecture.py
says what a module provides). A new architecture is its module and one line in
`ARCHITECTURES`.

The functions below are what the rest of the runtime and the memory plan ask of a config;
none of them names an architecture.
"""

from __future__ import annotations

from typing import Any

import torch

from modeling.architecture import Architecture, LayerActivations
from modeling.config import ModelConfig, UnsupportedModelError
from modeling.kv_cache import window_ring_size
from modeling.models.gemma3 import GEMMA3
from modeling.models.gpt_oss import GPT_OSS
from modeling.models.llama import LLAMA
from modeling.models.mistral3 import MISTRAL3
from modeling.models.mixtral import MIXTRAL
from modeling.models.phi3 import PHI3
from modeling.models.qwen3_moe import QWEN3_MOE
from modeling.weights.quant import short

ARCHITECTURES: tuple[Architecture, ...] = (
    LLAMA,
    MISTRAL3,
    GEMMA3,
    PHI3,
    QWEN3_MOE,
    MIXTRAL,
    GPT_OSS,
)

BY_MODEL_TYPE: dict[str, Architecture] = {
    model_type: arch for arch in ARCHITECTURES for model_type in arch.model_types
}
# GGUF general.architecture → (its module, the model_type its config is read as)
BY_GGUF: dict[str, tuple[Architecture, str]] = {
    gguf: (arch, model_type)
    for arch in ARCHITECTURES
    for gguf, model_type in arch.gguf_architectures.items()
}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)
SUPPORTED_GGUF_ARCHITECTURES = tuple(BY_GGUF)


def architecture(config: ModelConfig) -> Architecture:
    """The module that runs `config` (a ModelConfig is only ever made by one)."""
    return BY_MODEL_TYPE[config.model_type]


def config_from_hf(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """A config.json record → ModelConfig, read by its architecture's module; an
    UnsupportedModelError for a model_type no module runs, or for a value no model has."""
    if not isinstance(raw, dict):  # (the file's JSON may be anything)
        raise UnsupportedModelError(
            f"{source}: the file holds {short(raw)}, not an object of config keys: fix the "
            "file or download the model again"
        )
    model_type = raw.get("model_type")
    arch = BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        given: Any = raw.get("architectures")
        strings = isinstance(given, list) and all(isinstance(n, str) for n in given)
        names = (", ".join(given) if strings else "")[:80] or "unknown architecture"
        raise UnsupportedModelError(
            f"{source}: model_type {short(model_type)} ({names}) is not supported; specd runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return _bounded(arch.config(raw, source), source)


# What a config may make us build (on the meta device, for the plan, before any weight is
# read): published models have at most ~160 layers and 384 experts a layer, 61 x 384 in all.
MAX_LAYERS = 1024
MAX_EXPERTS = 1024
MAX_EXPERT_MODULES = 1 << 16  # layers x experts
# Widths past any model's, so that a corrupt one is named here rather than met as "the
# plan needs 276 TiB": published models have hidden sizes to 16,384, MLPs to 53,248,
# vocabularies to 262,144, 128 heads of at most 256 dimensions and contexts to 10M.
MAX_WIDTH = 1 << 20  # hidden_size, intermediate sizes
MAX_VOCAB = 1 << 24
MAX_HEADS = 1 << 14  # heads, key/value heads, head_dim
MAX_CONTEXT = 1 << 30  # max_position_embeddings, sliding_window


def _bounded(cfg: ModelConfig, source: str) -> ModelConfig:
    """`cfg`, or an UnsupportedModelError naming the value a hostile or broken config gives
    that no model has: a count or width below 1 or past any model's (a module is built per
    layer and per expert before a weight is read, so 10^8 of them would hang the loader and
    the plan), or an RMSNorm epsilon outside (0, 1), which divides by zero or flattens every
    activation to nothing. (Each architecture's reader has checked the types; a GGUF file's
    config comes through here too.)"""
    moe, window = cfg.moe, cfg.sliding_window
    experts = moe.experts if moe is not None else 1
    shared = moe.shared_intermediate_size if moe is not None else None
    for key, value, most in (
        ("num_hidden_layers", cfg.num_layers, MAX_LAYERS),
        ("experts per layer", experts, MAX_EXPERTS),
        ("layers x experts", cfg.num_layers * experts, MAX_EXPERT_MODULES),
        ("vocab_size", cfg.vocab_size, MAX_VOCAB),
        ("hidden_size", cfg.hidden_size, MAX_WIDTH),
        ("intermediate_size", cfg.intermediate_size, MAX_WIDTH),
        ("moe_intermediate_size", moe.intermediate_size if moe else 1, MAX_WIDTH),
        ("shared_expert_intermediate_size", 1 if shared is None else shared, MAX_WIDTH),
        ("num_attention_heads", cfg.num_heads, MAX_HEADS),
        ("num_key_value_heads", cfg.num_kv_heads, MAX_HEADS),
        ("head_dim", cfg.head_dim, MAX_HEADS),
        ("max_position_embeddings", cfg.max_position_embeddings, MAX_CONTEXT),
        ("original_max_position_embeddings", cfg.rope.original_max_position_embeddings,
         MAX_CONTEXT),
        ("sliding_window", 1 if window is None else window, MAX_CONTEXT),
        ("the attention temperature's original context",
         cfg.query_scale[1] if cfg.query_scale else 1, MAX_CONTEXT),
    ):  # fmt: skip
        if value > most:
            raise UnsupportedModelError(
                f"{source}: {key} is {short(value)}, past the {most} specd builds (no published "
                "model has as many): the config is corrupt"
            )
        if value < 1:
            raise UnsupportedModelError(
                f"{source}: {key} is {value}; it must be at least 1: the config is corrupt"
            )
    if not 0 < cfg.rms_norm_eps < 1:
        raise UnsupportedModelError(
            f"{source}: rms_norm_eps is {cfg.rms_norm_eps}; it must be above 0 and below 1 "
            "(models use 1e-5 or 1e-6): the config is corrupt"
        )
    return cfg


def gguf_architecture(name: str) -> tuple[Architecture, str] | None:
    """A GGUF `general.architecture` → (its module, the model_type it is read as)."""
    return BY_GGUF.get(name)


def layer_parameter_count(config: ModelConfig, index: int = 0) -> int:
    """Exact parameters of layer `index`, from the shapes alone."""
    return architecture(config).layer_parameters(config, index)


def parameter_count(config: ModelConfig) -> int:
    """Exact parameters of the whole model, from the shapes alone (the memory planner's):
    embedding, head unless tied, final norm, every layer."""
    embed = config.vocab_size * config.hidden_size
    head = 0 if config.tie_word_embeddings else embed
    arch = architecture(config)
    layers = sum(arch.layer_parameters(config, i) for i in range(config.num_layers))
    return embed + head + config.hidden_size + layers


def windowed(config: ModelConfig) -> bool:
    """Whether any layer attends through a sliding window (its cache keeps positions)."""
    return any(layer.window is not None for layer in architecture(config).kv_layout(config))


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the KV cache holds per token of the context: the full-attention layers', and
    the slot's position when a layer has a window (`KVCache.positions`, int64). Window
    layers hold a ring of a fixed size instead (`window_kv_bytes_per_token`)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout = architecture(config).kv_layout(config)
    kept = 8 if any(layer.window is not None for layer in layout) else 0
    full = sum(layer.bytes_per_token(itemsize) for layer in layout if layer.window is None)
    return full + kept


def window_kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per ring slot over every window layer, the ring's window: the largest)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout = architecture(config).kv_layout(config)
    windowed = [layer for layer in layout if layer.window is not None]
    window = max((layer.window or 0 for layer in windowed), default=0)
    return sum(layer.bytes_per_token(itemsize) for layer in windowed), window


def kv_bytes(config: ModelConfig, dtype: torch.dtype, context: int, pass_tokens: int = 0) -> int:
    """Bytes of a full KV cache of `context` tokens for passes of up to `pass_tokens`
    (modeling/kv_cache.py: window layers keep a ring of `window_ring_size` slots)."""
    ring, window = window_kv_bytes_per_token(config, dtype)
    rings = ring * window_ring_size(window, context, pass_tokens) if ring else 0
    return kv_bytes_per_token(config, dtype) * context + rings


def layer_activations(config: ModelConfig, itemsize: int, copy: int) -> LayerActivations:
    """A layer pass's peak bytes per token (the largest layer's; see
    `Architecture.layer_activations`)."""
    return architecture(config).layer_activations(config, itemsize, copy)
