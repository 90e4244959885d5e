"""Rotary position embeddings: the inverse-frequency table of a `RopeConfig` (default,
linear, Llama 3.1's piecewise scaling, YaRN, LongRoPE's short and long tables), the factor
YaRN and LongRoPE put on cos and sin, and
their application in the reference's rotate-half form, over the whole head or its first
`rotary_dim` dimensions (partial rotary)."""

from __future__ import annotations

import math

import torch

from modeling.config import RopeConfig


def rotary_dim(head_dim: int, rope: RopeConfig) -> int:
    """The dimensions of each head that rotate: all, or the first `partial_rotary_factor`."""
    return int(head_dim * rope.partial_rotary_factor)


def rope_inv_freq(head_dim: int, rope: RopeConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies (rotary_dim/2,), scaled as `rope.kind` says; for LongRoPE the
    short table, or with `long` the table of positions from original_max_position_embeddings
    on (transformers picks by the sequence's length, max position + 1, which token by token
    is each position's own)."""
    dim = rotary_dim(head_dim, rope)
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.kind == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        return 1.0 / (
            torch.tensor(factors, dtype=torch.float32)
            * rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "yarn":
        return _yarn_inv_freq(inv, dim, rope)
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


def _yarn_inv_freq(inv: torch.Tensor, dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN (Peng et al., 2023): frequencies that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those turning more than
    `beta_fast` times kept, a linear ramp between, as transformers computes it."""
    base, old_ctx = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (inv / rope.factor) * (1 - keep) + inv * keep


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor on cos and sin: 1 but for YaRN, whose default is 0.1 ln(factor) + 1 (or the
    ratio of two such with mscale and mscale_all_dim), and LongRoPE, whose default is
    sqrt(1 + ln(factor) / ln(original context))."""
    if rope.kind not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.kind == "longrope":
        if rope.factor <= 1:
            return 1.0
        old = rope.original_max_position_embeddings
        return math.sqrt(1 + math.log(rope.factor) / math.log(old))

    def scale(m: float) -> float:
        return 1.0 if rope.factor <= 1 else 0.1 * m * math.log(rope.factor) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return scale(rope.mscale) / scale(rope.mscale_all_dim)
    return scale(1.0)


def apply_rope(
    x: torch.Tensor,  # (heads, T, hd)
    cos: torch.Tensor,  # (T, rotary_dim)
    signed_sin: torch.Tensor,  # (T, rotary_dim): sin with its first half negated
) -> torch.Tensor:
    """RoPE in the reference's rotate-half form, x * cos + cat(-x2, x1) * sin, bit for bit:
    cat(-x2, x1) * sin equals roll(x, hd/2) * signed_sin (negation is exact), two kernels
    fewer per call. With a partial rotary table (shorter than the head) only the first
    dimensions rotate; the rest pass unchanged."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + x.roll(r // 2, dims=-1) * signed_sin
    turned, kept = x[..., :r], x[..., r:]
    return torch.cat((turned * cos + turned.roll(r // 2, dims=-1) * signed_sin, kept), dim=-1)
