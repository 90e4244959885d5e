"""Slot memory for the prefix cache's logit rows (speculative/prefix_cache.py): chunks of
(rows, V) allocated as rows need them and freed when their room is needed elsewhere.

Chunk sizes are powers of two, at most CHUNK_BYTES each: a pinned allocation of 2^k bytes
takes exactly 2^k bytes of RAM, and each chunk is allocated at exactly its size, so the
bytes counted are the bytes held. Free slots are a heap, handed out lowest first: rows
gather in the first chunks and the last chunk is the emptiest. That one is the one a
release frees, after copying its rows to free slots of the others on the chunks' device
(a memcpy on the host).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

CHUNK_BYTES = 32 << 20  # slot memory is allocated in pieces of at most this many bytes
NO_KEY = 0  # the owner of an empty slot: the prefix cache's EMPTY_PREFIX, never a row's key

Slot = tuple[int, int]  # (chunk, row)


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


class LogitSlots:
    """Rows of `vocab` logits in `dtype`, in chunks of `sizes` (those a row fits in); with no
    arguments, a store with no room (a cache before its first row)."""

    def __init__(
        self,
        vocab: int = 0,
        dtype: torch.dtype = torch.float32,
        sizes: Sequence[int] = (),
        pin: bool = False,
        device: torch.device | None = None,
    ) -> None:
        """`pin`: chunks in pinned host memory; `device`: where the rows come from and a
        read puts them."""
        self.vocab, self.dtype, self.pin = vocab, dtype, pin
        self.device = device or torch.device("cpu")
        self.row_bytes = vocab * torch.empty((), dtype=dtype).element_size()
        self.unallocated = sorted((s for s in sizes if 0 < self.row_bytes <= s), reverse=True)
        self.allocated = 0  # bytes of the chunks allocated now
        self.chunks: list[torch.Tensor] = []  # (rows, V) each, in allocation order
        self._owners: list[list[int]] = []  # per chunk, per row: the key it holds, or NO_KEY
        self._free: list[Slot] = []  # a heap of empty slots

    @property
    def free(self) -> int:
        """Empty slots in the chunks allocated now."""
        return len(self._free)

    def grow(self, room: int) -> bool:
        """Allocate the largest chunk not allocated that takes at most `room` bytes."""
        if not self.unallocated or self.unallocated[-1] > room:
            return False
        size = next(s for s in self.unallocated if s <= room)
        self.unallocated.remove(size)
        rows = size // self.row_bytes
        storage = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self.chunks.append(storage[: rows * self.row_bytes].view(self.dtype).view(rows, -1))
        self._owners.append([NO_KEY] * rows)
        # Its slots sort after every free slot: appended in order, the heap stays a heap.
        self._free.extend((len(self.chunks) - 1, r) for r in range(rows))
        self.allocated += size
        return True

    def take(self, key: int) -> Slot:
        """The lowest free slot, now holding `key`'s row (there must be one)."""
        chunk, row = slot = heapq.heappop(self._free)
        self._owners[chunk][row] = key
        return slot

    def vacate(self, slot: Slot) -> None:
        self._owners[slot[0]][slot[1]] = NO_KEY
        heapq.heappush(self._free, slot)

    def write(self, slot: Slot, row: torch.Tensor) -> None:
        # Into a pinned slot the copy is asynchronous on the current stream; nothing on the
        # host reads slots but a release, which waits for it, and a read is queued behind it.
        self.chunks[slot[0]][slot[1]].copy_(row, non_blocking=self.pin)

    def read(self, slot: Slot) -> torch.Tensor:
        """A copy of the row, fp32 on `device`, never a view of the slot (a later write may
        reuse it). From pinned memory it is asynchronous on the current stream, which orders
        it before any later device→host copy into the same slot."""
        return self.chunks[slot[0]][slot[1]].to(
            self.device, torch.float32, non_blocking=True, copy=True
        )  # (V,)

    def can_release(self) -> bool:
        """Whether the rows held fit in the chunks before the last."""
        return bool(self.chunks) and self.free >= self.chunks[-1].shape[0]

    def release_last(self) -> list[tuple[int, Slot]]:
        """Free the last chunk (`can_release` must hold), its rows first moved to the lowest
        free slots of the others. Returns (key, new slot) for each row moved."""
        last = len(self.chunks) - 1
        chunk, owners = self.chunks.pop(), self._owners.pop()
        self._free = [slot for slot in self._free if slot[0] != last]
        heapq.heapify(self._free)
        moving = [(row, key) for row, key in enumerate(owners) if key != NO_KEY]
        if moving and self.pin and self.device.type == "cuda":
            # Host copies are not ordered on the stream: wait for the queued device→host
            # copies into moving rows and host→device reads of slots about to be reused.
            torch.cuda.current_stream(self.device).synchronize()
        moved: list[tuple[int, Slot]] = []
        runs: list[list[int]] = []  # [chunk, first row, first row moved, rows]
        for row, key in moving:
            c, r = slot = self.take(key)
            moved.append((key, slot))
            run = runs[-1] if runs else None
            if run is not None and run[0] == c and run[1] + run[3] == r and run[2] + run[3] == row:
                run[3] += 1  # the next row at both ends
            else:
                runs.append([c, r, row, 1])
        # A copy per run of rows consecutive at both ends (a gather would stage them all
        # in new memory, which a release under memory pressure must not need).
        for c, r, row, n in runs:
            self.chunks[c][r : r + n].copy_(chunk[row : row + n])  # (n, V)
        size = chunk.untyped_storage().nbytes()
        self.allocated -= size
        self.unallocated = sorted([*self.unallocated, size], reverse=True)
        return moved

    def close(self) -> None:
        """Free every chunk."""
        released = bool(self.chunks)
        self.chunks, self._owners, self._free, self.allocated = [], [], [], 0
        if released:
            self.return_pinned()

    def return_pinned(self) -> None:
        """Freed pinned chunks stay in the host allocator's cache until it is emptied."""
        # (torch.accelerator.empty_host_cache is recent PyTorch's; without it, the blocks stay
        # cached for the next pinned allocation.)
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if self.pin and torch.cuda.is_available() and empty is not None:
            empty()
