"""Host memory for the streamed layers: one exactly sized allocation per tier, sliced into
per-layer views, and page-locked for the GPU by registering it with the CUDA driver.

Why not `torch.empty(..., pin_memory=True)` per layer: PyTorch's caching host allocator
rounds every pinned allocation up to a power of two, so a 70B layer of 1.59 GiB pins 2 GiB
and 80 of them need 160 GiB instead of 127. Here the whole tier is one anonymous memory map
(page-aligned by construction), rounded up to a page only once, and `cudaHostRegister` makes
it DMA-able in place. On a CPU device nothing is registered and the same slicing runs on
ordinary memory, so the arithmetic the plan relies on is tested everywhere.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


def arena_bytes(slice_bytes: int, count: int) -> int:
    """RAM an arena of `count` slices of `slice_bytes` takes: the plan's host-tier figure."""
    return _round_up(slice_bytes * count, PAGE)


class HostArena:
    """`count` equal slices of `slice_bytes` in one host allocation.

    `pin()` registers the whole allocation with the CUDA driver (page-locked, so copies from
    it are real asynchronous DMA); it is unregistered when the arena is closed or collected,
    after the device has finished any copy that may still read it. When registering fails
    (no CUDA, a driver that refuses, a locked-memory limit) the arena stays pageable:
    copies from it are still correct, only staged by the driver instead of DMA'd directly."""

    def __init__(self, slice_bytes: int, count: int) -> None:
        if slice_bytes <= 0 or count <= 0:
            raise ValueError(f"an arena needs slices and bytes (got {count} × {slice_bytes})")
        self.slice_bytes = slice_bytes
        self.count = count
        self.nbytes = arena_bytes(slice_bytes, count)
        # MAP_PRIVATE | MAP_ANONYMOUS: page-aligned, zero-filled on first touch, committed
        # page by page as layers are packed (so filling it layer by layer while the loaded
        # model is freed layer by layer keeps peak RAM near one copy of the weights).
        flags = getattr(mmap, "MAP_PRIVATE", 0)
        self._map = mmap.mmap(-1, self.nbytes, flags=flags) if flags else mmap.mmap(-1, self.nbytes)
        self.flat = torch.frombuffer(self._map, dtype=torch.uint8)  # (nbytes,) view of the map
        self.pinned = False
        self._finalizer: weakref.finalize | None = None

    def view(self, index: int) -> torch.Tensor:
        """Slice `index` as a (slice_bytes,) uint8 tensor sharing the arena's memory."""
        if not 0 <= index < self.count:
            raise IndexError(f"arena slice {index} outside 0..{self.count - 1}")
        start = index * self.slice_bytes
        return self.flat[start : start + self.slice_bytes]

    def pin(self, device: torch.device) -> bool:
        """Page-lock the arena for `device`'s copies; False (and a warning) if refused."""
        if self.pinned or device.type != "cuda":
            return self.pinned
        ptr = self.flat.data_ptr()
        error = _register(ptr, self.nbytes, device)
        if error is not None:
            log.warning(
                "could not page-lock %d bytes of host memory for streaming (%s); copies "
                "will go through the driver's staging, slower but correct",
                self.nbytes,
                error,
            )
            return False
        self.pinned = True
        # Tie the registration to this object's lifetime; the map itself stays alive while
        # any view of it does (torch.frombuffer holds the buffer), so memory is never freed
        # while registered.
        self._finalizer = weakref.finalize(self, _unregister, ptr, device)
        # At interpreter exit the process's memory goes away with it: nothing to undo then.
        self._finalizer.atexit = False
        return True

    def close(self) -> None:
        """Unregister now (after the device's pending work); views stay valid, pageable."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.pinned = False


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


# cudaHostRegisterPortable: page-locked for every CUDA context, not only the registering
# thread's current device (the registration runs on a thread of its own, see below).
HOST_REGISTER_PORTABLE = 1


def _register(ptr: int, nbytes: int, device: torch.device) -> str | None:
    """cudaHostRegister; returns the error text, or None on success."""

    def call() -> str | None:
        try:
            with torch.cuda.device(device):
                code = int(
                    torch.cuda.cudart().cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE)
                )
        except (RuntimeError, AssertionError, AttributeError) as e:  # no CUDA runtime here
            return f"{type(e).__name__}: {e}"
        return None if code == 0 else f"cudaHostRegister error {code}"

    return _on_own_thread(call)


def _unregister(ptr: int, device: torch.device) -> None:
    def call() -> str | None:
        try:
            # A copy queued from this memory may still be running: unregistering under an
            # in-flight DMA is undefined, so wait for the device first.
            with torch.cuda.device(device):
                torch.cuda.synchronize(device)
                code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        except RuntimeError as e:
            return f"{type(e).__name__}: {e}"
        return None if code == 0 else f"cudaHostUnregister error {code}"

    error = _on_own_thread(call)
    if error is not None:
        log.warning("could not unregister streamed host memory: %s", error)


def _on_own_thread(call: Callable[[], str | None]) -> str | None:
    """Run a CUDA runtime call on a throwaway thread: a failed call leaves the calling
    thread's "last error" set, and PyTorch's next kernel-launch check on that thread would
    raise it as if a kernel had failed."""
    result: list[str | None] = ["the call did not run"]

    def run() -> None:
        result[0] = call()

    thread = threading.Thread(target=run, name="specd-host-register")
    thread.start()
    thread.join()
    return result[0]
