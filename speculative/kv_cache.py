"""Preallocated per-sequence key/value cache.

Slots and positions are different things: slot `i` is where an entry lives in the cache,
its RoPE position is whatever the caller passed to `forward`. During tree speculation the
nodes of a tree occupy consecutive slots although several share a position; `keep` then
compacts the accepted path back into a plain contiguous prefix.
"""

from __future__ import annotations

import torch

from speculative.config import ModelConfig


class CacheFullError(RuntimeError):
    """An append would write past the preallocated capacity."""


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (config.num_layers, config.num_kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(
            shape, dtype=dtype, device=device
        )  # (layers, kv_heads, slots, head_dim)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0  # slots [0, length) hold valid entries

    @staticmethod
    def bytes_for(config: ModelConfig, capacity: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * capacity * config.head_dim * itemsize

    @property
    def free(self) -> int:
        return self.capacity - self.length

    def reserve(self, n: int) -> int:
        """Check room for `n` new entries and return the first slot they will occupy.
        The model writes them layer by layer, then calls `commit_append(n)`."""
        if self.length + n > self.capacity:
            raise CacheFullError(
                f"KV cache full: {self.length} + {n} entries exceed the capacity of {self.capacity}"
            )
        return self.length

    def commit_append(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> None:
        """Roll back to the first `n` entries."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

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
        self.length = start + n
