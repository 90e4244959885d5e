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

Rows are the unit of storage and eviction: each stored row is one vocabulary row in a
slot, so a store of a 1,024-node tree at vocabulary 128k keeps as many of its rows as fit
instead of nothing. Rows are kept in the model's compute dtype: the head computes in that
dtype and the model casts to fp32 afterwards, so the round trip is exact. Slots live in
host memory (pinned when the logits come from a GPU: a store is a device→host copy per
row, a hit copies one row back), in chunks of power-of-two sizes (speculative/logit_slots.py).

The bound is on memory held, not on rows counted: slot chunks allocated plus
ENTRY_OVERHEAD per interned prefix stay within `limit` (`max_bytes`, or less after
`shrink`) at all times. A chunk is allocated only when it fits beside the prefixes; when
prefixes need room (a 32k-token prompt interns ~16 MiB of them) rows are evicted until
the rows left fit in the chunks before the last, they move there and the last chunk is
freed.

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

from speculative.logit_slots import LogitSlots, Slot, chunk_sizes

EMPTY_PREFIX = 0  # id of the empty sequence, the trie's root (never holds a row: NO_KEY)
# Bytes charged per interned prefix: its record, its edge tuple and ids, and its slots in
# the three dicts that index it (with their spare capacity and the copy a dict makes as
# it grows). Measured at about 410 bytes per prefix on CPython 3.11 (x86-64) for 100k
# prefixes; tests/test_prefix_cache.py holds the charge above what interning allocates.
ENTRY_OVERHEAD = 512
# 1 GiB holds ~4,000 rows at vocabulary 128k in bf16: the verified trees of a few rounds at
# budget 1,024, or every row of a few hundred rounds of a small budget.
DEFAULT_MAX_BYTES = 1 << 30
ENTRY_SHARE = 64  # leaf prefixes (no row, no children) may take 1/64 of the size


@dataclass(slots=True)
class _Entry:
    edge: tuple[int, int]  # (parent id, token)
    slot: Slot | None = None  # (chunk, row) holding the logits after this prefix
    store: int = 0  # the put_rows call that wrote the row
    walked: bool = False  # a walk went through this row: kept before unwalked rows
    children: int = 0  # interned prefixes one token longer
    used: int = 0  # when it was last interned, looked up, stored or hit (the cache's clock)


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # rows dropped to make room (entries whose row went)


def slot_bytes(size: int, row_bytes: int) -> int:
    """Bytes for row slots in a cache of `size`: what is left when a share is kept for
    interned prefixes without a row (which would otherwise be evicted first, and with them
    the way to every row below them) and each row's own prefix is paid for."""
    rows_and_their_prefixes = size - size // ENTRY_SHARE
    return rows_and_their_prefixes * row_bytes // (row_bytes + ENTRY_OVERHEAD)


