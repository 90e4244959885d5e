"""The target's next-token logits per prefix, in a bounded LRU cache.

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

Rows come in blocks (one verification pass's logits, (N, V)); a row is a view into its
block, and a block's bytes count until its last row is evicted, so the byte bound holds
for the memory really held.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

EMPTY_PREFIX = 0  # id of the empty sequence, the trie's root
ENTRY_OVERHEAD = 128  # bytes charged per interned prefix (dict slots, the record)


@dataclass
class _Block:
    logits: torch.Tensor  # (N, V) fp32
    live_rows: int = 0

    @property
    def nbytes(self) -> int:
        return self.logits.numel() * self.logits.element_size()


@dataclass
class _Entry:
    edge: tuple[int, int]  # (parent id, token)
    block: _Block | None = None
    row: int = 0


@dataclass
class PrefixCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class PrefixCache:
    def __init__(self, max_bytes: int = 64 << 20) -> None:
        if max_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._ids: dict[tuple[int, int], int] = {}
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = EMPTY_PREFIX + 1
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def child(self, prefix: int, token: int) -> int:
        """The id of `prefix` extended by `token` (interned on first use)."""
        edge = (prefix, token)
        key = self._ids.get(edge)
        if key is None:
            key = self._next_id
            self._next_id += 1
            self._ids[edge] = key
            self._entries[key] = _Entry(edge)
            self.bytes += ENTRY_OVERHEAD
            self._evict()
        return key

    def key(self, tokens: list[int], prefix: int = EMPTY_PREFIX) -> int:
        """The id of `prefix` extended by all of `tokens`."""
        for t in tokens:
            prefix = self.child(prefix, t)
        return prefix

    def get(self, key: int) -> torch.Tensor | None:
        """The target's logits (V,) after the prefix `key`, or None."""
        entry = self._entries.get(key)
        if entry is None or entry.block is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry.block.logits[entry.row]

    def put_rows(self, keys: list[int], logits: torch.Tensor) -> None:
        """Store row i of `logits` (N, V) as the logits after prefix `keys[i]`."""
        if len(keys) != logits.shape[0]:
            raise ValueError(f"{len(keys)} keys for {logits.shape[0]} rows of logits")
        block = _Block(logits)
        if block.nbytes > self.max_bytes:
            return  # larger than the whole cache: keeping it would evict everything else
        self.bytes += block.nbytes
        for row, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None:
                continue  # evicted while this block was being added
            self._release(entry)
            entry.block, entry.row = block, row
            block.live_rows += 1
            self._entries.move_to_end(key)
        if block.live_rows == 0:
            self.bytes -= block.nbytes
        self._evict()

    def _release(self, entry: _Entry) -> None:
        block = entry.block
        if block is None:
            return
        entry.block = None
        block.live_rows -= 1
        if block.live_rows == 0:
            self.bytes -= block.nbytes

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._entries:
            _, entry = self._entries.popitem(last=False)
            self._release(entry)
            del self._ids[entry.edge]
            self.bytes -= ENTRY_OVERHEAD
            self.stats.evictions += 1
