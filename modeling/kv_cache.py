"""Preallocated per-sequence key/value cache.

Slots and positions are different things: slot `i` is where an entry lives in the cache,
its RoPE position is whatever the caller passed to `forward`. During tree speculation the
nodes of a tree occupy consecutive slots although several share a position; `keep` then
compacts the accepted path back into a plain contiguous prefix.

A model with window layers (`positions=True`) also keeps each slot's position
(`positions`), which its window masks are made from (modeling/layers/attention.py); the
model writes them as it reserves the slots (`write_positions`).

Window layers keep only what a window can see. Their entries live apart from the
full-attention layers' (`ring`), in a ring of `window_ring_size` slots: slot s sits at
index s mod A once the sequence outgrows it, so a 32k context costs Gemma 3's local
layers (window 1,024) 5,120 slots, not 32,768. The ring holds the window behind the
committed prefix and twice the largest pass ahead of it (`pass_tokens`, at least
`WINDOW_ROOM`): a pass's new entries never overwrite one its queries see, and
speculation appended in the cache (drafts, trees) can be rolled back (`truncate`). A
rollback past what the ring still holds is refused, never served with keys missing. Which
slot sits at each index is arithmetic (`ring_slots`): the latest one written there.
"""

from __future__ import annotations

import errno
import math
import mmap

import torch

from modeling.config import ModelConfig


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A cache's storage, zero (the masked slots a pass attends over must be finite). On a
    CPU it is an anonymous mapping of its own, whose pages are the system's zero page until
    written: a cache that doubles holds in memory what was written, not its whole
    allocation, so while it grows the old copy and the new one's written half are the
    full size, not 1.5 times it (torch.zeros writes every page). Its pages are kept small:
    a transparent huge page at the edge of each written half would commit up to 2 MiB
    more per layer and head."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    try:
        # Private: a shared anonymous mapping is shared memory, whose pages a read commits.
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as err:
        if err.errno == errno.ENOMEM:  # as out of memory as torch's own (batching.py)
            raise MemoryError(f"no memory for a KV cache of {nbytes:,} bytes") from err
        raise
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def stages_through_host(device: torch.device) -> bool:
    """Whether a growing cache copies its entries through host memory (`KVCache._grow`)."""
    return device.type != "cpu"


class CacheFullError(RuntimeError):
    """An append would write past the cache's capacity (the context length)."""


class CacheLostError(RuntimeError):
    """The cache's entries were lost (its storage could be neither grown nor restored): its
    sequence cannot go on, and is not retried as a pass out of memory would be."""


INITIAL_SLOTS = 512  # slots allocated up front; more are allocated (doubling) as needed
# The largest pass a window layer's ring is sized for unless told more: a prefill chunk
# (2,048 tokens), and a tree of up to 2,047 nodes.
WINDOW_ROOM = 2048


def window_ring_size(window: int, capacity: int, pass_tokens: int = 0) -> int:
    """Slots a window layer's ring holds for passes of up to `pass_tokens` tokens (at
    least `WINDOW_ROOM`): the window, and twice the pass ahead of it, or the window again
    if that is more; never more than the context. Twice the pass is what speculation may
    append before it rolls back: a draft tree of up to a pass's nodes, fed into a shared
    cache after the accepted path's tokens (at most the tree's depth more); the window
    again amortises the shift to one entry copied per new token."""
    return min(capacity, window + max(window, 2 * max(WINDOW_ROOM, pass_tokens)))


