"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norm),
one module because they are one block with three flags (`qkv_bias`, `o_bias`, `qk_norm`).

A layer is pre-norm attention and a SwiGLU MLP, each added to the residual. Dense q/k/v and
gate/up are stacked into one projection each (`FusedLinear`), packed ones stay the
checkpoint's. From GGUF, Llama's converter permutes q and k rows for llama.cpp's rotary
layout (pairs of adjacent values); `gguf_tensor` puts them back in Hugging Face's order
(halves), whole rows, so blocks need no decoding for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from modeling.architecture import (
    GGUF_EXPERTS,
    GGUF_LAYERS,
    Architecture,
    GGUFKeys,
    LayerActivations,
    unpermute_qk,
)
from modeling.config import ModelConfig, UnsupportedModelError
from modeling.config_readers import (
    LAYER_TYPES,
    attention_widths,
    bos_id,
    dtype_name,
    eos_ids,
    flag,
    given_layer_types,
    integer,
    number,
    rope_config,
)
from modeling.layers.decoder_layer import DecoderLayer, layer_activations, layer_parameters
from modeling.weights.quant import parse_quantization


def _layer_types(
    raw: dict[str, Any], window: int | None, layers: int, source: str
) -> tuple[str, ...]:
    """Which layers slide: config.json's `layer_types`, else Qwen2/3's layers from
    `max_window_layers` on; empty (every layer, Mistral's) when neither says."""
    if window is None:
        return ()
    if raw.get("layer_types") is not None:
        return given_layer_types(raw, layers, source)
    if raw["model_type"] in ("qwen2", "qwen3"):
        first = integer(raw, "max_window_layers", source, 28, minimum=0)
        return tuple(LAYER_TYPES[i >= first] for i in range(layers))
    return ()


def _active_sliding_window(raw: dict[str, Any], model_type: str, source: str) -> int | None:
    if raw.get("sliding_window") is None:
        return None
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    window = integer(raw, "sliding_window", source)
    if window >= integer(raw, "max_position_embeddings", source, window):
        return None  # the window covers the whole context: plain full attention
    return window


class Llama(Architecture):
    name: ClassVar[str] = "llama"
    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3")
    # Mistral's files say "llama".
    gguf_architectures: ClassVar[Mapping[str, str]] = {
        "llama": "llama",
        "qwen2": "qwen2",
        "qwen3": "qwen3",
    }
    gguf_layer_names: ClassVar[Mapping[str, str]] = GGUF_LAYERS
    # Mixtral's files say "llama" too, with experts: read as model_type mixtral
    # (`gguf_config`), whose module loads them (modeling/models/mixtral.py).
    gguf_experts: ClassVar[Mapping[str, str]] = GGUF_EXPERTS

    def config(self, raw: dict[str, Any], source: str) -> ModelConfig:
        model_type = raw["model_type"]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act {act!r} is not supported (only 'silu')"
            )
        hidden, heads, kv_heads, head_dim = attention_widths(raw, source)
        rope = rope_config(raw, source)
        if rope.kind == "longrope":
            raise UnsupportedModelError(
                f"{source}: rope scaling type 'longrope' is supported for Phi-3 models only"
            )
        if rope.partial_rotary_factor != 1.0:
            raise UnsupportedModelError(
                f"{source}: partial_rotary_factor {rope.partial_rotary_factor} is not "
                "supported by Llama-family models (RoPE over the whole head only)"
            )
        attention_bias = flag(raw, "attention_bias", source, False)
        window = _active_sliding_window(raw, model_type, source)
        layers = integer(raw, "num_hidden_layers", source)
        return ModelConfig(
            model_type=model_type,
            vocab_size=integer(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=integer(raw, "intermediate_size", source),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number(raw, "rms_norm_eps", source, 1e-6),
            max_position_embeddings=integer(raw, "max_position_embeddings", source, 2048),
            rope=rope,
            tie_word_embeddings=flag(raw, "tie_word_embeddings", source, False),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "mistral") and attention_bias,
            mlp_bias=flag(raw, "mlp_bias", source, False),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            layer_types=_layer_types(raw, window, layers, source),
            bos_token_id=bos_id(raw, source),
            eos_token_ids=eos_ids(raw, source),
            torch_dtype=dtype_name(raw, source),
            quantization=parse_quantization(raw, source),
        )

    def block(self, cfg: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(cfg, index)

    def layer_parameters(self, cfg: ModelConfig, index: int) -> int:
        return layer_parameters(cfg)

    def layer_activations(self, cfg: ModelConfig, itemsize: int, copy: int) -> LayerActivations:
        return layer_activations(cfg, itemsize, copy)

    def gguf_tensor(
        self, cfg: ModelConfig, name: str, rows: torch.Tensor, ne: tuple[int, ...]
    ) -> torch.Tensor:
        return rows if cfg.model_type != "llama" else unpermute_qk(cfg, name, rows, ne)

    def gguf_config(self, keys: GGUFKeys, tensors: Mapping[str, Any]) -> dict[str, Any]:
        experts = keys.count("expert_count", 0, minimum=0)
        if not experts:
            return {}
        if keys.arch != "llama":  # (checked against the tensors: gguf_config.py)
            raise UnsupportedModelError(
                f"{keys.source}: {keys.arch}.expert_count is {experts}: specd runs mixtures of "
                f"experts as qwen3moe, or Mixtral as llama, not as {keys.arch}"
            )
        return {"model_type": "mixtral", "num_local_experts": experts,
                "num_experts_per_tok": keys.count("expert_used_count")}  # fmt: skip


LLAMA = Llama()
