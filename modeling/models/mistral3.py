"""Mistral 3: Ministral 3 (3B, 8B, 14B) and Mistral Small 3.1/3.2 (24B), their text models.

The decoder is Mistral's, the Llama block (`DecoderLayer`). Ministral 3 adds YaRN
RoPE and Llama 4's attention temperature: after RoPE each query is scaled by
1 + beta * ln(1 + floor(position / original_max_position_embeddings)) (`rope_parameters`'
`llama_4_scaling_beta`, 0.1), which is 1 below the original context (16,384) and so
only changes long contexts (`ModelConfig.query_scale`, modeling/layers/attention.py).

Checkpoints come as the multimodal `Mistral3ForConditionalGeneration` (model_type
`mistral3`, the text model's keys in `text_config`, whose model_type is `ministral3` or,
for Mistral Small, `mistral`; the vision tower's tensors are skipped) or as the text model
alone (`ministral3`). llama.cpp's converter writes both as GGUF architecture `mistral3`:
Llama's tensors with q and k permuted, YaRN's keys (`mscale_all_dim` as
`rope.scaling.yarn_log_multiplier`, which llama.cpp reads beside an `mscale` of 1), and the
temperature's beta as `attention.temperature_scale` (its floor is YaRN's original context,
as llama.cpp reads it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from modeling.architecture import (
    GGUF_LAYERS,
    MULTIMODAL_TOP_LEVEL,
    Architecture,
    GGUFKeys,
    LayerActivations,
    multimodal_text_name,
    unpermute_qk,
)
from modeling.config import ModelConfig, UnsupportedModelError
from modeling.config_readers import (
    attention_widths,
    bos_id,
    dtype_name,
    eos_ids,
    flag,
    integer,
    number,
    rope_config,
)
from modeling.layers.decoder_layer import DecoderLayer, layer_activations, layer_parameters
from modeling.weights.quant import parse_quantization, short

_TEXT_MODEL_TYPES = ("ministral3", "mistral")
BETA = "llama_4_scaling_beta"
# (beta, floor) as a GGUF file states them, passed from `gguf_config` to `config`
GGUF_TEMPERATURE = "gguf attention temperature"
# Ministral3Config's defaults for the keys a config may leave out (transformers 5), besides
# eps and the context (`Mistral3.config`)
_MINISTRAL3_HEAD_DIM = 128
_MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1_000_000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16_384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    BETA: 0.1,
}


def _text_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model's keys: config.json itself (`ministral3`), or a multimodal
    checkpoint's `text_config` with its top-level dtype, quantization and token ids."""
    if raw["model_type"] != "mistral3":
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(
            f"{source}: text_config is {short(text)}; a mistral3 checkpoint's text model is "
            "an object there: fix the file or download the model again"
        )
    inner = text.get("model_type", "mistral")
    if inner not in _TEXT_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: text_config.model_type {short(inner)} is not supported in a mistral3 "
            f"checkpoint (specd runs {', '.join(_TEXT_MODEL_TYPES)})"
        )
    merged = dict(text)
    for key in MULTIMODAL_TOP_LEVEL:
        if key in raw and key not in merged:
            merged[key] = raw[key]
    if "tie_word_embeddings" in raw:  # (transformers ties the head by the top level's)
        merged["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return {**merged, "model_type": inner}


def _query_scale(raw: dict[str, Any], floor: int, source: str) -> tuple[float, int] | None:
    """(beta, floor) of the attention temperature: a GGUF file's (`gguf_config`), else the
    RoPE block's `llama_4_scaling_beta` (of the block `rope_config` reads: rope_scaling
    where it is given, else rope_parameters) over `floor`, YaRN's original context; None
    where there is none or it is 0. Only `ministral3` text models have one (transformers'
    Mistral, Mistral Small's text model, ignores the key)."""
    if raw["model_type"] != "ministral3":
        return None
    if isinstance(raw.get(GGUF_TEMPERATURE), tuple):  # (a JSON file holds no tuple)
        beta, floor = raw[GGUF_TEMPERATURE]
        label = "attention.temperature_scale"
    else:
        name = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
        block = raw.get(name) or {}
        if block.get(BETA) is None:
            return None
        label = f"{name}.{BETA}"
        beta = number(block, BETA, source, 0.0, label=label)
    if not 0 <= beta <= 10:
        raise UnsupportedModelError(f"{source}: {label} {beta} is not from 0 to 10")
    return (beta, floor) if beta else None


class Mistral3(Architecture):
    name: ClassVar[str] = "mistral3"
    model_types: ClassVar[tuple[str, ...]] = ("mistral3", "ministral3")
    gguf_architectures: ClassVar[Mapping[str, str]] = {"mistral3": "ministral3"}
    gguf_layer_names: ClassVar[Mapping[str, str]] = GGUF_LAYERS
    gguf_yarn_log_multiplier: ClassVar[bool] = True

    def config(self, raw: dict[str, Any], source: str) -> ModelConfig:
        text = _text_config(raw, source)
        if text["model_type"] == "ministral3":
            if text.get("head_dim") is None:
                text = {**text, "head_dim": _MINISTRAL3_HEAD_DIM}
            if not text.get("rope_scaling") and not text.get("rope_parameters"):
                text = {**text, "rope_parameters": _MINISTRAL3_ROPE}
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act {short(act)} is not supported (only 'silu')"
            )
        hidden, heads, kv_heads, head_dim = attention_widths(text, source)
        rope = rope_config(text, source)
        if rope.kind == "longrope" or rope.partial_rotary_factor != 1.0:
            raise UnsupportedModelError(
                f"{source}: {rope.kind} RoPE over {rope.partial_rotary_factor} of each head is "
                "not supported by Mistral 3 (the whole head: default, linear, llama3 or YaRN)"
            )
        # transformers' defaults for a key a config leaves out: Ministral3Config's, MistralConfig's
        eps, positions = (1e-5, 262_144) if text["model_type"] == "ministral3" else (1e-6, 131_072)
        max_positions = integer(text, "max_position_embeddings", source, positions)
        window = None  # (Mistral's: every layer slides, where a window is set)
        if text.get("sliding_window") is not None:
            window = integer(text, "sliding_window", source)
            if window >= max_positions:
                window = None  # covers the whole context: plain full attention
        bias = flag(text, "attention_bias", source, False)
        return ModelConfig(
            model_type=raw["model_type"],
            vocab_size=integer(text, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=integer(text, "intermediate_size", source),
            num_layers=integer(text, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number(text, "rms_norm_eps", source, eps),
            max_position_embeddings=max_positions,
            rope=rope,
            tie_word_embeddings=flag(text, "tie_word_embeddings", source, False),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=flag(text, "mlp_bias", source, False),
            sliding_window=window,
            query_scale=_query_scale(text, rope.original_max_position_embeddings, source),
            bos_token_id=bos_id(text, source),
            eos_token_ids=eos_ids(text, source),
            torch_dtype=dtype_name(text, source),
            quantization=parse_quantization(text, source),
        )

    def block(self, cfg: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(cfg, index)

    def layer_parameters(self, cfg: ModelConfig, index: int) -> int:
        return layer_parameters(cfg)

    def layer_activations(self, cfg: ModelConfig, itemsize: int, copy: int) -> LayerActivations:
        return layer_activations(cfg, itemsize, copy)

    def hf_name(self, stored: str) -> str | None:
        return multimodal_text_name(stored)

    def gguf_tensor(
        self, cfg: ModelConfig, name: str, rows: torch.Tensor, ne: tuple[int, ...]
    ) -> torch.Tensor:
        return unpermute_qk(cfg, name, rows, ne)  # (the converter's Llama permutation)

    def gguf_config(self, keys: GGUFKeys, tensors: Mapping[str, Any]) -> dict[str, Any]:
        # The file's RoPE is what it states (the YaRN of its scaling keys, else none), never
        # Ministral3Config's defaults for a config.json that states none.
        out: dict[str, Any] = {"rope_parameters": {"rope_type": "default"}}
        widths = keys.count("embedding_length") // keys.count("attention.head_count")
        head_dim = keys.count("attention.key_length", max(widths, 1))  # (gguf_config's)
        if keys.count("rope.dimension_count", head_dim) != head_dim:
            raise UnsupportedModelError(
                f"{keys.source}: mistral3.rope.dimension_count is not "
                f"attention.key_length ({head_dim}): Mistral 3 turns whole heads"
            )
        if keys.has("attention.temperature_scale"):
            # Its floor: YaRN's original context where the file states one, else the
            # context (llama.cpp's n_ctx_orig_yarn)
            floor = keys.count(
                "rope.scaling.original_context_length", keys.count("context_length", 2048)
            )
            beta = keys.number("attention.temperature_scale")
            out[GGUF_TEMPERATURE] = (beta, floor)
        return out


MISTRAL3 = Mistral3()
