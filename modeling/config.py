"""Model configuration: one typed record (`ModelConfig`) every part of the runtime reads,
and the readers of config.json's shared keys (`required`, `rope_config`).

Which architecture a config.json describes, and what it refuses, is its architecture
module's (modeling/models/): `modeling.models.config_from_hf` reads a config through it.
Anything the decoder would compute differently from the reference is refused at load time,
with a message that names the offending key, rather than producing quietly wrong logits
later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from modeling.weights.quant import QuantizationSpec

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or option this runtime does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    # YaRN: the ramp's bounds in rotations, whether they are rounded outwards, and the
    # factor on cos and sin (None: from `factor`, and mscale / mscale_all_dim when given)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # The fraction of each head's dimensions that rotate (the rest pass as they are)
    partial_rotary_factor: float = 1.0
    # LongRoPE (Phi-3.5, Phi-4-mini): each frequency's divisor, below and from position
    # original_max_position_embeddings
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts layer (modeling/layers/moe.py): a router over `experts` gated
    MLPs of `intermediate_size` each, `top_k` of them per token, their weights the
    router's softmax over all experts, the top k taken, renormalised to sum 1 where
    `normalize` (Qwen3-MoE's `norm_topk_prob`; always in Mixtral). gpt-oss's differ: its
    router has a bias and takes the softmax over the chosen k logits only (`softmax_topk`,
    in the model dtype), and its experts have biases and a clamped SwiGLU (`swiglu_limit`,
    `swiglu_alpha`: modeling/layers/moe.py's `ClampedExpert`)."""

    experts: int
    top_k: int
    intermediate_size: int
    normalize: bool = True
    router_bias: bool = False
    softmax_topk: bool = False
    swiglu_limit: float | None = None  # None: the model's gated MLP (`MLP`)
    swiglu_alpha: float = 1.702
    # A shared expert every token goes through, scaled by sigmoid(gate(x)) (Qwen2-MoE):
    # its gated MLP's width; None: none
    shared_intermediate_size: int | None = None
    # The ggml type the experts are kept in as blocks where the checkpoint stores them
    # packed and the rest dense (gpt-oss's MXFP4 release); None: as the config says
    expert_blocks: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # active window, or None for full attention
    # Each layer's kind, "full_attention" or "sliding_attention" (transformers' names);
    # empty: every layer slides when `sliding_window` is set (Mistral)
    layer_types: tuple[str, ...] = ()
    # The RoPE of sliding layers where it differs from `rope` (Gemma 3's local base)
    local_rope: RopeConfig | None = None
    hidden_act: str = "silu"
    norm_offset: float = 0.0  # RMSNorm scales by offset + w ((1 + w): Gemma)
    embedding_scale: float | None = None  # the embedding's output times this (Gemma: sqrt(d))
    attention_scale: float | None = None  # on the scores; None: head_dim ** -0.5
    attention_softcap: float | None = None  # Gemma 2's attn_logit_softcapping
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss: `self_attn.sinks`)
    # The checkpoint stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3)
    stored_fused: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # config.json's quantization_config: its projections are packed (modeling/weights/quant.py,
    # modeling/weights/packed.py)
    quantization: QuantizationSpec | None = None
    # Every layer's MLP is a mixture of experts (Qwen3-MoE, Mixtral); None: dense MLPs
    moe: MoEConfig | None = None

    def layer_window(self, index: int) -> int | None:
        """Layer `index`'s sliding window in positions, None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[index] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_rope(self, index: int) -> RopeConfig:
        """The RoPE layer `index` rotates by: the local one for a sliding layer that has one."""
        if self.local_rope is not None and self.layer_window(index) is not None:
            return self.local_rope
        return self.rope

    @property
    def max_context(self) -> int:
        """The longest context the model was made for (window layers are computed exactly
        by position, so a window no longer limits it)."""
        return self.max_position_embeddings


def required(raw: dict[str, Any], key: str, source: str) -> Any:
    """config.json's `key`, or an UnsupportedModelError naming it."""
    if key not in raw:
        raise UnsupportedModelError(f"{source}: required key {key!r} is missing")
    return raw[key]


