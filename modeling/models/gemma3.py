"""Gemma 3 (`gemma3_text`, and the text part of `gemma3` multimodal checkpoints): the 270M,
1B, 4B, 12B and 27B models.

What makes it Gemma: four norms per block (before and after attention, before and after
the MLP), each and the final one scaling by (1 + w) in fp32; q/k norms; scores scaled by
`query_pre_attn_scalar` ** -0.5, not head_dim's; GeGLU (tanh GELU); the embedding's output
times sqrt(hidden) in the model dtype; local sliding-window layers and global layers by
`layer_types` (or every `sliding_window_pattern`-th layer global), the local ones with a
RoPE base of their own (`rope_local_base_freq`) and the global ones with the model's
(and the linear factor of the 4B and larger). Missing keys take transformers'
Gemma3TextConfig defaults, as the published configs rely on them (the 4B's text_config
names six keys).

A multimodal checkpoint's vision tower and projector are not loaded: `hf_name` drops them.

From GGUF (`gemma3`, llama.cpp's converter): the file states the window and the global
RoPE (base, and the linear factor as `rope.scaling.*`); what it leaves out llama.cpp fixes
for the architecture, and so do we: every sixth layer global, a local RoPE base of 10,000,
and the score scale 1/sqrt(head_dim) except the 27B's (62 layers: 1/sqrt(hidden / heads),
its config's `query_pre_attn_scalar` 168). The converter stores each norm as 1 + w, so
`gguf_offset` takes the 1 off in fp32 (exact: 1 + w - 1 for an fp32 1 + w of at least 1/2)
and the norms scale by (1 + w) as they do from safetensors, in any dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from modeling.architecture import (
    MULTIMODAL_TOP_LEVEL,
    Architecture,
    GGUFKeys,
    LayerActivations,
    multimodal_text_name,
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
from modeling.layers.attention import Slots
from modeling.layers.decoder_layer import layer_activations, layer_parameters, layer_phases
from modeling.layers.mlp import MLP
from modeling.layers.norms import RMSNorm, norm_bytes
from modeling.layers.self_attention import Attention
from modeling.weights.quant import parse_quantization, short

# transformers' Gemma3TextConfig defaults (a published config leaves most of them out)
DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _text_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model's keys over the defaults: config.json itself, or a multimodal
    checkpoint's `text_config` with its top-level dtype, quantization and token ids."""
    if raw["model_type"] != "gemma3":
        return {**DEFAULTS, **raw}
    text = raw.get("text_config") or {}
    if not isinstance(text, dict):
        raise UnsupportedModelError(
            f"{source}: text_config is {short(text)}; it must be an object: fix the file or "
            "download the model again"
        )
    text = dict(text)
    for key in MULTIMODAL_TOP_LEVEL:
        if key in raw and key not in text:
            text[key] = raw[key]
    return {**DEFAULTS, **text, "model_type": "gemma3"}


def _ropes(raw: dict[str, Any], source: str) -> tuple[Any, Any]:
    """The global layers' RoPE and the local (sliding) layers'. transformers 5 writes
    `rope_parameters` per layer type; 4.x wrote rope_theta, rope_scaling (global only) and
    rope_local_base_freq."""
    parameters = raw.get("rope_parameters") or {}
    if isinstance(parameters, dict) and (
        "full_attention" in parameters or "sliding_attention" in parameters
    ):
        ropes = []
        for kind, theta in (("full_attention", "rope_theta"),
                            ("sliding_attention", "rope_local_base_freq")):  # fmt: skip
            given = parameters.get(kind) or {}
            if not isinstance(given, dict):
                raise UnsupportedModelError(
                    f"{source}: rope_parameters.{kind} is {short(given)}; it must be an "
                    "object of RoPE parameters: fix the file or download the model again"
                )
            given = {"rope_theta": DEFAULTS[theta], **given}
            ropes.append(rope_config({"rope_parameters": given}, source))
        return ropes[0], ropes[1]
    global_raw = {"rope_theta": raw["rope_theta"], "rope_scaling": raw.get("rope_scaling")}
    global_raw["rope_parameters"] = parameters or None
    local_base = number(raw, "rope_local_base_freq", source)
    if local_base <= 0:  # (rope_config's message would name rope_theta)
        raise UnsupportedModelError(
            f"{source}: rope_local_base_freq is {local_base}; it must be above 0: fix the file "
            "or download the model again"
        )
    local_raw = {"rope_theta": local_base}
    return rope_config(global_raw, source), rope_config(local_raw, source)


class GemmaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        d, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(d, eps, offset)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(d, eps, offset)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, offset)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(d, eps, offset)

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        cos: torch.Tensor,
        sin: torch.Tensor,
        sequences: Sequence[Slots],
        layer: int,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, sequences, layer)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3(Architecture):
    name: ClassVar[str] = "gemma3"
    model_types: ClassVar[tuple[str, ...]] = ("gemma3_text", "gemma3")
    gguf_architectures: ClassVar[Mapping[str, str]] = {"gemma3": "gemma3_text"}
    gguf_layer_names: ClassVar[Mapping[str, str]] = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }

    def config(self, raw: dict[str, Any], source: str) -> ModelConfig:
        raw = _text_config(raw, source)
        act = raw.get("hidden_activation") or raw.get("hidden_act")
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(
                f"{source}: hidden_activation {act!r} is not supported by Gemma 3 "
                "(only 'gelu_pytorch_tanh')"
            )
        for key in ("use_bidirectional_attention", "final_logit_softcapping"):
            if raw.get(key):
                raise UnsupportedModelError(f"{source}: {key} {raw[key]!r} is not supported")
        layers = integer(raw, "num_hidden_layers", source)
        hidden, heads, kv_heads, head_dim = attention_widths(raw, source)
        types = raw.get("layer_types")
        if types is None:
            pattern = integer(raw, "sliding_window_pattern", source)
            types = [_LAYER_TYPES[bool((i + 1) % pattern)] for i in range(layers)]
        if (
            not isinstance(types, list)
            or len(types) != layers
            or not all(t in _LAYER_TYPES for t in types)
        ):
            raise UnsupportedModelError(
                f"{source}: layer_types must list {layers} of {', '.join(_LAYER_TYPES)}"
            )
        rope, local_rope = _ropes(raw, source)
        if "longrope" in (rope.kind, local_rope.kind):
            raise UnsupportedModelError(
                f"{source}: rope scaling type 'longrope' is supported for Phi-3 models only"
            )
        if rope.partial_rotary_factor != 1.0 or local_rope.partial_rotary_factor != 1.0:
            raise UnsupportedModelError(f"{source}: partial_rotary_factor is not supported")
        bias = flag(raw, "attention_bias", source, False)
        scalar = number(raw, "query_pre_attn_scalar", source)
        softcap = raw.get("attn_logit_softcapping")
        if softcap is not None:
            softcap = number(raw, "attn_logit_softcapping", source)
        for key, value in (("query_pre_attn_scalar", scalar), ("attn_logit_softcapping", softcap)):
            if value is not None and value <= 0:  # scores times scalar ** -0.5; / softcap
                raise UnsupportedModelError(
                    f"{source}: {key} is {value}; it must be above 0: fix the file or "
                    "download the model again"
                )
        return ModelConfig(
            model_type=raw["model_type"],
            vocab_size=integer(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=integer(raw, "intermediate_size", source),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number(raw, "rms_norm_eps", source),
            max_position_embeddings=integer(raw, "max_position_embeddings", source),
            rope=rope,
            local_rope=local_rope,
            tie_word_embeddings=flag(raw, "tie_word_embeddings", source, True),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            sliding_window=integer(raw, "sliding_window", source),
            layer_types=tuple(types),
            hidden_act="gelu_pytorch_tanh",
            norm_offset=1.0,
            embedding_scale=math.sqrt(hidden),
            attention_scale=scalar**-0.5,
            attention_softcap=softcap,
            bos_token_id=bos_id(raw, source),
            eos_token_ids=eos_ids(raw, source),
            torch_dtype=dtype_name(raw, source),
            quantization=parse_quantization(raw, source),
        )

    def block(self, cfg: ModelConfig, index: int) -> nn.Module:
        return GemmaLayer(cfg, index)

    def hf_name(self, stored: str) -> str | None:
        return multimodal_text_name(stored)

    def gguf_config(self, keys: GGUFKeys, tensors: Mapping[str, Any]) -> dict[str, Any]:
        hidden, heads = keys.count("embedding_length"), keys.count("attention.head_count")
        head_dim = keys.count("attention.key_length", max(hidden // heads, 1))
        return {
            "sliding_window": keys.count("attention.sliding_window"),
            "sliding_window_pattern": DEFAULTS["sliding_window_pattern"],
            "rope_local_base_freq": DEFAULTS["rope_local_base_freq"],
            "query_pre_attn_scalar": hidden // heads
            if keys.count("block_count") == 62
            else head_dim,
        }

    def gguf_offset(self, cfg: ModelConfig, name: str) -> float:
        return 1.0 if name.endswith("norm.weight") else 0.0

    def layer_parameters(self, cfg: ModelConfig, index: int) -> int:
        return layer_parameters(cfg, norms=4)

    def layer_activations(self, cfg: ModelConfig, itemsize: int, copy: int) -> LayerActivations:
        """Traced through `GemmaLayer`: the shared block's phases, plus the norms after
        attention and after the MLP, each over an output while the residual is alive."""
        d, item = cfg.hidden_size, itemsize
        own = [2 * item * d + norm_bytes(d, item), 3 * item * d + norm_bytes(d, item)]
        shared = layer_activations(cfg, itemsize, copy)
        return LayerActivations(
            layer=max([*layer_phases(cfg, itemsize, copy), *own]), attention=shared.attention
        )


GEMMA3 = Gemma3()