class PrefixCache:
    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        dtype: torch.dtype | None = None,
        pin: bool = False,
    ) -> None:
        """`max_bytes`: the configured size, what the memory plan reserves (0: off).
        `dtype`: the dtype rows are kept in (the model's compute dtype; None keeps the
        logits' own). `pin`: allocate slots in pinned memory (the logits come from a GPU)."""
        if max_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.limit = max_bytes  # the bound in force: max_bytes, or less while shrunk
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
        self._slots = LogitSlots()  # set up by the first store, for its vocabulary and device
        self._next_id = EMPTY_PREFIX + 1  # ids are never reused, not even after clear()
        self._store = 0  # put_rows calls so far
        self._clock = 0  # ticks on every use of an entry (`_Entry.used`)
        self._capacity = (0, 0, 0)  # (row bytes, limit, rows that fit)
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def rows(self) -> int:
        """Rows held now."""
        return len(self._walked) + len(self._unwalked)

    @property
    def allocated_bytes(self) -> int:
        """Slot memory allocated now: chunks are allocated as rows need them and freed when
        prefixes need their room, on `shrink` and on `clear`."""
        return self._slots.allocated

    @property
    def held_bytes(self) -> int:
        """What the cache holds in memory: slot chunks plus ENTRY_OVERHEAD per interned
        prefix. At most `limit` at all times."""
        return self._slots.allocated + len(self._entries) * ENTRY_OVERHEAD

    def capacity_rows(self, vocab_size: int, dtype: torch.dtype) -> int:
        """How many rows of `vocab_size` logits in `dtype` the slots can hold."""
        row = vocab_size * torch.empty((), dtype=self.dtype or dtype).element_size()
        if self._capacity[:2] != (row, self.limit):  # asked every round: computed once
            rows = sum(size // row for size in chunk_sizes(slot_bytes(self.limit, row)))
            self._capacity = (row, self.limit, rows)
        return self._capacity[2]

    def shrink(self, to_bytes: int) -> int:
        """Memory pressure (DESIGN.md): from now until `restore`, hold at most `to_bytes`
        (`held_bytes`; more than `max_bytes` counts as `max_bytes`). The least recently
        used rows and prefixes go, and chunks are freed as the rows left fit in fewer; the
        cache keeps working within the lower bound (at 0 it keeps nothing). Returns the
        bytes freed (`held_bytes` before less after)."""
        if to_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 bytes, got {to_bytes}")
        held, prefixes = self.held_bytes, len(self._entries)
        self.limit = min(to_bytes, self.max_bytes)
        self._evict()
        if len(self._entries) < prefixes:
            # A dict keeps its table when entries go; a copy is sized to what is left.
            self._ids, self._entries = dict(self._ids), dict(self._entries)
            self._bare, self._walked = OrderedDict(self._bare), OrderedDict(self._walked)
            self._unwalked = OrderedDict(self._unwalked)
        return held - self.held_bytes

    def restore(self) -> None:
        """Undo `shrink`: the bound is `max_bytes` again (chunks are allocated again as
        rows need them)."""
        self.limit = self.max_bytes

    def child(self, prefix: int, token: int) -> int:
        """The id of `prefix` extended by `token` (interned on first use)."""
        edge = (prefix, token)
        key = self._ids.get(edge)
        if key is None:
            key = self._next_id
            self._next_id += 1
            self._ids[edge] = key
            self._entries[key] = _Entry(edge, used=self._tick())
            self._bare[key] = None
            parent = self._entries.get(prefix)
            if parent is not None:
                parent.children += 1
                self._bare.pop(prefix, None)  # an inner prefix now
            self.bytes += ENTRY_OVERHEAD
            self._evict()
        else:
            self._entries[key].used = self._tick()  # a prompt or path still goes through it
            if key in self._bare:
                self._bare.move_to_end(key)
        return key

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

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
        entry.used = self._tick()
        entry.walked = True  # a sample walks through it: worth keeping
        self._walked[key] = None
        self.stats.hits += 1
        return self._slots.read(entry.slot)  # (V,)

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
        kept and the rest are not stored (older rows and bare prefixes are evicted least
        recently used first, unwalked rows before walked ones, and only walked rows evict
        walked rows; rows of this store never evict each other).
        Afterwards the first key is the most recently used. Returns the rows stored."""
        rows = range(len(keys)) if rows is None else rows
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys for {len(rows)} rows")
        if len(rows) and not 0 <= min(rows) <= max(rows) < logits.shape[0]:
            raise ValueError(f"row index outside the {logits.shape[0]} rows of logits")
        if not self.limit or not keys:
            return 0
        self._configure(logits)
        self._store += 1
        stored: list[int] = []
        for i, (key, r) in enumerate(zip(keys, rows, strict=True)):
            entry = self._entries.get(key)
            if entry is None:
                continue  # evicted while the keys were interned, or to make room for a row
            if entry.slot is None:
                self._bare.pop(key, None)  # not a leaf to drop for its own slot
                entry.slot = self._slot(key, take_walked=entry.walked or i < walked)
                if entry.slot is None:
                    if not entry.children:
                        self._bare[key] = None
                    break  # every slot it may take holds a more valuable row
                self.bytes += self.row_bytes
            else:
                self._segment(entry).pop(key)
            entry.store = self._store
            entry.used = self._tick()
            entry.walked = entry.walked or i < walked
            self._segment(entry)[key] = None  # at the back: this store's rows go last
            self._slots.write(entry.slot, logits[r])
            stored.append(key)
        for key in reversed(stored):  # most valuable last: the most recently used
            self._segment(self._entries[key]).move_to_end(key)
        return len(stored)

    def _segment(self, entry: _Entry) -> OrderedDict[int, None]:
        return self._walked if entry.walked else self._unwalked

    def _configure(self, logits: torch.Tensor) -> None:
        dtype = self.dtype or logits.dtype
        row_bytes = logits.shape[1] * torch.empty((), dtype=dtype).element_size()
        if self.row_bytes == row_bytes and self._slots.device == logits.device:
            return
        if self.row_bytes:  # another vocabulary or device: start over
            self.clear()
        self.dtype, self.row_bytes = dtype, row_bytes
        sizes = chunk_sizes(slot_bytes(self.max_bytes, row_bytes))
        self._slots = LogitSlots(logits.shape[1], dtype, sizes, self.pin, logits.device)

    def clear(self) -> None:
        """Drop every row and every interned prefix (slot memory is released too)."""
        for entry in self._entries.values():
            entry.slot = None
        for index in (self._bare, self._walked, self._unwalked):
            index.clear()
        self._entries.clear()
        self._ids.clear()
        self._slots.close()
        self._slots = LogitSlots()
        self.bytes = self.row_bytes = 0

    def _slot(self, key: int, take_walked: bool) -> Slot | None:
        """An empty slot for `key`'s row: a free one, else one of a new chunk if one fits
        within the limit, else made by evicting the least recently used of: a bare leaf
        (while a chunk is left to allocate when the prefixes leave room) and a row
        (unwalked, or for a walked row any) that is not of the current store (whose rows
        are at the back of each segment)."""
        slots = self._slots
        while not slots.free and not slots.grow(self.limit - self.held_bytes):
            row = self._oldest_row(take_walked)
            leaf = next(iter(self._bare), None)
            if (
                leaf is not None
                and slots.unallocated  # a chunk to make room for (a chain of leaves unravels)
                and (row is None or self._entries[leaf].used < self._entries[row].used)
            ):
                del self._bare[leaf]
                self._drop_prefix(leaf)
                self._bare.pop(key, None)  # its last child may have gone: still not to drop
            elif row is not None:
                self._take_row(row, self._entries[row])
            else:
                return None
        return slots.take(key)

    def _oldest_row(self, take_walked: bool) -> int | None:
        for segment in (self._unwalked, self._walked) if take_walked else (self._unwalked,):
            if segment:
                key = next(iter(segment))
                if self._entries[key].store != self._store:
                    return key
        return None

    def _take_row(self, key: int, entry: _Entry) -> None:
        """Evict `key`'s row, its slot free; the prefix stays interned (rows below it stay
        reachable)."""
        assert entry.slot is not None, "only entries holding a row are in a row segment"
        del self._segment(entry)[key]
        self._slots.vacate(entry.slot)
        entry.slot = None
        if not entry.children:
            self._bare[key] = None
        self.bytes -= self.row_bytes
        self.stats.evictions += 1

    def _evict(self) -> None:
        """Until what the cache holds is within the limit: free the last chunk when the rows
        left fit in the others (moving them there), else drop the least recently used of a
        bare leaf (a prefix with neither a row nor children; its parent may become one) and
        a row (unwalked rows before walked ones; the prefix stays, without a row, and its
        slot is free). Leaves go first anyway while they take more than their share. Only
        leaves: a long prompt's prefixes are interned before the rows below them, so
        dropping the oldest prefix would cut every row of its trees off; and by age: a stale
        chain of prefixes (a finished request's prompt, its rows gone) goes before newer
        rows, while a tree's keys, interned just before its rows are stored, outlive older
        rows."""
        share = self.limit // ENTRY_SHARE
        released = False
        while self.held_bytes > self.limit:
            if self._slots.can_release():
                for moved, slot in self._slots.release_last():
                    self._entries[moved].slot = slot
                released = True
                continue
            rows = self._unwalked or self._walked
            leaf = next(iter(self._bare), None)
            row = next(iter(rows), None)
            if leaf is not None and (
                row is None
                or len(self._bare) * ENTRY_OVERHEAD > share
                or self._entries[leaf].used < self._entries[row].used
            ):
                del self._bare[leaf]
                self._drop_prefix(leaf)
            elif row is not None:
                self._take_row(row, self._entries[row])
            else:
                break  # nothing evictable (a bare inner prefix always has a leaf or row below)
        if released:
            self._slots.return_pinned()

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
