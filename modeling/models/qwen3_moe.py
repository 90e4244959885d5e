"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, no biases) and
in every layer a mixture of experts (modeling/layers/moe.py): a router over `num_experts`
gated MLPs of `moe_intermediate_size`, `num_experts_per_tok` per token, their softmax
weights renormalised where `norm_topk_prob` says. Checkpoints store each expert apart
(`mlp.experts.<e>.gate_proj`, `up_proj`, `down_proj`) and the router as `mlp.gate`. GGUF
files (`general.architecture` qwen3moe) stack each layer's experts (`ffn_*_exps`, split per
expert as they load) and name the router `ffn_gate_inp`; llama.cpp always renormalises the
chosen weights for qwen3moe (the file does not say), as Qwen3-MoE's releases set
`norm_topk_prob`.

Configs whose layers are not all sparse (`mlp_only_layers`, `decoder_sparse_step` above 1)
are refused by name: every layer of a model here has one shape (the streamer and the plan
rely on it), and no published Qwen3-MoE checkpoint mixes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from modeling.architecture import GGUF_EXPERTS, GGUF_LAYERS, GGUFKeys
from modeling.config import ModelConfig, MoEConfig, UnsupportedModelError
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
from modeling.layers.moe import MoEArchitecture
from modeling.weights.quant import parse_quantization


def _count(raw: dict[str, Any], keys: tuple[str, ...], source: str) -> int:
    """The first of `keys` config.json states, a whole number of at least 1."""
    for key in keys:
        if key in raw:
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UnsupportedModelError(f"{source}: {key} must be a count of at least 1")
            return value
    raise UnsupportedModelError(f"{source}: required key {keys[0]!r} is missing")


class Qwen3Moe(MoEArchitecture):
    name: ClassVar[str] = "qwen3_moe"
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_moe", "qwen2_moe")
    gguf_architectures: ClassVar[Mapping[str, str]] = {
        "qwen3moe": "qwen3_moe",
        "qwen2moe": "qwen2_moe",
    }
    gguf_layer_names: ClassVar[Mapping[str, str]] = {
        **GGUF_LAYERS,
        # Qwen2-MoE's shared expert and its sigmoid gate
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    }
    gguf_experts: ClassVar[Mapping[str, str]] = GGUF_EXPERTS
    gguf_expert_shared: ClassVar[int | None] = None  # the tensors say (Qwen2-MoE: one)

    def config(self, raw: dict[str, Any], source: str) -> ModelConfig:
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act {act!r} is not supported (only 'silu')"
            )
        if raw.get("mlp_only_layers") or integer(raw, "decoder_sparse_step", source, 1) != 1:
            raise UnsupportedModelError(
                f"{source}: mlp_only_layers / decoder_sparse_step mix dense and expert layers, "
                "which specd does not run (every layer here is one shape)"
            )
        model_type = raw.get("model_type", "qwen3_moe")
        if raw.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"{source}: use_sliding_window is not supported for {model_type}"
            )
        hidden, heads, kv_heads, head_dim = attention_widths(raw, source)
        rope = rope_config(raw, source)
        if rope.kind == "longrope" or rope.partial_rotary_factor != 1.0:
            raise UnsupportedModelError(
                f"{source}: rope {rope.kind} with partial_rotary_factor "
                f"{rope.partial_rotary_factor} is not supported for {model_type}"
            )
        qwen2 = model_type == "qwen2_moe"
        experts = _count(raw, ("num_experts", "num_local_experts"), source)
        top_k = _count(raw, ("num_experts_per_tok",), source)
        if top_k > experts:
            raise UnsupportedModelError(
                f"{source}: num_experts_per_tok {top_k} is more than the {experts} experts"
            )
        moe = MoEConfig(
            experts=experts,
            top_k=top_k,
            intermediate_size=_count(raw, ("moe_intermediate_size",), source),
            normalize=flag(raw, "norm_topk_prob", source, False),
            shared_intermediate_size=(
                _count(raw, ("shared_expert_intermediate_size",), source) if qwen2 else None
            ),
        )
        # Qwen2-MoE: Qwen2's attention (q/k/v biases, no q/k norms) and a gated shared expert
        attention_bias = flag(raw, "attention_bias", source, False)
        return ModelConfig(
            model_type=model_type,
            vocab_size=integer(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=integer(raw, "intermediate_size", source, moe.intermediate_size),
            num_layers=integer(raw, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number(raw, "rms_norm_eps", source, 1e-6),
            max_position_embeddings=integer(raw, "max_position_embeddings", source, 2048),
            rope=rope,
            tie_word_embeddings=flag(raw, "tie_word_embeddings", source, False),
            qkv_bias=attention_bias or qwen2,
            o_bias=attention_bias,
            qk_norm=not qwen2,
            bos_token_id=bos_id(raw, source),
            eos_token_ids=eos_ids(raw, source),
            torch_dtype=dtype_name(raw, source),
            quantization=parse_quantization(raw, source),
            moe=moe,
        )

    def gguf_config(self, keys: GGUFKeys, tensors: Mapping[str, Any]) -> dict[str, Any]:
        raw = {
            "num_experts": keys.count("expert_count"),
            "num_experts_per_tok": keys.count("expert_used_count"),
            "moe_intermediate_size": keys.count("expert_feed_forward_length"),
            "norm_topk_prob": True,
        }
        if keys.arch == "qwen2moe":  # llama.cpp does not renormalise Qwen2-MoE's weights
            raw["norm_topk_prob"] = False
            raw["shared_expert_intermediate_size"] = keys.count("expert_shared_feed_forward_length")
        return raw


QWEN3_MOE = Qwen3Moe()
