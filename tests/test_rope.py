"""RoPE tables and their application against the definitions: partial rotary (only the
first dimensions of each head turn, as Phi-3 and GLM apply it) and YaRN's attention factor
(its frequencies are checked against transformers in test_model_parity.py)."""

from __future__ import annotations

import math

import torch

from modeling.config import RopeConfig
from modeling.layers.rope import apply_rope, rope_attention_factor, rope_inv_freq, rotary_dim


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_partial_rotary_turns_only_the_first_dimensions() -> None:
    rope = RopeConfig(theta=10000.0, partial_rotary_factor=0.5)
    hd = 16
    r = rotary_dim(hd, rope)
    assert r == 8
    inv = rope_inv_freq(hd, rope)  # (r/2,)
    assert inv.shape == (4,)
    torch.testing.assert_close(inv, 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    positions = torch.arange(5).float()
    freqs = positions[:, None] * inv[None, :]  # (T, r/2)
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)  # (T, r)
    sin = torch.cat((freqs.sin(), freqs.sin()), -1)
    x = torch.randn(3, 5, hd, generator=torch.Generator().manual_seed(1))
    want = torch.cat((x[..., :r] * cos + _rotate_half(x[..., :r]) * sin, x[..., r:]), -1)
    signed = torch.cat((-freqs.sin(), freqs.sin()), -1)
    torch.testing.assert_close(apply_rope(x, cos, signed), want)


def test_yarn_attention_factor() -> None:
    assert rope_attention_factor(RopeConfig()) == 1.0
    yarn = RopeConfig(kind="yarn", factor=4.0)
    assert math.isclose(rope_attention_factor(yarn), 0.1 * math.log(4.0) + 1.0)
    given = RopeConfig(kind="yarn", factor=4.0, attention_factor=0.8)
    assert rope_attention_factor(given) == 0.8
    both = RopeConfig(kind="yarn", factor=40.0, mscale=1.0, mscale_all_dim=0.5)
    ratio = (0.1 * math.log(40.0) + 1.0) / (0.05 * math.log(40.0) + 1.0)
    assert math.isclose(rope_attention_factor(both), ratio)
    assert rope_attention_factor(RopeConfig(kind="yarn", factor=1.0)) == 1.0