class KVCache:
    # Storage is always made as normal tensors, also inside an inference-mode pass: `keep`
    # (called outside, by the strategies) updates it in place, and compiled passes
    # (modeling/compiled.py) are specialised to one kind.
    @torch.inference_mode(False)
    def __init__(
        self,
        config: ModelConfig,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        initial: int = INITIAL_SLOTS,
        positions: bool = False,
        pass_tokens: int = 0,
    ) -> None:
        """`capacity` is the most entries the cache may ever hold (the context length);
        memory for them is allocated as the sequence grows, `initial` slots at first and
        then doubling, so a 128k-token context costs nothing until it is used."""
        self.capacity = capacity
        self.lost = False  # its entries lost to a failed growth (`_through_host`)
        self.pass_tokens = pass_tokens  # the largest pass the ring is sized for (0: the room)
        self.length = 0  # slots [0, length) hold valid entries
        windows = [config.layer_window(i) for i in range(config.num_layers)]
        # layer -> (in the ring, its index in that store)
        full = [i for i, w in enumerate(windows) if w is None]
        windowed = [i for i, w in enumerate(windows) if w is not None]
        self.where = {i: (False, j) for j, i in enumerate(full)}
        self.where |= {i: (True, j) for j, i in enumerate(windowed)}
        self.window = max((w for w in windows if w is not None), default=0)
        slots = min(capacity, max(initial, 1))
        heads, hd = config.num_kv_heads, config.head_dim
        shape = (len(full), heads, slots, hd)
        self.k = zeros(shape, dtype, device)  # (full layers, kv_heads, slots, hd)
        self.v = zeros(shape, dtype, device)
        # (window layers, kv_heads, A, hd); None when no layer has a window
        self.ring_k: torch.Tensor | None = None
        self.ring_v: torch.Tensor | None = None
        self.written = -1  # the highest slot written to the ring
        if windowed:
            ring = (len(windowed), heads, min(slots, self.ring_target(1)), hd)
            self.ring_k = zeros(ring, dtype, device)
            self.ring_v = zeros(ring, dtype, device)
        # (slots,) each slot's position, for window layers; None when no layer has a window
        self.positions: torch.Tensor | None = (
            torch.zeros(slots, dtype=torch.long, device=device) if positions else None
        )

    def ring_target(self, n: int) -> int:
        return window_ring_size(self.window, self.capacity, max(n, self.pass_tokens))

    @property
    def ring_size(self) -> int:
        return 0 if self.ring_k is None else self.ring_k.shape[2]

    @property
    def wrapped(self) -> bool:
        """Whether some slot sits at an index other than its own (slot >= ring size)."""
        return self.written >= self.ring_size > 0

    def ring_slots(self) -> torch.Tensor:
        """(A,) the slot each ring index holds once wrapped: the latest written there."""
        a = self.ring_size
        index = torch.arange(a, device=self.positions_device)
        return self.written - torch.remainder(self.written - index, a)

    @property
    def positions_device(self) -> torch.device:
        return self.k.device

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Layer `layer`'s key and value storage (kv_heads, slots or A, hd), and whether it
        is a ring."""
        ring, index = self.where[layer]
        if ring:
            assert self.ring_k is not None and self.ring_v is not None
            return self.ring_k[index], self.ring_v[index], True
        return self.k[index], self.v[index], False

    def clone(self) -> KVCache:
        """An independent copy: the same entries, lengths and ring."""
        copy = KVCache.__new__(KVCache)
        copy.__dict__.update(self.__dict__)
        for name in ("k", "v", "ring_k", "ring_v", "positions"):
            value = getattr(self, name)
            setattr(copy, name, None if value is None else value.clone())
        copy.where = dict(self.where)
        return copy

    @property
    def free(self) -> int:
        return self.capacity - self.length

    @property
    def allocated(self) -> int:
        """Slots currently backed by memory (≤ capacity)."""
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        kept = 0 if self.positions is None else self.positions.numel() * 8
        ring = 0 if self.ring_k is None else 2 * self.ring_k.numel() * self.ring_k.element_size()
        return 2 * self.k.numel() * self.k.element_size() + kept + ring

    @torch.inference_mode(False)
    def _resize_ring(self, size: int) -> None:
        """A ring of `size` indices holding every slot the old one still holds below
        `length` (at slot mod size)."""
        assert self.ring_k is not None and self.ring_v is not None
        old_k, old_v, old = self.ring_k, self.ring_v, self.ring_size
        shape = (*old_k.shape[:2], size, old_k.shape[3])
        self.ring_k = zeros(shape, old_k.dtype, old_k.device)
        self.ring_v = zeros(shape, old_v.dtype, old_v.device)
        first = max(0, self.written - old + 1)  # the oldest slot still held
        held = torch.arange(first, self.length, device=old_k.device)
        if held.numel():
            self.ring_k[:, :, held % size] = old_k[:, :, held % old]
            self.ring_v[:, :, held % size] = old_v[:, :, held % old]
        self.written = self.length - 1

    @torch.inference_mode(False)
    def _grow(self, needed: int) -> None:
        # The model grows the cache inside its inference-mode forward; tensors made there
        # are inference tensors, which `keep` (called outside, by the strategies) may not
        # update in place. The cache's storage is always made as a normal tensor.
        # On a CPU the new storage's unwritten pages cost nothing (`zeros`), so the old
        # storage and the new one's written half are the full cache. On a GPU the new one
        # is allocated beside the old where it fits; where it does not, the entries go
        # through host memory and the old storage is freed first, so the device never
        # needs both (at the last doubling that was 1.5 times the full cache, which the
        # memory plan counts once).
        slots = min(self.capacity, max(needed, 2 * self.allocated))
        shape = (*self.k.shape[:2], slots, self.k.shape[3])
        dtype, device, n = self.k.dtype, self.k.device, self.length
        try:
            k, v = zeros(shape, dtype, device), zeros(shape, dtype, device)
            k[:, :, :n].copy_(self.k[:, :, :n])
            v[:, :, :n].copy_(self.v[:, :, :n])
        except torch.OutOfMemoryError:
            if not stages_through_host(device):
                raise
            k = v = torch.empty(0)  # (the half made goes before the old storage does)
            k, v = self._through_host(shape)
        self.k, self.v = k, v
        if self.positions is not None:
            positions = torch.zeros(slots, dtype=torch.long, device=self.positions.device)
            positions[: self.length] = self.positions[: self.length]
            self.positions = positions

    def _through_host(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """New storage of `shape` holding the entries, where the device has no room for it
        beside the old: the entries copied to host memory, the old storage freed, the new
        one made and filled. If even that fails the cache is left as it was and the error
        raised; if then the old storage cannot be made again, the entries are lost
        (`CacheLostError`, and every later `reserve` says so)."""
        dtype, device, old_shape, n = self.k.dtype, self.k.device, self.k.shape, self.length
        host_k, host_v = self.k[:, :, :n].to("cpu"), self.v[:, :, :n].to("cpu")
        # (a pass reserves its slots before it takes any view of the storage; a captured
        # CUDA graph may still hold it, and then this frees nothing and fails as before)
        del self.k, self.v
        try:
            k, v = zeros(shape, dtype, device), zeros(shape, dtype, device)
        except BaseException:
            try:
                self.k, self.v = zeros(old_shape, dtype, device), zeros(old_shape, dtype, device)
            except BaseException as again:  # its room taken meanwhile: the entries are lost
                empty = (*old_shape[:2], 0, old_shape[3])
                self.k = self.v = torch.empty(empty, dtype=dtype, device=device)
                self.length, self.lost = 0, True
                raise CacheLostError(
                    "the KV cache lost its entries: out of device memory while it grew, and "
                    "again while it was restored"
                ) from again
            self.k[:, :, :n].copy_(host_k)
            self.v[:, :, :n].copy_(host_v)
            raise
        k[:, :, :n].copy_(host_k)
        v[:, :, :n].copy_(host_v)
        return k, v

    def reserve(self, n: int) -> int:
        """Check room for `n` new entries and return the first slot they will occupy.
        The model writes them layer by layer, then calls `commit_append(n)`."""
        if self.lost:
            raise CacheLostError("the KV cache lost its entries to an out-of-memory error")
        if self.length + n > self.capacity:
            raise CacheFullError(
                f"KV cache full: {self.length} + {n} entries exceed the capacity of {self.capacity}"
            )
        end = self.length + n
        if end > self.allocated:
            self._grow(end)
        if self.ring_k is not None:
            target = max(self.ring_size, self.ring_target(n))
            if end > self.ring_size and self.ring_size < target:
                # Before it wraps the ring grows as the cache does (doubling); once it must
                # wrap, to its full size.
                size = target if self.wrapped else min(target, max(end, 2 * self.ring_size))
                self._resize_ring(size)
            self.written = max(self.written, end - 1)
        return self.length

    def write_positions(self, start: int, positions: torch.Tensor) -> None:
        """Record the positions of the reserved slots from `start` (a no-op for a cache
        that keeps none)."""
        if self.positions is not None:
            self.positions[start : start + positions.shape[0]] = positions

    def commit_append(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        """Roll back to the first `n` entries; a ValueError if a window layer's ring no
        longer holds the window behind slot `n` (speculation went past its room)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        if not self.can_truncate(n):
            raise ValueError(
                f"cannot truncate to {n}: the window layers' ring of {self.ring_size} slots "
                f"holds slots from {self.written - self.ring_size + 1} on, and position {n} "
                f"sees back to {n - self.window + 1}"
            )
        self.length = n
        if n == 0:
            self.written = -1  # an empty ring: the next entries start at their own index

    def can_truncate(self, n: int) -> bool:
        """Whether rolling back to `n` entries keeps every key a window layer at `n` sees."""
        return n == 0 or not self.wrapped or self.written - self.ring_size < n - self.window + 1

    def keep(self, indices: torch.Tensor | list[int], start: int = 0) -> None:
        """Keep only the entries at `indices` (ascending slots), compacted into slots
        [start, start + len(indices)) in the given order. Slots [0, start) stay as they are
        (a tree commit keeps the prefix untouched and moves only the accepted path)."""
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.k.device)
        n = int(idx.numel())
        if n and (int(idx.max()) >= self.length or int(idx.min()) < start):
            raise ValueError(
                f"keep() indices must lie in [{start}, {self.length}), got "
                f"[{int(idx.min())}, {int(idx.max())}]"
            )
        if not 0 <= start <= self.length:
            raise ValueError(f"keep() start {start} is outside the cache length {self.length}")
        # Gather first, then write: source and destination ranges may overlap.
        self.k[:, :, start : start + n] = self.k[:, :, idx]
        self.v[:, :, start : start + n] = self.v[:, :, idx]
        if self.ring_k is not None and self.ring_v is not None:
            a = self.ring_size
            into = torch.arange(start, start + n, device=idx.device) % a
            self.ring_k[:, :, into] = self.ring_k[:, :, idx % a]
            self.ring_v[:, :, into] = self.ring_v[:, :, idx % a]
        if self.positions is not None:
            self.positions[start : start + n] = self.positions[idx]
        self.length = start + n
