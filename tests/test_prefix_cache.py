"""PrefixCache: exact prefix keys, rows as the unit of storage and LRU eviction, the model's
dtype kept, and a byte bound on the memory really held."""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from offload.machine import PeakMemory
from speculative.logit_slots import LogitSlots, Slot, chunk_sizes
from speculative.prefix_cache import (
    EMPTY_PREFIX,
    ENTRY_OVERHEAD,
    ENTRY_SHARE,
    PrefixCache,
    slot_bytes,
)


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
    assert cache.put_rows(keys, logits) == 3
    got = cache.get(keys[2])
    assert got is not None and torch.equal(got, logits[2]) and got.dtype == torch.float32
    assert cache.get(cache.key([5, 8])) is None
    assert cache.stats.hits == 1 and cache.stats.misses == 1


def test_a_hit_is_a_copy_not_a_view_of_the_slot():
    cache = PrefixCache()
    k = cache.key([1])
    cache.put_rows([k], torch.ones(1, 4))
    got = cache.get(k)
    assert got is not None
    got += 1
    again = cache.get(k)
    assert again is not None and torch.equal(again, torch.ones(4))


def test_rows_are_kept_in_the_models_dtype_exactly():
    """The head computes in bf16 and the model casts to fp32: storing bf16 loses nothing."""
    head_out = torch.randn(3, 1000).to(torch.bfloat16)
    logits = head_out.float()  # what forward() returns
    cache = PrefixCache(dtype=torch.bfloat16)
    keys = [cache.key([i]) for i in range(3)]
    cache.put_rows(keys, logits)
    assert cache.row_bytes == 1000 * 2
    assert cache.bytes == 3 * (2000 + ENTRY_OVERHEAD)
    for i, k in enumerate(keys):
        got = cache.get(k)
        assert got is not None and torch.equal(got, logits[i])


def test_a_store_larger_than_the_cache_keeps_its_first_rows():
    """The old cache dropped a whole (N, V) block larger than itself; rows are stored one
    by one, the most valuable (first) ones, and they never evict each other."""
    cache = PrefixCache(max_bytes=10 * (400 + ENTRY_OVERHEAD))
    old = cache.key([99])
    cache.put_rows([old], torch.zeros(1, 100))
    keys = [cache.key([1, i]) for i in range(50)]
    logits = torch.arange(50.0)[:, None].expand(50, 100)  # (50, 100) row i is all i
    order = list(reversed(range(50)))  # value order: row 49 first
    stored = cache.put_rows([keys[i] for i in order], logits, order)
    assert stored == cache.rows and 0 < stored < 50
    assert cache.bytes <= cache.max_bytes
    assert cache.get(old) is None  # an older row made room
    kept = [i for i in range(50) if cache.get(keys[i]) is not None]
    assert kept == list(range(50 - stored, 50))  # the first `stored` of the value order
    row = cache.get(keys[49])
    assert row is not None and float(row[0]) == 49


