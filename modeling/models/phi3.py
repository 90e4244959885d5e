"""Phi-3 and Phi-4 (`phi3`): Phi-3-mini/medium with their sliding window, Phi-4 (14B), and
Phi-4-mini's partial rotary RoPE.

A Llama block whose checkpoint stores q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` (gate's rows first): both are kept as stored, dense or packed, so no tensor
is split at load and a packed one stays packed. The rest is the shared layers': RoPE over
the first `partial_rotary_factor` of each head, the window by position for every layer
when `sliding_window` is set, SwiGLU.

LongRoPE (Phi-3.5, the 128k-context Phi-3s, Phi-4-mini): the short factors below
`original_max_position_embeddings` and the long ones from it on, chosen per position
(modeling/decoder.py's `rope`), which is what transformers computes token by token (it
picks by the pass's longest position, so its one-pass prefill of a prompt longer than the
original context would use the long table for every row: speculation needs each position's
rotation not to depend on the pass it rides in).

From GGUF (`phi3`, llama.cpp's Phi3MiniModel, which also converts Phi-4): `attn_qkv` and
the fused `ffn_up` (gate's rows, then up's) kept as stored; the rotary width as
`rope.dimension_count`; LongRoPE's factors as the tensors `rope_factors_long` /
`rope_factors_short` with `rope.scaling.original_context_length`; the window as
`attention.sliding_window` (0 for Phi-4: none). llama.cpp switches Phi's window off
("Phi SWA is currently disabled", and picks one LongRoPE table for the whole context) and
transformers' GGUF loader reads neither; we run the file as the model's config.json runs,
window and per-position tables included, so a GGUF and its safetensors source agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from torch import nn

from modeling.architecture import Architecture, GGUFKeys, LayerActivations
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
from modeling.weights.quant import parse_quantization


class Phi3(Architecture):
    name: ClassVar[str] = "phi3"
    model_types: ClassVar[tuple[str, ...]] = ("phi3",)
    gguf_architectures: ClassVar[Mapping[str, str]] = {"phi3": "phi3"}
    gguf_layer_names: ClassVar[Mapping[str, str]] = {
        "attn_norm": "input_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    }
    gguf_config_tensors: ClassVar[frozenset[str]] = frozenset(
        {"rope_factors_long.weight", "rope_factors_short.weight"}
    )

    def config(self, raw: dict[str, Any], source: str) -> ModelConfig:
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act {act!r} is not supported by Phi-3 (only 'silu')"
            )
        hidden, heads, kv_heads, head_dim = attention_widths(raw, source)
        # transformers' Phi3Config default, which LongRoPE's factor and table switch read
        rope = rope_config({"original_max_position_embeddings": 4096, **raw}, source)
        rotary = int(head_dim * rope.partial_rotary_factor)
        if rotary < 2 or rotary % 2:
            raise UnsupportedModelError(
                f"{source}: partial_rotary_factor {rope.partial_rotary_factor} turns {rotary} "
                f"of head_dim {head_dim} dimensions; RoPE needs an even number of at least 2"
            )
        for key in ("short_factor", "long_factor"):
            if rope.kind == "longrope" and len(getattr(rope, key)) != rotary // 2:
                raise UnsupportedModelError(
                    f"{source}: rope_scaling.{key} has {len(getattr(rope, key))} factors; "
                    f"the {rotary} rotary dimensions need {rotary // 2}"
                )
        max_positions = integer(raw, "max_position_embeddings", source, 4096)
        window = None
        if raw.get("sliding_window") is not None:
            window = integer(raw, "sliding_window", source)
            if window >= max_positions:
                window = None  # covers the whole context: plain full attention
        return ModelConfig(
            model_type="phi3",
            vocab_size=integer(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=integer(raw, "intermediate_size", source),
            num_layers=integer(raw, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number(raw, "rms_norm_eps", source, 1e-5),
            max_position_embeddings=max_positions,
            rope=rope,
            tie_word_embeddings=flag(raw, "tie_word_embeddings", source, False),
            sliding_window=window,
            stored_fused=True,
            bos_token_id=bos_id(raw, source),
            eos_token_ids=eos_ids(raw, source),
            torch_dtype=dtype_name(raw, source),
            quantization=parse_quantization(raw, source),
        )

    def gguf_config(self, keys: GGUFKeys, tensors: Mapping[str, Any]) -> dict[str, Any]:
        hidden, heads = keys.count("embedding_length"), keys.count("attention.head_count")
        head_dim = keys.count("attention.key_length", max(hidden // heads, 1))
        rotary = keys.count("rope.dimension_count", head_dim)
        raw: dict[str, Any] = {"partial_rotary_factor": rotary / head_dim}
        window = keys.count("attention.sliding_window", 0, minimum=0)
        raw["sliding_window"] = window or None
        long = keys.floats("rope_factors_long.weight", rotary // 2)
        short = keys.floats("rope_factors_short.weight", rotary // 2)
        if (long is None) != (short is None):
            raise UnsupportedModelError(
                f"{keys.source}: the file has one of rope_factors_long and "
                "rope_factors_short; LongRoPE needs both"
            )
        if long is not None and short is not None:
            raw["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short}
            raw["original_max_position_embeddings"] = keys.count(
                "rope.scaling.original_context_length"
            )
        return raw

    def block(self, cfg: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(cfg, index)  # Llama's block; the config keeps its tensors whole

    def layer_parameters(self, cfg: ModelConfig, index: int) -> int:
        return layer_parameters(cfg)

    def layer_activations(self, cfg: ModelConfig, itemsize: int, copy: int) -> LayerActivations:
        return layer_activations(cfg, itemsize, copy)


PHI3 = Phi3()
