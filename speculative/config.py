"""Model configuration: a Hugging Face `config.json` read into one typed, validated record.

Only the Llama family is supported (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3). Anything the
decoder would compute differently from the reference is refused here, at load time, with a
message that names the offending key, rather than producing quietly wrong logits later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from speculative.quant import QuantizationSpec, parse_quantization

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or option this runtime does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # config.json's quantization_config: its projections are packed (speculative/quant.py,
    # speculative/packed.py)
    quantization: QuantizationSpec | None = None

    @property
    def max_context(self) -> int:
        """The longest context this runtime computes exactly: full attention only, so a
        sliding-window model is limited to its window."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = ", ".join(raw.get("architectures") or []) or "unknown architecture"
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} ({arch}) is not supported; specd runs "
                f"Llama-family decoders: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act {act!r} is not supported (only 'silu')"
            )

        def need(key: str) -> Any:
            if key not in raw:
                raise UnsupportedModelError(f"{source}: required key {key!r} is missing")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )

        sliding = _active_sliding_window(raw, model_type)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=_rope_config(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "mistral") and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            quantization=parse_quantization(raw, source),
        )

    def parameter_count(self) -> int:
        """Exact number of parameters, from the shapes alone (used by the memory planner)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.hidden_size + self.num_layers * self.layer_parameter_count()

    def layer_parameter_count(self) -> int:
        d, h, kv, hd, f = (
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
        )
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        if self.qkv_bias:
            attn += h * hd + 2 * kv * hd
        if self.o_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * hd
        mlp = 3 * d * f + ((2 * f + d) if self.mlp_bias else 0)
        return attn + mlp + 2 * d


def _active_sliding_window(raw: dict[str, Any], model_type: str) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    window = int(window)
    if window >= int(raw.get("max_position_embeddings", window)):
        return None  # the window covers the whole context: plain full attention
    return window


def _rope_config(raw: dict[str, Any], source: str) -> RopeConfig:
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
    theta = float(params.get("rope_theta", theta))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedModelError(
            f"{source}: partial_rotary_factor {partial} is not supported (RoPE over the "
            "whole head only)"
        )
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope scaling type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )
