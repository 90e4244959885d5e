"""The target's next-token logits per prefix, in a bounded cache with LRU eviction by row.

Every verified tree node leaves the target's logits after its prefix; keeping them lets a
later round (the next sample of the same prompt, a regenerated chat turn) walk through
already-verified continuations without a target pass. Logits, not final distributions,
are stored: they depend only on the tokens, so one entry serves any sampling parameters
and any penalty state.

Keys are exact, not hashes of the whole prefix: a prefix is interned as a node of a trie,
its id given by (id of the prefix one token shorter, last token). Interning costs one dict
look-up per token, so extending a key along a tree path is O(1) per node. Ids are never
reused; when an entry is evicted its edge goes too, and whatever hung below it becomes
unreachable and ages out.

Rows are the unit of storage, accounting and eviction: each stored row is one vocabulary
row in a preallocated slot, so a store of a 1,024-node tree at vocabulary 128k keeps as
many of its rows as fit instead of nothing. Rows are kept in the model's compute dtype:
the head computes in that dtype and the model casts to fp32 afterwards, so the round trip
is exact. Slots live in host memory (pinned when the logits come from a GPU: a store is a
device→host copy per row, a hit copies one row back), in chunks whose sizes are powers of
two adding up to at most `max_bytes`, allocated only when rows need them; a pinned
allocation of a power of two is not rounded up by the host allocator.

Eviction is least recently used by row, in two segments: rows a walk went through (the
accepted path of the round that stored them, or any row since hit) outlive rows that were
only verified. A tree stores hundreds of rows of which a walk uses a handful; without the
segments each round's unwalked nodes would push every earlier round's path out, and the
next sample of the same prompt would find nothing to walk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

EMPTY_PREFIX = 0  # id of the empty sequence, the trie's root
# Bytes charged per interned prefix: its record, its edge tuple and ids, and its slots in
# the three dicts that index it (with their spare capacity and the copy a dict makes as
# it grows). Measured at about 410 bytes per prefix on CPython 3.11 (x86-64) for 100k
# prefixes; tests/test_prefix_cache.py holds the charge above what interning allocates.
ENTRY_OVERHEAD = 512
# 1 GiB holds ~4,000 rows at vocabulary 128k in bf16: the verified trees of a few rounds at
# budget 1,024, or every row of a few hundred rounds of a small budget.
DEFAULT_MAX_BYTES = 1 << 30
CHUNK_BYTES = 32 << 20  # slot memory is allocated in pieces of at most this many bytes
ENTRY_SHARE = 64  # 1/64 of the size is kept for interned prefixes (16 MiB: 32k of them)


@dataclass(slots=True)
class _Entry:
    edge: tuple[int, int]  # (parent id, token)
    slot: tuple[int, int] | None = None  # (chunk, row) holding the logits after this prefix
    store: int = 0  # the put_rows call that wrote the row
    walked: bool = False  # a walk went through this row: kept before unwalked rows
    children: int = 0  # interned prefixes one token longer


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # rows dropped to make room (entries whose row went)


def chunk_sizes(max_bytes: int, chunk: int = CHUNK_BYTES) -> list[int]:
    """Powers of two adding up to `max_bytes`: full chunks, then the binary digits of the
    rest (a pinned buffer of 2^k bytes takes exactly 2^k bytes of RAM)."""
    sizes = [chunk] * (max_bytes // chunk)
    rest = max_bytes % chunk
    while rest:
        part = 1 << (rest.bit_length() - 1)
        sizes.append(part)
        rest -= part
    return sizes


class PrefixCache:
    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        dtype: torch.dtype | None = None,
        pin: bool = False,
    ) -> None:
        """`dtype`: the dtype rows are kept in (the model's compute dtype; None keeps the
        logits' own). `pin`: allocate slots in pinned memory (the logits come from a GPU)."""
        if max_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.dtype = dtype
        self.pin = pin
        self.bytes = 0  # held rows × row bytes + interned prefixes × ENTRY_OVERHEAD
        self.row_bytes = 0  # set by the first store (vocabulary × dtype size)
        self._ids: dict[tuple[int, int], int] = {}
        self._entries: dict[int, _Entry] = {}  # every interned prefix
        # Interned prefixes without a row and without children (the only bare ones that may
        # go: dropping an inner prefix would cut every row below it off), least recently
        # used first; and those holding a row: walked and unwalked, least recently used first.
        self._bare: OrderedDict[int, None] = OrderedDict()
        self._walked: OrderedDict[int, None] = OrderedDict()
        self._unwalked: OrderedDict[int, None] = OrderedDict()
        self._free: list[tuple[int, int]] = []  # (chunk, row) slots emptied by eviction
        self._chunks: list[torch.Tensor] = []  # (rows, V) slot storage allocated so far
        self._fresh = 0  # rows of the last chunk handed out so far
        self._sizes: list[int] = []  # chunk byte sizes not allocated yet
        self._device = torch.device("cpu")  # where the logits come from and hits go back
        self._vocab = 0
        self._next_id = EMPTY_PREFIX + 1  # ids are never reused, not even after clear()
        self._store = 0  # put_rows calls so far
        self._capacity = (0, 0)  # (row bytes, rows that fit)
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def rows(self) -> int:
        """Rows held now."""
        return len(self._walked) + len(self._unwalked)

    @property
    def allocated_bytes(self) -> int:
        """Slot memory allocated so far (chunks are allocated as rows need them and kept
        until `clear`): at most `max_bytes`, what the memory plan reserves."""
        return sum(chunk.nbytes for chunk in self._chunks)

    def slot_bytes(self, row_bytes: int) -> int:
        """Bytes for row slots: what is left when a share is kept for interned prefixes
        without a row (which would otherwise be evicted first, and with them the way to
        every row below them) and each row's own prefix is paid for."""
        rows_and_their_prefixes = self.max_bytes - self.max_bytes // ENTRY_SHARE
        return rows_and_their_prefixes * row_bytes // (row_bytes + ENTRY_OVERHEAD)

    def capacity_rows(self, vocab_size: int, dtype: torch.dtype) -> int:
        """How many rows of `vocab_size` logits in `dtype` the slots can hold."""
        row = vocab_size * torch.empty((), dtype=self.dtype or dtype).element_size()
        if self._capacity[0] != row:  # asked every round: computed once per row size
            self._capacity = (row, sum(size // row for size in chunk_sizes(self.slot_bytes(row))))
        return self._capacity[1]

    def child(self, prefix: int, token: int) -> int:
        """The id of `prefix` extended by `token` (interned on first use)."""
        edge = (prefix, token)
        key = self._ids.get(edge)
        if key is None:
            key = self._next_id
            self._next_id += 1
            self._ids[edge] = key
            self._entries[key] = _Entry(edge)
            self._bare[key] = None
            parent = self._entries.get(prefix)
            if parent is not None:
                parent.children += 1
                self._bare.pop(prefix, None)  # an inner prefix now
            self.bytes += ENTRY_OVERHEAD
            self._evict()
        elif key in self._bare:
            self._bare.move_to_end(key)  # in use: a prompt or path still goes through it
        return key

    def key(self, tokens: Sequence[int], prefix: int = EMPTY_PREFIX) -> int:
        """The id of `prefix` extended by all of `tokens`."""
        for t in tokens:
            prefix = self.child(prefix, t)
        return prefix

    def get(self, key: int) -> torch.Tensor | None:
        """The target's logits (V,) fp32 after the prefix `key`, on the device they were
        stored from, or None."""
        entry = self._entries.get(key)
        if entry is None or entry.slot is None:
            self.stats.misses += 1
            return None
        self._segment(entry).pop(key)
        entry.walked = True  # a sample walks through it: worth keeping
        self._walked[key] = None
        self.stats.hits += 1
        # A copy, never a view of the slot (a later store may reuse it). From pinned memory
        # it is asynchronous on the current stream, which orders it before any later
        # device→host copy into the same slot.
        chunk, row = entry.slot
        return self._chunks[chunk][row].to(
            self._device, torch.float32, non_blocking=True, copy=True
        )  # (V,)

    def put_rows(
        self,
        keys: Sequence[int],
        logits: torch.Tensor,
        rows: Sequence[int] | None = None,
        walked: int = 0,
    ) -> int:
        """Store row `rows[i]` of `logits` (N, V) (row i when `rows` is None) as the logits
        after prefix `keys[i]`; the first `walked` keys are the round's walked path. Keys
        come in order of value: when the cache cannot hold them all, the first ones are
        kept and the rest are not stored (older rows are evicted least recently used first,
        unwalked ones before walked ones, and only walked rows evict walked rows; rows of
        this store never evict each other).
        Afterwards the first key is the most recently used. Returns the rows stored."""
        rows = range(len(keys)) if rows is None else rows
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys for {len(rows)} rows")
        if len(rows) and not 0 <= min(rows) <= max(rows) < logits.shape[0]:
            raise ValueError(f"row index outside the {logits.shape[0]} rows of logits")
        if not self.max_bytes or not keys:
            return 0
        self._configure(logits)
        self._store += 1
        stored: list[int] = []
        for i, (key, r) in enumerate(zip(keys, rows, strict=True)):
            entry = self._entries.get(key)
            if entry is None:
                continue  # evicted (byte bound) while the keys were being interned
            if entry.slot is None:
                entry.slot = self._slot(take_walked=entry.walked or i < walked)
                if entry.slot is None:
                    break  # every slot it may take holds a more valuable row
                self._bare.pop(key, None)  # (an inner prefix is in no index)
                self.bytes += self.row_bytes
            else:
                self._segment(entry).pop(key)
            entry.store = self._store
            entry.walked = entry.walked or i < walked
            self._segment(entry)[key] = None  # at the back: this store's rows go last
            chunk, row = entry.slot
            # Into a pinned slot the copy is asynchronous on the current stream; nothing on
            # the host reads slots, and a hit's copy back is queued behind it.
            self._chunks[chunk][row].copy_(logits[r], non_blocking=self.pin)
            stored.append(key)
        for key in reversed(stored):  # most valuable last: the most recently used
            self._segment(self._entries[key]).move_to_end(key)
        self._evict()
        return sum(1 for k in stored if k in self._walked or k in self._unwalked)

    def _segment(self, entry: _Entry) -> OrderedDict[int, None]:
        return self._walked if entry.walked else self._unwalked

    def _configure(self, logits: torch.Tensor) -> None:
        dtype = self.dtype or logits.dtype
        row_bytes = logits.shape[1] * torch.empty((), dtype=dtype).element_size()
        if self.row_bytes == row_bytes and self._device == logits.device:
            return
        if self.row_bytes:  # another vocabulary or device: start over
            self.clear()
        self.dtype, self.row_bytes, self._device = dtype, row_bytes, logits.device
        self._vocab = logits.shape[1]
        self._sizes = [s for s in chunk_sizes(self.slot_bytes(row_bytes)) if s >= row_bytes]

    def clear(self) -> None:
        """Drop every row and every interned prefix (slot memory is released too)."""
        for entry in self._entries.values():
            entry.slot = None
        for index in (self._bare, self._walked, self._unwalked):
            index.clear()
        self._entries.clear()
        self._ids.clear()
        self._free, self._chunks, self._fresh = [], [], 0
        self.bytes = 0
        self.row_bytes = 0

    def _slot(self, take_walked: bool) -> tuple[int, int] | None:
        """An empty slot: a free one, a fresh one (allocating a chunk when needed), or the
        least recently used unwalked row's, else (for a walked row only) the least recently
        used walked row's, never one of the current store (whose rows are at the back of
        each segment)."""
        if self._free:
            return self._free.pop()
        if self._chunks and self._fresh < self._chunks[-1].shape[0]:
            self._fresh += 1
            return len(self._chunks) - 1, self._fresh - 1
        if self._sizes:
            size = self._sizes.pop(0)
            chunk = torch.empty(
                (size // self.row_bytes, self._vocab), dtype=self.dtype, pin_memory=self.pin
            )  # (rows, V)
            self._chunks.append(chunk)
            self._fresh = 1
            return len(self._chunks) - 1, 0
        for segment in (self._unwalked, self._walked) if take_walked else (self._unwalked,):
            if segment:
                key = next(iter(segment))
                entry = self._entries[key]
                if entry.store != self._store:
                    return self._take_row(key, entry)
        return None

    def _take_row(self, key: int, entry: _Entry) -> tuple[int, int]:
        """Evict `key`'s row; the prefix stays interned (rows below it stay reachable)."""
        slot = entry.slot
        assert slot is not None, "only entries holding a row are in a row segment"
        del self._segment(entry)[key]
        entry.slot = None
        if not entry.children:
            self._bare[key] = None
        self.bytes -= self.row_bytes
        self.stats.evictions += 1
        return slot

    def _evict(self) -> None:
        """Until the byte bound holds: least recently used bare leaves (prefixes with neither
        a row nor children; their parent may become one) while bare prefixes take more than
        their share, else rows, unwalked ones first (their prefixes stay, without a row: a
        tree's keys are interned before its rows are stored, and must survive that). Leaves
        only: a long prompt's prefixes are interned before the rows below them, so evicting
        by age alone would drop the prompt's first prefix and with it every row of its trees."""
        share = self.max_bytes // ENTRY_SHARE
        while self.bytes > self.max_bytes:
            rows = self._unwalked or self._walked
            bare = len(self._entries) - len(self._walked) - len(self._unwalked)
            if self._bare and (bare * ENTRY_OVERHEAD > share or not rows):
                key, _ = self._bare.popitem(last=False)
                self._drop_prefix(key)
                continue
            if not rows:
                break  # nothing evictable (a bare inner prefix always has a leaf or row below)
            key = next(iter(rows))
            self._free.append(self._take_row(key, self._entries[key]))

    def _drop_prefix(self, key: int) -> None:
        entry = self._entries.pop(key)
        del self._ids[entry.edge]
        self.bytes -= ENTRY_OVERHEAD
        parent = self._entries.get(entry.edge[0])
        if parent is not None:
            parent.children -= 1
            if not parent.children and parent.slot is None:
                self._bare[entry.edge[0]] = None  # a leaf now, as old as its last child was
                self._bare.move_to_end(entry.edge[0], last=False)
