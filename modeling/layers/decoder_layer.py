"""The pre-norm decoder layer most architectures are (Llama, Mistral, Qwen, Phi-3): x +
attention(norm(x)), then x + MLP(norm(x)); and what such a block costs, for the
architecture contract: its exact parameter count and its peak activations per token,
traced through this code and the shared attention and MLP (modules with more norms, Gemma
3's, add theirs to these)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from modeling.architecture import LayerActivations
from modeling.config import ModelConfig
from modeling.layers.attention import Slots
from modeling.layers.mlp import MLP
from modeling.layers.norms import RMSNorm, norm_bytes
from modeling.layers.rope import rotary_dim
from modeling.layers.self_attention import Attention


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0, mlp: nn.Module | None = None) -> None:
        """`mlp`: the block's feed-forward where it is not the shared gated MLP (a mixture of
        experts: modeling/layers/moe.py)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = Attention(cfg, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = mlp if mlp is not None else MLP(cfg)

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


def layer_parameters(cfg: ModelConfig, norms: int = 2) -> int:
    """Exact parameters of a block of the shared attention and MLP with `norms` norms over
    the hidden size."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    attn = d * q + 2 * d * kv + q * d
    if cfg.qkv_bias:
        attn += q + 2 * kv
    if cfg.o_bias:
        attn += d
    if cfg.qk_norm:
        attn += 2 * hd
    if cfg.attention_sinks:
        attn += cfg.num_heads
    mlp = 3 * d * f + ((2 * f + d) if cfg.mlp_bias else 0)
    return attn + mlp + norms * d


def layer_phases(cfg: ModelConfig, item: int, copy: int) -> list[int]:
    """Bytes per token alive at each phase of `DecoderLayer`'s pass in a dtype of `item`
    bytes; `copy`: a packed projection's fp32 buffer per value while its product runs (0
    dense). `x` is the layer's input (held by the caller while the layer runs), `h` its
    norm."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    # Partial rotary joins the turned part to the rest: one more copy of q and k.
    joined = (q + kv) if rotary_dim(hd, cfg.rope) < hd else 0

    def norm(n: int) -> int:
        return norm_bytes(n, item)

    phases = [
        item * d + norm(d),  # input norm
        # x, h, the stacked q/k/v output (q and k views of it), and RoPE on q and k in one
        # go: x*cos, roll, roll*sin (the unstacked projections of packed models hold less)
        item * (2 * d + 4 * q + 5 * kv + joined),
        # output, its (T, H*hd) copy and o_proj; the rotated q and k beside the stacked
        # output, which v (a view of it) keeps alive
        item * (3 * d + 4 * q + 3 * kv),
        3 * item * d,  # residual add
        2 * item * d + norm(d),  # post-attention norm (x and the new residual alive)
        # MLP: x, residual, h, then the stacked gate/up output and act(gate), multiplied
        # by up in place (unstacked: act(gate), up, their product)
        item * (3 * d + 3 * f),
        4 * item * d,  # the last residual add
    ]
    if copy:  # each product while it runs: its inputs, its output and the fp32 buffer
        phases += [
            item * (2 * d + q + 2 * kv) + copy * (q + 2 * kv),  # q/k/v
            item * (3 * d + 4 * q + 3 * kv) + copy * d,  # o_proj: as the phase above
            item * (3 * d + 2 * f) + copy * 2 * f,  # gate/up: x, residual, h
            item * (4 * d + 3 * f) + copy * d,  # down: the MLP phase's tensors and its output
        ]
    if cfg.qk_norm:
        phases += [
            item * (2 * d + q + 2 * kv) + norm(q),  # q norm (beside the q/k/v output)
            item * (2 * d + 2 * q + 2 * kv) + norm(kv),  # k norm (q and its norm alive)
            item
            * (2 * d + 5 * q + 3 * kv + joined),  # RoPE on q: normed q and k, three temporaries
            item * (2 * d + 2 * q + 6 * kv + joined),  # RoPE on k (q done)
        ]
    return phases


def layer_activations(cfg: ModelConfig, itemsize: int, copy: int) -> LayerActivations:
    """`DecoderLayer`'s peak per token, and what attention holds beside its scores: x, h,
    the q/k/v output, rotated q and k, the attention output."""
    hd = cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return LayerActivations(
        layer=max(layer_phases(cfg, itemsize, copy)),
        attention=itemsize * (2 * cfg.hidden_size + 3 * q + 3 * kv),
    )
