"""Rotary position embeddings: the inverse-frequency table of a `RopeConfig` (default,
linear, Llama 3.1's piecewise scaling) and its application in the reference's rotate-half
form."""

from __future__ import annotations

import math

import torch

from modeling.config import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), with Llama 3.1's piecewise scaling when asked."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv


def apply_rope(
    x: torch.Tensor,  # (heads, T, hd)
    cos: torch.Tensor,  # (T, hd)
    signed_sin: torch.Tensor,  # (T, hd): sin with its first half negated
) -> torch.Tensor:
    """RoPE in the reference's rotate-half form, x * cos + cat(-x2, x1) * sin, bit for bit:
    cat(-x2, x1) * sin equals roll(x, hd/2) * signed_sin (negation is exact), two kernels
    fewer per call."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