def attention_widths(raw: dict[str, Any], source: str) -> tuple[int, int, int, int]:
    """config.json's hidden size, attention heads, key/value heads and head dimension,
    the heads a positive multiple of the key/value heads."""
    hidden = int(required(raw, "hidden_size", source))
    heads = int(required(raw, "num_attention_heads", source))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise UnsupportedModelError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv_heads}"
        )
    return hidden, heads, kv_heads, int(raw.get("head_dim") or hidden // heads)


def eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """config.json's `eos_token_id`: one id, a list of them, or none."""
    eos = raw.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters. When a
    # config carries both, transformers lets a non-empty rope_scaling win outright (its
    # `convert_rope_params_to_dict`), so the logits we must match come from that one.
    parameters = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    params = scaling or parameters
    # Precedence: the chosen block, the top level, rope_parameters, 10000. Each step's
    # default is a float, not Any (an Any default reads as dict.get's Optional overload).
    theta: float = parameters.get("rope_theta", 10000.0)
    theta = raw.get("rope_theta", theta)
    given = params.get("rope_theta", theta)
    try:
        theta = float(given)
    except (TypeError, ValueError):
        theta = math.nan
    if not math.isfinite(theta) or theta <= 0:  # the frequencies would be inf or NaN
        raise UnsupportedModelError(
            f"{source}: rope_theta {str(given)[:40]!r} is not a number above 0"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope scaling type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    factor = params.get("factor")
    original = params.get(
        "original_max_position_embeddings", raw.get("original_max_position_embeddings")
    )
    if kind in ("yarn", "longrope") and factor is None:
        if original is None:
            raise UnsupportedModelError(
                f"{source}: {kind} RoPE scaling needs factor or original_max_position_embeddings"
            )
        longest: Any = raw.get("max_position_embeddings", original)
        factor = int(longest) / int(original)

    def optional(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            original if original is not None else raw.get("max_position_embeddings", 8192)
        ),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=optional("attention_factor"),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        partial_rotary_factor=float(partial) if partial is not None else 1.0,
        short_factor=_factors(params, "short_factor", kind, source),
        long_factor=_factors(params, "long_factor", kind, source),
    )


def _factors(params: dict[str, Any], key: str, kind: str, source: str) -> tuple[float, ...]:
    """LongRoPE's `short_factor` / `long_factor`: finite positive numbers (their count is
    checked against the rotary dimensions by the architecture that turns them)."""
    if kind != "longrope":
        return ()
    values = params.get(key)
    if not isinstance(values, list) or not values or len(values) > 4096:
        raise UnsupportedModelError(f"{source}: longrope RoPE scaling needs a list {key}")
    try:
        factors = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise UnsupportedModelError(f"{source}: {key} holds a value that is no number") from None
    if not all(0 < f < float("inf") for f in factors):
        raise UnsupportedModelError(f"{source}: {key} holds a factor that is not above 0")
    return factors


def whole_head_rope(raw: dict[str, Any], source: str, model_type: str) -> RopeConfig:
    """`rope_config`, refusing what a module that turns the whole head does not compute
    (LongRoPE, partial rotary)."""
    rope = rope_config(raw, source)
    if rope.kind == "longrope" or rope.partial_rotary_factor != 1.0:
        raise UnsupportedModelError(
            f"{source}: rope {rope.kind} with partial_rotary_factor "
            f"{rope.partial_rotary_factor} is not supported for {model_type}"
        )
    return rope


def routed_experts(raw: dict[str, Any], source: str, key: str) -> tuple[int, int]:
    """(experts, experts per token): `key` and `num_experts_per_tok`, 1 <= k <= experts."""
    experts = int(required(raw, key, source))
    top_k = int(required(raw, "num_experts_per_tok", source))
    if not 1 <= top_k <= experts:
        raise UnsupportedModelError(
            f"{source}: num_experts_per_tok {top_k} must be 1 to {key} {experts}"
        )
    return experts, top_k


LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names


def given_layer_types(raw: dict[str, Any], layers: int, source: str) -> tuple[str, ...]:
    """config.json's `layer_types`: one of LAYER_TYPES for each of `layers` layers."""
    given = raw.get("layer_types")
    if not isinstance(given, list) or len(given) != layers or not set(given) <= set(LAYER_TYPES):
        raise UnsupportedModelError(
            f"{source}: layer_types must list {layers} of {', '.join(LAYER_TYPES)}"
        )
    return tuple(given)
