"""A decoder layer's self-attention, as every architecture here computes it: q/k/v
projections (dense ones stacked into one `FusedLinear`, packed ones the checkpoint's three),
optional q/k norms per head (Qwen3, Gemma 3), RoPE, attention over each sequence's own cache
with the layer's options (scale, sliding window, soft cap: `AttentionOptions`, from the
config), and the output projection. A checkpoint that stores q/k/v as one `qkv_proj`
(Phi-3) keeps it as stored. The shared `build_attn` of llama.cpp's graph builders;
architecture modules compose it with their norms and MLP."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from modeling.config import ModelConfig
from modeling.layers.attention import AttentionOptions, Slots, attend_sequence
from modeling.layers.norms import RMSNorm
from modeling.layers.rope import apply_rope
from modeling.weights.packed import PackedLinear
from modeling.weights.projections import FusedLinear, linear, projection, stacked


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.options = AttentionOptions(
            scale=cfg.attention_scale, window=cfg.layer_window(index), softcap=cfg.attention_softcap
        )
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        # Dense: one stacked projection (see FusedLinear); packed: the checkpoint's three.
        self.qkv_proj: nn.Linear | PackedLinear | None = None
        self.q_proj: nn.Linear | PackedLinear | None = None
        self.k_proj: nn.Linear | PackedLinear | None = None
        self.v_proj: nn.Linear | PackedLinear | None = None
        if cfg.stored_fused:  # stored as one (Phi-3): kept as stored, packed or not
            self.qkv_proj = projection(cfg, d, q + 2 * kv, cfg.qkv_bias)
        elif cfg.quantization is None:
            parts = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
            self.qkv_proj = FusedLinear(d, parts, cfg.qkv_bias)
        else:
            self.q_proj = projection(cfg, d, q, cfg.qkv_bias)
            self.k_proj = projection(cfg, d, kv, cfg.qkv_bias)
            self.v_proj = projection(cfg, d, kv, cfg.qkv_bias)
        self.o_proj = projection(cfg, cfg.num_heads * hd, d, cfg.o_bias)
        offset = cfg.norm_offset
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        # gpt-oss: each head's learned sink logit, a softmax column with no value
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None

    def stream_state(self) -> AttentionOptions:
        """What a streaming slot takes on to compute this layer (offload/layout.py's
        `layer_states`): layers differ in their window (Gemma 3's local and global)."""
        return self.options

    def load_stream_state(self, options: AttentionOptions) -> None:
        self.options = options

    def forward(
        self,
        x: torch.Tensor,  # (T, hidden): every sequence's new tokens, concatenated
        cos: torch.Tensor,  # (T, head_dim)
        sin: torch.Tensor,  # (T, head_dim), first half negated (see apply_rope)
        sequences: Sequence[Slots],
        layer: int,
    ) -> torch.Tensor:
        """Projections over all T rows at once; each sequence's rows write its own cache
        and attend to it under its own mask (ragged: no cache is padded to another's)."""
        t = x.shape[0]
        heads, kv_heads, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # Dense: one matmul, q, k and v views of its output; packed: one kernel call where
        # the format has one (`stacked`), else three products.
        qkv: torch.Tensor | None
        if self.qkv_proj is not None:
            qkv = linear(self.qkv_proj, x)
        else:
            qkv = stacked((self.q_proj, self.k_proj, self.v_proj), x)
        if qkv is not None:
            qkv = qkv.view(t, -1, hd).transpose(0, 1)  # (H+2Hkv, T, hd)
            qk, v = qkv.split([heads + kv_heads, kv_heads])
            if self.q_norm is None:
                # RoPE is elementwise per head: q's and k's heads rotate in one go.
                q, k = apply_rope(qk, cos, sin).split([heads, kv_heads])  # (H|Hkv, T, hd)
            else:
                q, k = qk.split([heads, kv_heads])
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q = linear(self.q_proj, x).view(t, heads, hd).transpose(0, 1)  # (H, T, hd)
            k = linear(self.k_proj, x).view(t, kv_heads, hd).transpose(0, 1)  # (Hkv, T, hd)
            v = linear(self.v_proj, x).view(t, kv_heads, hd).transpose(0, 1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, after the split
        if qkv is None or self.q_norm is not None:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        if len(sequences) == 1:  # one sequence (most passes): no row slices
            out = attend_sequence(sequences[0], layer, q, k, v, self.options, self.sinks)
        else:
            # Each sequence writes its rows of one output: the plan counts one output per
            # token plus one chunk's (a cat of per-sequence outputs would hold two).
            out = torch.empty_like(q)  # (H, T, hd)
            for seq in sequences:
                rows = slice(seq.row, seq.row + seq.count)
                out[:, rows] = attend_sequence(
                    seq, layer, q[:, rows], k[:, rows], v[:, rows], self.options, self.sinks
                )
        return linear(self.o_proj, out.transpose(0, 1).reshape(t, self.num_heads * self.head_dim))
