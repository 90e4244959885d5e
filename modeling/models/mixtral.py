"""Mixtral (8x7B, 8x22B): Mistral's attention and in every layer a mixture of experts
(modeling/layers/moe.py): a router over `num_local_experts` gated MLPs of
`intermediate_size`, `num_experts_per_tok` per token, the softmax weights of the chosen
ones renormalised, each expert's output scaled in fp32. Checkpoints name the block
`block_sparse_moe` and an expert's projections w1 (gate), w3 (up) and w2 (down); they load
under the shared names (`mlp.experts.<e>.gate_proj`, ...). Its GGUF files are llama.cpp's
Llama converter's (`general.architecture` llama with `llama.expert_count`, read as mixtral
by modeling/models/llama.py): q and k permuted as Llama's, the experts stacked
(`ffn_*_exps`, split per expert as they load), the router `ffn_gate_inp`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from modeling.architecture import GGUF_EXPERTS, GGUF_LAYERS, unpermute_qk
from modeling.config import ModelConfig, MoEConfig, UnsupportedModelError
from modeling.config_readers import (
    attention_widths,
    bos_id,
    dtype_name,
    eos_ids,
    flag,
    integer,
    number,
    routed_experts,
    whole_head_rope,
)
from modeling.layers.moe import MoEArchitecture
from modeling.weights.quant import parse_quantization

# A stored expert projection's name → ours.
_EXPERT = re.compile(r"(layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|bias)")
_PROJECTION = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Mixtral(MoEArchitecture):
    weights_in_model_dtype: ClassVar[bool] = False  # scaled in fp32, the product rounded
    name: ClassVar[str] = "mixtral"
    model_types: ClassVar[tuple[str, ...]] = ("mixtral",)
    gguf_layer_names: ClassVar[Mapping[str, str]] = GGUF_LAYERS
    gguf_experts: ClassVar[Mapping[str, str]] = GGUF_EXPERTS

    def config(self, raw: dict[str, Any], source: str) -> ModelConfig:
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act {act!r} is not supported (only 'silu')"
            )
        hidden, heads, kv_heads, head_dim = attention_widths(raw, source)
        rope = whole_head_rope(raw, source, "mixtral")
        experts, top_k = routed_experts(raw, source, "num_local_experts")
        intermediate = integer(raw, "intermediate_size", source)
        max_position = integer(raw, "max_position_embeddings", source, 4096 * 32)
        window = None
        if raw.get("sliding_window") is not None:
            window = integer(raw, "sliding_window", source)
            window = None if window >= max_position else window
        return ModelConfig(
            model_type="mixtral",
            vocab_size=integer(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=integer(raw, "num_hidden_layers", source),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number(raw, "rms_norm_eps", source, 1e-5),
            max_position_embeddings=max_position,
            rope=rope,
            tie_word_embeddings=flag(raw, "tie_word_embeddings", source, False),
            sliding_window=window,
            bos_token_id=bos_id(raw, source),
            eos_token_ids=eos_ids(raw, source),
            torch_dtype=dtype_name(raw, source),
            quantization=parse_quantization(raw, source),
            moe=MoEConfig(experts=experts, top_k=top_k, intermediate_size=intermediate),
        )

    def hf_name(self, stored: str) -> str | None:
        name = stored.removeprefix("model.")
        expert = _EXPERT.fullmatch(name)
        if expert is not None:
            layer, index, part, attr = expert.groups()
            return f"{layer}.mlp.experts.{index}.{_PROJECTION[part]}.{attr}"
        return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")

    def gguf_tensor(
        self, cfg: ModelConfig, name: str, rows: torch.Tensor, ne: tuple[int, ...]
    ) -> torch.Tensor:
        return unpermute_qk(cfg, name, rows, ne)


MIXTRAL = Mixtral()
