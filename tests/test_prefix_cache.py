"""PrefixCache: exact prefix keys, LRU order, and a byte bound on the memory really held."""

from __future__ import annotations

import torch

from speculative.prefix_cache import ENTRY_OVERHEAD, PrefixCache


def test_keys_are_exact_prefix_identities():
    cache = PrefixCache()
    a = cache.key([1, 2, 3])
    assert cache.key([1, 2, 3]) == a
    assert cache.child(cache.key([1, 2]), 3) == a
    assert cache.key([1, 2, 4]) != a and cache.key([2, 1, 3]) != a


def test_put_and_get_rows():
    cache = PrefixCache()
    keys = [cache.key([5]), cache.key([5, 6]), cache.key([5, 7])]
    logits = torch.arange(12.0).view(3, 4)
    cache.put_rows(keys, logits)
    assert torch.equal(cache.get(keys[2]), logits[2])
    assert cache.get(cache.key([5, 8])) is None
    assert cache.stats.hits == 1 and cache.stats.misses == 1


def test_lru_eviction_keeps_bytes_bounded():
    row_bytes = 4 * 100
    cache = PrefixCache(max_bytes=3 * (row_bytes + ENTRY_OVERHEAD))
    keys = []
    for t in range(6):
        k = cache.key([t])
        keys.append(k)
        cache.put_rows([k], torch.full((1, 100), float(t)))
        cache.get(keys[0])  # keep the first one fresh
        assert cache.bytes <= cache.max_bytes
    assert cache.get(keys[0]) is not None  # recently used: kept
    assert cache.get(keys[1]) is None  # oldest: evicted
    assert cache.get(keys[5]) is not None


def test_block_bytes_count_until_its_last_row_goes():
    cache = PrefixCache(max_bytes=10_000)
    keys = [cache.key([i]) for i in range(4)]
    cache.put_rows(keys, torch.zeros(4, 100))  # 1,600 bytes
    assert cache.bytes == 4 * ENTRY_OVERHEAD + 1600
    cache.put_rows(keys[:3], torch.ones(3, 100))  # rows move; old block lives through keys[3]
    assert cache.bytes == 4 * ENTRY_OVERHEAD + 1600 + 1200
    cache.put_rows(keys[3:], torch.ones(1, 100))
    assert cache.bytes == 4 * ENTRY_OVERHEAD + 1200 + 400


def test_zero_sized_cache_holds_nothing():
    cache = PrefixCache(max_bytes=0)
    k = cache.key([1, 2])
    cache.put_rows([k], torch.zeros(1, 8))
    assert cache.get(k) is None and cache.bytes == 0 and len(cache) == 0
