"""The shared attention layer's per-layer options against a plain reference written from
their definitions: the scores' scale, Gemma 2's soft cap, gpt-oss's sink logits, and a
sliding window by position distance (tree nodes share positions, so a window by slot would
be wrong); and the KV cache keeping each slot's position through growth and `keep`."""

from __future__ import annotations

import math

import pytest
import torch

from modeling.config import ModelConfig
from modeling.kv_cache import KVCache
from modeling.layers.attention import AttentionOptions, SequenceSlots, attend, query_chunk

HEADS, KV_HEADS, HD = 4, 2, 8


def reference(q, k, v, allowed, scale, softcap=None, sinks=None):  # type: ignore[no-untyped-def]
    """Per head, per query: softmax over the allowed keys (and the head's sink) of the
    scaled, capped scores, in float64."""
    heads, t, _ = q.shape
    out = torch.zeros(heads, t, v.shape[-1], dtype=torch.float64)
    group = heads // k.shape[0]
    for h in range(heads):
        kh, vh = k[h // group].double(), v[h // group].double()
        for i in range(t):
            s = (kh @ q[h, i].double()) * scale  # (S,)
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~allowed[i], -math.inf)
            parts = [s] if sinks is None else [s, sinks[h : h + 1].double()]
            w = torch.softmax(torch.cat(parts), 0)[: s.shape[0]]
            out[h, i] = w @ vh
    return out


@pytest.mark.parametrize(
    ("scale", "softcap", "with_sinks"),
    [
        (None, None, False),
        (0.07, None, False),
        (None, 1.5, False),
        (None, None, True),
        (0.3, 2.0, True),
    ],
    ids=["plain", "scale", "softcap", "sinks", "all"],
)
def test_attend_options_match_their_definitions(scale, softcap, with_sinks) -> None:
    gen = torch.Generator().manual_seed(5)
    t, s = 5, 11
    q = torch.randn(HEADS, t, HD, generator=gen)
    k = torch.randn(KV_HEADS, s, HD, generator=gen)
    v = torch.randn(KV_HEADS, s, HD, generator=gen)
    allowed = torch.rand(t, s, generator=gen) < 0.7
    allowed[:, 0] = True
    sinks = torch.randn(HEADS, generator=gen) if with_sinks else None
    options = AttentionOptions(scale=scale, softcap=softcap)
    got = attend(q, k, v, allowed, options, sinks)
    want = reference(q, k, v, allowed, HD**-0.5 if scale is None else scale, softcap, sinks)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_sinks_hold_over_query_chunks(monkeypatch) -> None:
    """A pass split into query chunks (the memory bound) gives every chunk the sinks."""
    import modeling.layers.attention as attention_module

    gen = torch.Generator().manual_seed(6)
    q = torch.randn(HEADS, 9, HD, generator=gen)
    k = torch.randn(KV_HEADS, 9, HD, generator=gen)
    v = torch.randn(KV_HEADS, 9, HD, generator=gen)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    sinks = torch.randn(HEADS, generator=gen)
    whole = attend(q, k, v, mask, AttentionOptions(), sinks)
    monkeypatch.setattr(attention_module, "query_chunk", lambda *a, **kw: 2)
    chunked = attend(q, k, v, mask, AttentionOptions(), sinks)
    assert query_chunk(HEADS, 9) >= 9  # the unpatched bound takes the pass in one chunk
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)


def _config(layers: int = 2) -> ModelConfig:
    return ModelConfig(
        model_type="mistral", vocab_size=16, hidden_size=16, intermediate_size=32,
        num_layers=layers, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HD,
        rms_norm_eps=1e-6, max_position_embeddings=64, sliding_window=3,
    )  # fmt: skip


def test_window_is_by_position_not_slot() -> None:
    """A committed prefix of 6 tokens (positions 0-5) and a tree of 4 nodes in slots 6-9:
    two children of the root at position 6, and a grandchild at 7 under each. With a
    window of 3 a node sees keys at positions > its own - 3, whatever slot they sit in."""
    cache = KVCache(_config(), 16, positions=True)
    cache.reserve(6)
    cache.write_positions(0, torch.arange(6))
    cache.commit_append(6)
    positions = torch.tensor([6, 6, 7, 7])
    tree = torch.tensor(
        [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool
    )  # node 2 under 0, node 3 under 1
    mask = torch.ones(4, 10, dtype=torch.bool)
    mask[:, 6:] = tree
    start = cache.reserve(4)
    cache.write_positions(start, positions)
    slots = SequenceSlots(0, 4, cache, start, mask, positions)
    got = slots.mask_for(3)
    want = torch.zeros(4, 10, dtype=torch.bool)
    want[0, [4, 5, 6]] = True  # position 6 sees 4, 5 and itself
    want[1, [4, 5, 7]] = True
    want[2, [5, 6, 8]] = True  # position 7 sees 5, its parent (slot 6) and itself
    want[3, [5, 7, 9]] = True
    assert torch.equal(got, want)
    assert slots.mask_for(None) is mask
    assert slots.mask_for(3) is got  # made once per pass


def test_single_token_window_mask() -> None:
    cache = KVCache(_config(), 16, positions=True)
    cache.reserve(8)
    cache.write_positions(0, torch.arange(8))
    slots = SequenceSlots(0, 1, cache, 7, None, torch.tensor([7]))
    assert slots.mask_for(2).tolist() == [[False] * 6 + [True, True]]


def test_cache_positions_survive_growth_and_keep() -> None:
    cache = KVCache(_config(), 64, initial=4, positions=True)
    cache.reserve(3)
    cache.write_positions(0, torch.tensor([0, 1, 2]))
    cache.commit_append(3)
    start = cache.reserve(5)  # grows past the first 4 slots
    assert cache.allocated >= 8
    cache.write_positions(start, torch.tensor([3, 3, 4, 4, 5]))
    cache.commit_append(5)
    assert cache.positions is not None
    assert cache.positions[:8].tolist() == [0, 1, 2, 3, 3, 4, 4, 5]
    cache.keep([4, 6], start=3)  # the accepted path: slots 4 and 6
    assert cache.length == 5
    assert cache.positions[:5].tolist() == [0, 1, 2, 3, 4]
    assert cache.ring_k is not None  # every layer slides: their entries are the ring's
    kv = cache.k.numel() + cache.ring_k.numel()
    assert cache.nbytes == 2 * kv * 4 + cache.allocated * 8


def test_a_cache_without_windows_keeps_no_positions() -> None:
    cache = KVCache(_config(), 16)
    cache.reserve(2)
    cache.write_positions(0, torch.tensor([0, 1]))
    assert cache.positions is None
