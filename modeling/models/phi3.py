"""Phi-3 and Phi-4 (`phi3`): Phi-3-mini/medium with their sliding window, Phi-4 (14B), and
Phi-4-mini's partial rotary RoPE.

A Llama block whose checkpoint stores q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` (gate's rows first): both are kept as stored, dense or packed, so no tensor
is split at load and a packed one stays packed. The rest is the shared layers': RoPE over
the first `partial_rotary_factor` of each head, the window by position for every layer
when `sliding_window` is set, SwiGLU.

Refused with their key: LongRoPE (`rope_scaling.type: longrope`, Phi-3.5 and the
128k-context Phi-3 and Phi-4-mini), whose short and long factors switch with the sequence's
length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from modeling.architecture import Architecture, LayerActivations, LayerKV
from modeling.config import ModelConfig, UnsupportedModelError, eos_ids, required, rope_config
from modeling.layers.attention import Slots
from modeling.layers.mlp import MLP
from modeling.layers.norms import RMSNorm, norm_bytes
from modeling.layers.self_attention import Attention
from modeling.weights.quant import parse_quantization


class Phi3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden)
        cos: torch.Tensor,
        sin: torch.Tensor,
        sequences: Sequence[Slots],
        layer: int,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, sequences, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Phi3(Architecture):
    name: ClassVar[str] = "phi3"
    model_types: ClassVar[tuple[str, ...]] = ("phi3",)

    def config(self, raw: dict[str, Any], source: str) -> ModelConfig:
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act {act!r} is not supported by Phi-3 (only 'silu')"
            )
        hidden = int(required(raw, "hidden_size", source))
        heads = int(required(raw, "num_attention_heads", source))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads < 1 or kv_heads < 1 or heads % kv_heads:
            raise UnsupportedModelError(
                f"{source}: num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {kv_heads}"
            )
        head_dim = int(raw.get("head_dim") or hidden // heads)
        rope = rope_config(raw, source)
        rotary = int(head_dim * rope.partial_rotary_factor)
        if rotary < 2 or rotary % 2:
            raise UnsupportedModelError(
                f"{source}: partial_rotary_factor {rope.partial_rotary_factor} turns {rotary} "
                f"of head_dim {head_dim} dimensions; RoPE needs an even number of at least 2"
            )
        window = raw.get("sliding_window")
        max_positions = int(raw.get("max_position_embeddings", 4096))
        if window is not None and int(window) >= max_positions:
            window = None  # covers the whole context: plain full attention
        return ModelConfig(
            model_type="phi3",
            vocab_size=int(required(raw, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(required(raw, "intermediate_size", source)),
            num_layers=int(required(raw, "num_hidden_layers", source)),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=max_positions,
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=None if window is None else int(window),
            stored_fused=True,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids(raw),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            quantization=parse_quantization(raw, source),
        )

    def block(self, cfg: ModelConfig, index: int) -> nn.Module:
        return Phi3Layer(cfg, index)

    def kv_layout(self, cfg: ModelConfig) -> tuple[LayerKV, ...]:
        return tuple(
            LayerKV(cfg.num_kv_heads, cfg.head_dim, cfg.layer_window(i))
            for i in range(cfg.num_layers)
        )

    def layer_parameters(self, cfg: ModelConfig, index: int) -> int:
        d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        return d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d

    def layer_activations(self, cfg: ModelConfig, itemsize: int, copy: int) -> LayerActivations:
        """Traced through `Phi3Layer`: Llama's block with q/k/v and gate/up as stored (one
        output each, as Llama's stacked ones), and partial RoPE's pieces: the rotated part's
        temporaries and the cat that joins it to the part that passes."""
        item = itemsize
        d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd

        def norm(n: int) -> int:
            return norm_bytes(n, item)

        phases = [
            item * d + norm(d),  # input norm
            # x, h, the q/k/v output, and RoPE on q and k in one go (x*cos, roll, roll*sin,
            # their sum and, partial, the cat)
            item * (2 * d + 6 * q + 7 * kv),
            item * (3 * d + 4 * q + 3 * kv),  # output, its copy, o_proj
            3 * item * d,  # residual add
            2 * item * d + norm(d),  # post-attention norm
            item * (3 * d + 3 * f),  # MLP: x, residual, h, gate/up and act(gate)
            4 * item * d,  # the last residual add
        ]
        if copy:
            phases += [
                item * (2 * d + q + 2 * kv) + copy * (q + 2 * kv),
                item * (3 * d + 4 * q + 3 * kv) + copy * d,
                item * (3 * d + 2 * f) + copy * 2 * f,
                item * (4 * d + 3 * f) + copy * d,
            ]
        return LayerActivations(layer=max(phases), attention=item * (2 * d + 3 * q + 3 * kv))


PHI3 = Phi3()