def test_slot_memory_is_powers_of_two_within_the_bound():
    assert chunk_sizes(100 << 20) == [32 << 20] * 3 + [4 << 20]
    assert sum(chunk_sizes(1_234_567)) == 1_234_567
    assert all(s & (s - 1) == 0 for s in chunk_sizes(1_234_567))
    cache = PrefixCache(max_bytes=1 << 20)
    slots = ((1 << 20) - (1 << 20) // ENTRY_SHARE) * 4000 // (4000 + ENTRY_OVERHEAD)
    assert cache.capacity_rows(1000, torch.float32) == sum(s // 4000 for s in chunk_sizes(slots))
    keys = [cache.key([i]) for i in range(400)]
    cache.put_rows(keys, torch.randn(400, 1000))
    held = sum(c.numel() * c.element_size() for c in cache._slots.chunks)
    assert held <= cache.max_bytes
    assert cache.bytes <= cache.max_bytes


def test_a_row_larger_than_the_cache_is_not_stored():
    cache = PrefixCache(max_bytes=1000)
    k = cache.key([1])
    assert cache.put_rows([k], torch.zeros(1, 1000)) == 0
    assert cache.get(k) is None and cache.bytes <= cache.max_bytes


def test_zero_sized_cache_holds_nothing():
    cache = PrefixCache(max_bytes=0)
    k = cache.key([1, 2])
    cache.put_rows([k], torch.zeros(1, 8))
    assert cache.get(k) is None and cache.bytes == 0 and len(cache) == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=">= 0"):
        PrefixCache(max_bytes=-1)
    cache = PrefixCache()
    with pytest.raises(ValueError, match="keys"):
        cache.put_rows([cache.key([1])], torch.zeros(2, 4), [0, 1])
    with pytest.raises(ValueError, match="outside"):
        cache.put_rows([cache.key([1])], torch.zeros(2, 4), [2])


V = 16384  # 64 KiB fp32 rows: interned prefixes (ENTRY_OVERHEAD each) are small beside them


def _cache_for_rows(max_bytes: int = 1 << 20) -> tuple[PrefixCache, int]:
    cache = PrefixCache(max_bytes=max_bytes)
    return cache, cache.capacity_rows(V, torch.float32)


def test_lru_by_row_and_the_byte_bound():
    cache, capacity = _cache_for_rows()
    assert 10 < capacity < (1 << 20) // (4 * V)
    keys = []
    for t in range(capacity + 5):
        keys.append(cache.key([t]))
        cache.put_rows(keys[-1:], torch.full((1, V), float(t)))
        assert cache.get(keys[0]) is not None  # used by every sample: kept
        assert cache.bytes <= cache.max_bytes and cache.rows <= capacity
    assert cache.rows == capacity
    assert [t for t in range(1, 8) if cache.get(keys[t]) is None] == [1, 2, 3, 4, 5]
    for t in (6, capacity + 4):
        row = cache.get(keys[t])
        assert row is not None and float(row[0]) == t
    assert cache.stats.evictions == 5


def test_the_most_valuable_row_of_a_store_is_the_last_to_go():
    cache, capacity = _cache_for_rows()
    a = [cache.key([1, i]) for i in range(capacity)]
    cache.put_rows(a, torch.zeros(capacity, V))  # a[0] most valuable
    b = cache.key([2])
    cache.put_rows([b], torch.zeros(1, V))  # needs one slot: the least valuable row's
    assert cache.get(a[-1]) is None
    assert all(cache.get(k) is not None for k in [*a[:-1], b])


def test_walked_rows_outlive_rows_that_were_only_verified():
    """A round stores its walked path first; later rounds' unwalked nodes must not push
    earlier paths out, or the next sample of a prompt finds nothing to walk."""
    cache, capacity = _cache_for_rows()
    paths = []
    for r in range(3):
        keys = [cache.key([r, i]) for i in range(capacity)]  # a tree as large as the cache
        assert cache.put_rows(keys, torch.full((capacity, V), float(r)), walked=2) > 2
        paths.append(keys[:2])
    for r, path in enumerate(paths):
        for k in path:
            row = cache.get(k)
            assert row is not None and float(row[0]) == r
    assert cache.rows == capacity and cache.bytes <= cache.max_bytes


def test_a_long_prompt_keeps_the_path_to_its_rows():
    """A prompt's prefixes are interned before any row below them; with more of them than
    the index's share (a 32k-token prompt is 16 MiB of prefixes) the cache must drop bare
    leaves, never the prompt's first prefixes: that cut every row of its trees off, and a
    regenerated answer found nothing (bench_scale at context 32,768: 0 hits)."""
    cache, capacity = _cache_for_rows()
    prompt = list(range(3 * cache.max_bytes // ENTRY_SHARE // ENTRY_OVERHEAD))
    root = cache.key(prompt)
    stale = [cache.key([10**6, i]) for i in range(50)]  # bare leaves of an older request
    tree = [root, *(cache.child(root, 10**6 + i) for i in range(capacity - 1))]
    cache.put_rows(tree, torch.ones(capacity, V), walked=1)
    assert cache.bytes <= cache.max_bytes
    assert cache.key(prompt) == root, "the prompt's prefixes are still interned"
    assert cache.get(root) is not None
    # Bare leaves went first, the oldest first: the stale request's, then the tree's own
    # unwalked nodes' rows if room was still short.
    assert cache.key([10**6, 0]) != stale[0]


def test_a_finished_long_prompt_makes_room_for_the_next_one():
    """Two long prompts in turn, each with a tree: the first one's prefixes (its rows gone)
    are older than anything the second stores, and must go before the second's rows, or a
    cache that holds one prompt's prefixes and tree stores nothing for the second."""
    cache, capacity = _cache_for_rows()
    length = cache.max_bytes // 2 // ENTRY_OVERHEAD  # each prompt: half the cache in prefixes
    roots = []
    for p in range(2):
        prompt = [10**6 * (p + 1) + i for i in range(length)]
        root = cache.key(prompt)
        tree = [root, *(cache.child(root, i) for i in range(capacity))]
        assert cache.put_rows(tree, torch.ones(len(tree), V), walked=1) >= 1
        assert cache.bytes <= cache.max_bytes
        roots.append((prompt, root))
    prompt, root = roots[1]
    assert cache.key(prompt) == root and cache.get(root) is not None  # regenerate: a hit


def test_a_hit_protects_its_row():
    cache, capacity = _cache_for_rows()
    first = [cache.key([0, i]) for i in range(capacity)]
    cache.put_rows(first, torch.zeros(capacity, V))  # nothing walked
    assert cache.get(first[-1]) is not None  # a sample walked through it
    later = [cache.key([1, i]) for i in range(capacity)]
    assert cache.put_rows(later, torch.ones(capacity, V)) == capacity - 1
    assert cache.get(first[-1]) is not None
    assert all(cache.get(k) is None for k in first[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_from_a_gpu_live_in_pinned_host_memory_and_come_back_exactly():
    base = torch.cuda.memory_allocated()  # what earlier tests in this process still hold
    logits = torch.randn(300, 32_000, device="cuda").to(torch.bfloat16).float()  # (N, V)
    cache = PrefixCache(max_bytes=8 << 20, dtype=torch.bfloat16, pin=True)
    keys = [cache.key([i]) for i in range(300)]
    stored = cache.put_rows(keys, logits)
    assert 0 < stored < 300  # 8 MiB holds ~130 rows of 64 KB
    assert all(chunk.is_pinned() and chunk.device.type == "cpu" for chunk in cache._slots.chunks)
    assert torch.cuda.memory_allocated() - base < 2 * logits.numel() * 4  # no device copy kept
    for i in range(stored):
        row = cache.get(keys[i])
        assert row is not None and row.device.type == "cuda" and torch.equal(row, logits[i])
    # A slot reused by a later store must not change a row already handed out.
    held = cache.get(keys[0])
    assert held is not None
    more = [cache.key([1000 + i]) for i in range(300)]
    cache.put_rows(more, -logits)
    torch.cuda.synchronize()
    assert torch.equal(held, logits[0])


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="the CPU peak probe needs Linux /proc"
)
def test_the_charge_per_prefix_covers_what_interning_allocates():
    """The cache's byte bound counts ENTRY_OVERHEAD per interned prefix; the records, tuples
    and dict slots of 100k fresh prefixes (a long prompt's worth, several times) must not
    take more than that, dict growth included, or the bound (and the memory plan, which
    reserves the configured size) would not hold."""
    n = 100_000
    cache = PrefixCache(max_bytes=1 << 40)  # never evicts here
    with PeakMemory("cpu") as peak:
        cache.key(range(1_000, 1_000 + n))
    assert len(cache) == n and cache.bytes == n * ENTRY_OVERHEAD
    assert peak.bytes is not None and peak.bytes <= n * ENTRY_OVERHEAD, peak.bytes / n


def _row(tokens: Sequence[int], vocab: int = V) -> torch.Tensor:
    """The logits after `tokens`: a function of the prefix, as the target's are."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(hash(tuple(tokens))))


def _check(cache: PrefixCache) -> None:
    """The bound on memory held, and the bookkeeping it rests on."""
    chunks = cache._slots.chunks
    assert cache.held_bytes <= cache.limit <= cache.max_bytes
    assert cache.allocated_bytes + len(cache) * ENTRY_OVERHEAD <= cache.max_bytes
    assert cache.allocated_bytes == sum(c.untyped_storage().nbytes() for c in chunks)
    assert cache.bytes == cache.rows * cache.row_bytes + len(cache) * ENTRY_OVERHEAD
    assert cache.rows + cache._slots.free == sum(c.shape[0] for c in chunks)


def test_a_long_prompt_into_a_full_cache_stays_within_the_bound_in_memory():
    """What the cache holds in memory, not only in its accounting, stays within max_bytes:
    slot chunks allocated plus ENTRY_OVERHEAD per interned prefix. A long prompt interned
    into a cache whose slots are all allocated evicts rows for its prefixes, and their
    memory must go too: once the rows left fit in fewer chunks the last one is freed.
    bench_scale at context 32,768 (vocabulary 128,256, budget 256) had 122 MiB of slots
    plus a 32k prompt's prefixes (11 MiB resident) in a 126 MiB cache, above its plan."""
    cache, capacity = _cache_for_rows()
    tree = [cache.child(EMPTY_PREFIX, i) for i in range(capacity)]
    assert cache.put_rows(tree, torch.stack([_row([i]) for i in range(capacity)]), walked=1)
    chunks, full = len(cache._slots.chunks), cache.allocated_bytes
    assert cache._entries[tree[-1]].slot == (chunks - 1, 0)  # lowest free slots first
    hit = range(capacity // 2, capacity)  # the rows of the last chunks: kept, to be moved
    assert all(cache.get(tree[i]) is not None for i in hit)
    prompt = cache.key([10**6])
    for i in range(cache.max_bytes // 4 // ENTRY_OVERHEAD):
        prompt = cache.child(prompt, i)
        _check(cache)
    assert cache.allocated_bytes < full and len(cache._slots.chunks) < chunks
    kept = [i for i in range(capacity) if cache.get(tree[i]) is not None]
    assert len(kept) == cache.rows and set(hit) <= set(kept)  # walked rows outlived others
    assert cache._entries[tree[-1]].slot[0] < len(cache._slots.chunks)
    for i in kept:
        row = cache.get(tree[i])
        assert row is not None and torch.equal(row, _row([i]))


def test_shrink_frees_whole_chunks_and_the_rows_kept_are_exact():
    """Memory pressure: `shrink` evicts least recently used rows, moves the rest out of the
    last chunks and frees them (the tensors go); `restore` lets the cache grow again."""
    cache, capacity = _cache_for_rows()
    keys = [cache.key([t]) for t in range(capacity)]
    for t, k in enumerate(keys):  # one store each: keys[0] is the least recently used
        cache.put_rows([k], _row([t])[None])
    chunks = [weakref.ref(c) for c in cache._slots.chunks]
    assert len(chunks) > 2 and cache.rows == capacity
    held, limit = cache.held_bytes, cache.max_bytes * 3 // 4  # chunks of 1/2, 1/4, 1/8 ...
    freed = cache.shrink(limit)
    gc.collect()
    assert freed == held - cache.held_bytes > held // 4
    _check(cache)
    assert cache.held_bytes <= limit == cache.limit
    alive = [c for c in chunks if c() is not None]
    assert alive and len(alive) == len(cache._slots.chunks) < len(chunks)
    assert cache.allocated_bytes == sum(c().untyped_storage().nbytes() for c in alive)
    kept = [t for t in range(capacity) if cache.get(keys[t]) is not None]
    assert kept == list(range(capacity - cache.rows, capacity))  # the most recent ones
    for t in kept:
        row = cache.get(keys[t])
        assert row is not None and torch.equal(row, _row([t]))
    # While shrunk a store stays within the lower bound; restored, the cache fills again.
    more = [cache.key([1000 + t]) for t in range(capacity)]
    cache.put_rows(more, torch.stack([_row([1000 + t]) for t in range(capacity)]))
    _check(cache)
    assert cache.held_bytes <= cache.limit == limit
    cache.restore()
    assert cache.limit == cache.max_bytes
    more = [cache.key([1000 + t]) for t in range(capacity)]  # some went to make room
    cache.put_rows(more, torch.stack([_row([1000 + t]) for t in range(capacity)]))
    assert cache.rows == capacity and len(cache._slots.chunks) == len(chunks)
    _check(cache)


def test_shrink_to_nothing_and_back():
    cache, capacity = _cache_for_rows()
    keys = [cache.key([1, t]) for t in range(capacity)]
    cache.put_rows(keys, torch.ones(capacity, V))
    held = cache.held_bytes
    assert cache.shrink(0) == held and cache.held_bytes == 0
    assert len(cache) == 0 and cache.rows == 0 and not cache._slots.chunks
    assert cache.max_bytes and cache.capacity_rows(V, torch.float32) == 0  # still on
    k = cache.key([1, 2, 3])  # keys still come (a running request's), none is kept
    assert cache.put_rows([k], torch.ones(1, V)) == 0 and cache.held_bytes == 0
    cache.restore()
    k = cache.key([1, 2, 3])
    assert cache.put_rows([k], torch.ones(1, V)) == 1
    _check(cache)
    with pytest.raises(ValueError, match=">= 0"):
        cache.shrink(-1)


def test_storing_a_prefix_may_drop_its_own_leaves_but_not_itself():
    """Room for a chunk is made by dropping the oldest bare leaves; a key's only child is
    one (a tree stores parents first), and the key, a leaf again, must not go with it."""
    cache, _ = _cache_for_rows()
    smallest = min(s for s in chunk_sizes(slot_bytes(cache.max_bytes, 4 * V)) if s >= 4 * V)
    # Prefixes leave room for the smallest chunk only once two of them are gone.
    tokens = list(range((cache.max_bytes - smallest) // ENTRY_OVERHEAD - 1))
    prompt = cache.key(tokens)
    parent = cache.child(prompt, 1)
    leaf = cache.child(parent, 2)  # the oldest bare leaf
    other = cache.child(prompt, 3)  # then the parent, a leaf again, and then this one
    assert cache.held_bytes + smallest == cache.max_bytes + 2 * ENTRY_OVERHEAD
    assert cache.put_rows([parent, leaf], torch.stack([_row([1]), _row([2])])) == 1
    _check(cache)
    assert len(cache) == len(tokens) + 1  # the leaves went, the parent stayed
    row = cache.get(parent)
    assert row is not None and torch.equal(row, _row([1]))
    assert cache.child(prompt, 3) != other and cache.child(parent, 2) != leaf


def test_a_release_moves_each_row_to_a_free_slot_exactly():
    """Rows of the last chunk go to the lowest free slots of the others, in runs or alone."""
    vocab = 64
    slots = LogitSlots(vocab, torch.bfloat16, [1 << 10, 1 << 9, 1 << 9])  # 8, 4, 4 rows
    while slots.grow(1 << 20):
        pass
    rows = {key: torch.randn(vocab).to(torch.bfloat16) for key in range(1, 17)}
    held = {key: slots.take(key) for key in rows}
    for key, slot in held.items():
        slots.write(slot, rows[key])
    for key in (2, 3, 4, 6, 9, 10, 11, 14):  # free slots in runs and alone; 3 rows in the last
        slots.vacate(held.pop(key))
    assert slots.can_release() and slots.allocated == 2 << 10
    moved = dict(slots.release_last())
    assert sorted(moved) == [13, 15, 16] and slots.allocated == 3 << 9
    assert sorted(moved.values()) == [(0, 1), (0, 2), (0, 3)]
    held.update(moved)
    for key, (c, r) in held.items():
        assert torch.equal(slots.chunks[c][r], rows[key]), key


@pytest.mark.parametrize("seed", range(4))
def test_random_stores_lookups_long_prompts_and_shrinks_keep_the_bound_and_the_rows(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every hit is the row stored for its exact prefix, rows moved out of freed chunks
    included, and the memory held stays within the limit after every operation."""
    moved: list[tuple[int, Slot]] = []
    release_last = LogitSlots.release_last

    def counted(slots: LogitSlots) -> list[tuple[int, Slot]]:
        moves = release_last(slots)
        moved.extend(moves)
        return moves

    monkeypatch.setattr(LogitSlots, "release_last", counted)
    rng = random.Random(seed)
    vocab = 256  # 1 KiB rows: chunks of 32, 16, 8 ... KiB
    cache = PrefixCache(max_bytes=64 << 10)
    prompts: list[list[int]] = [[rng.randrange(50) for _ in range(rng.randint(1, 8))]]
    stored: list[list[int]] = []  # prefixes recently stored: most look-ups go there
    hits = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.4:  # a round: a tree below a prompt, its first path walked
            prompt = rng.choice(prompts[-4:])
            seqs = [prompt + [rng.randrange(4) for _ in range(rng.randint(0, 3))] for _ in range(8)]
            seqs = sorted({tuple(q): q for q in seqs}.values(), key=len)  # parents first
            keys = [cache.key(q) for q in seqs]
            logits = torch.stack([_row(q, vocab) for q in seqs])
            cache.put_rows(keys, logits, walked=rng.randint(0, 2))
            stored = [*stored[-40:], *seqs]
        elif op < 0.85:  # a look-up
            q = rng.choice(prompts) + [rng.randrange(4) for _ in range(rng.randint(0, 3))]
            q = rng.choice(stored) if stored and rng.random() < 0.8 else q
            row = cache.get(cache.key(q))
            if row is not None:
                hits += 1
                assert torch.equal(row, _row(q, vocab)), q
        elif op < 0.92:  # a long prompt (up to half the cache in prefixes)
            n = rng.randint(10, cache.max_bytes // 2 // ENTRY_OVERHEAD)
            prompts.append([rng.randrange(50) for _ in range(n)])
            cache.key(prompts[-1])
        elif op < 0.96:
            held = cache.held_bytes
            freed = cache.shrink(rng.randrange(cache.max_bytes))
            assert freed == held - cache.held_bytes >= 0
        else:
            cache.restore()
        _check(cache)
    assert hits > 20 and moved  # (36-41 hits and 38-46 rows moved at seeds 0-3)
