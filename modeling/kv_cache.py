"""Preallocated per-sequence key/value cache.

Slots and positions are different things: slot `i` is where an entry lives in the cache,
its RoPE position is whatever the caller passed to `forward`. During tree speculation the
nodes of a tree occupy consecutive slots although several share a position; `keep` then
compacts the accepted path back into a plain contiguous prefix.

A model with window layers (`positions=True`) also keeps each slot's position
(`positions`), which its window masks are made from (modeling/layers/attention.py); the
model writes them as it reserves the slots (`write_positions`).
"""

from __future__ import annotations

import torch

from modeling.config import ModelConfig


class CacheFullError(RuntimeError):
    """An append would write past the cache's capacity (the context length)."""


INITIAL_SLOTS = 512  # slots allocated up front; more are allocated (doubling) as needed


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
    ) -> None:
        """`capacity` is the most entries the cache may ever hold (the context length);
        memory for them is allocated as the sequence grows, `initial` slots at first and
        then doubling, so a 128k-token context costs nothing until it is used."""
        self.capacity = capacity
        self.length = 0  # slots [0, length) hold valid entries
        slots = min(capacity, max(initial, 1))
        shape = (config.num_layers, config.num_kv_heads, slots, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (layers, kv_heads, slots, hd)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # (slots,) each slot's position, for window layers; None when no layer has a window
        self.positions: torch.Tensor | None = (
            torch.zeros(slots, dtype=torch.long, device=device) if positions else None
        )

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
        return 2 * self.k.numel() * self.k.element_size() + kept

    @torch.inference_mode(False)
    def _grow(self, needed: int) -> None:
        # The model grows the cache inside its inference-mode forward; tensors made there
        # are inference tensors, which `keep` (called outside, by the strategies) may not
        # update in place. The cache's storage is always made as a normal tensor.
        slots = min(self.capacity, max(needed, 2 * self.allocated))
        shape = (*self.k.shape[:2], slots, self.k.shape[3])
        k = torch.zeros(shape, dtype=self.k.dtype, device=self.k.device)
        v = torch.zeros(shape, dtype=self.v.dtype, device=self.v.device)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v
        if self.positions is not None:
            positions = torch.zeros(slots, dtype=torch.long, device=self.positions.device)
            positions[: self.length] = self.positions[: self.length]
            self.positions = positions

    def reserve(self, n: int) -> int:
        """Check room for `n` new entries and return the first slot they will occupy.
        The model writes them layer by layer, then calls `commit_append(n)`."""
        if self.length + n > self.capacity:
            raise CacheFullError(
                f"KV cache full: {self.length} + {n} entries exceed the capacity of {self.capacity}"
            )
        if self.length + n > self.allocated:
            self._grow(self.length + n)
        return self.length

    def write_positions(self, start: int, positions: torch.Tensor) -> None:
        """Record the positions of the reserved slots from `start` (a no-op for a cache
        that keeps none)."""
        if self.positions is not None:
            self.positions[start : start + positions.shape[0]] = positions

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
        if self.positions is not None:
            self.positions[start : start + n] = self.positions[idx]
        self.length = start + n
