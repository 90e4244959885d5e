"""CUDA graphs of a resident model's steps: a whole decode or draft step in one launch.

A GPU step of a small resident model (a 1B draft at one tree depth, a decode step) is a few
hundred kernels of microseconds each; launching them from Python costs more than running
them. A captured CUDA graph replays every kernel of the step with one call. What a replay
cannot change is any address or size: the graph reads and writes exactly the memory it was
captured with. So a step is captured per

- KV storage: the (k, v) tensors of the cache it writes, by address and allocation. A
  cache's storage only changes when it grows (doubling, modeling/kv_cache.py), and the
  caching allocator hands a new session's cache the block a finished one freed, so a few
  storages serve a daemon's conversations; a graph is valid for any cache whose storage
  sits at its addresses, with its size;
- token bucket: the step's token count padded to the next of BUCKETS. The padding rows
  read token 0, write their keys and values to the slots after the step's (reserved, past
  the cache's length: never attended by anyone, overwritten by the next step) and attend
  only to their own slot, so that every row's softmax stays finite;
- a bound on working memory: a step's attention scores stay under GRAPH_ATTENTION_BYTES,
  since the pool keeps what a graph used (the memory plan counts it:
  offload/device_parts.py).

Everything else a step varies goes through the graph's static inputs, copied in before
each replay: tokens, positions, the slots written and the (tokens, slots) mask. A model's
graphs share one memory pool, which is safe because a replay's output is read (by the eager
head) before the next replay starts, and every graph's output stays allocated (no later
capture reuses it); and one capture stream of their own. At most
MAX_GRAPHS are kept per model, and past it all of them are dropped, never one: destroying a
graph clears cuBLAS's workspace for its capture stream, whose address the model's other
graphs baked in (pytorch/pytorch#193402). Captures are serialised across the process (one
may run at a time) and leave the caller on its own stream even when they fail.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

# Padded token counts of the captured steps: a decode step, a linear draft's few tokens and
# a tree's frontier at each depth, up to compiled.MAX_TOKENS.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The most attention scores a captured step may hold (modeling/layers/attention.py's bound for
# any pass is 128 MiB): a graph's pool keeps its working memory for good, so a captured step
# attends with at most this many bytes of scores and a wider one runs uncaptured. The bound
# is on the allocation (which doubles past the context used): for a 32-head model, 64 MiB
# captures every bucket up to 2k slots, 32 tokens at 4k, 16 at 8k, 8 at 16k, 4 at 32k and
# single tokens at 128k (a single row is always allowed: eager holds it too); a 64-head
# model, half as many tokens.
GRAPH_ATTENTION_BYTES = 64 * 2**20
# Graphs kept per model: every bucket for several KV storages (a daemon's few live caches
# and the sizes each grew through). Each holds its inputs, its (bucket, hidden) output and
# its share of the pool's intermediates (the memory plan counts them).
MAX_GRAPHS = 64

# cuBLAS's workspaces for one capture stream, which its graphs use for good: PyTorch's
# default cuBLAS workspace is 32 MiB on Hopper (less on older cards), cuBLASLt's a few MiB.
CUBLAS_WORKSPACE_BYTES = 40 * 2**20
# The caching allocator's rounding for what a model's graphs allocate: the capture stream's
# own blocks (the workspaces, the warm-up's scratch cache, the fixed inputs) and the graph
# pool's are two arenas, and each holds a partly used 20 MiB segment for blocks of 1-10 MiB
# and 2 MiB segments for small ones. Measured on an H100 for the shared stories draft,
# whose steps are tiny: 56 MiB on the capture stream and 24 MiB in its pool (two 2 MiB
# segments and one of 20 MiB each besides the workspace), against 62 MiB planned before.
ALLOCATOR_ROUNDING_BYTES = 2 * (20 + 2 * 2) * 2**20


class StepInputs(NamedTuple):
    """What a step reads and writes: its tokens and their slots, and the whole cache."""

    tokens: torch.Tensor  # (B,)
    positions: torch.Tensor  # (B,)
    k: torch.Tensor  # (layers, Hkv, slots, hd) the cache's whole allocation
    v: torch.Tensor
    write: torch.Tensor  # (B,) the slots the new entries go to
    mask: torch.Tensor  # (B, slots) bool


# A step as the graph runs it: its inputs -> the (B, hidden) final hidden states.
Step = Callable[[StepInputs], torch.Tensor]


class Capture(Protocol):
    """Captures steps over fixed tensors (CudaCapture; tests replay the step on a CPU)."""

    def __call__(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Capture `step`; return the function that replays it."""
        ...

    def released(self) -> None:
        """Every graph captured so far has been dropped."""
        ...


# Only one CUDA graph capture may be underway in a process (the daemon's compile thread
# warms one model while the engine's thread may capture another's).
_CAPTURE_LOCK = threading.Lock()


def bucket_for(tokens: int) -> int | None:
    """The padded token count of a `tokens`-token step, or None above the largest bucket."""
    return next((b for b in BUCKETS if b >= tokens), None)


class CudaCapture:
    """Captures one model's steps as CUDA graphs, in a memory pool and on a capture stream
    of the model's own (another model dropping its graphs clears only its own stream's
    cuBLAS workspace)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        # Captures and the run before each: one stream, so one set of cuBLAS workspaces
        # (cuBLAS keeps one per stream it ran on, for good).
        self.stream = torch.cuda.Stream()

    def released(self) -> None:
        """The pool dies with the last graph captured into it: the next capture needs a new
        one (capturing into a dead pool fails the allocator's internal assert)."""
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Capture `step` (reading and writing only fixed tensors). It runs once uncaptured
        first, as capturing requires: the libraries set up their workspaces and a compiled
        step its kernels outside the graph (the run's writes are the step's own, redone by
        the first replay). Unlike `torch.cuda.graph`, this neither synchronises the device
        nor empties the allocator's cache (a streamed layer's copy keeps going; freed KV
        blocks stay for the next session's cache), and the caller's stream is restored when
        capturing fails."""
        with _CAPTURE_LOCK:
            caller = torch.cuda.current_stream()
            self.stream.wait_stream(caller)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self.stream):  # restores the caller's stream on exit
                step()
                # thread_local: the streamer's threads may copy layers meanwhile.
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    out = step()
                finally:
                    graph.capture_end()
            caller.wait_stream(self.stream)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


@dataclass
class _Graph:
    """One captured step: the fixed inputs it reads (the cache's own k and v) and its
    replay, which returns the (B, hidden) output, overwritten by the next replay."""

    inputs: StepInputs
    replay: Callable[[], torch.Tensor]


class StepGraphs:
    """One model's captured steps (see the module's docstring).

    `run(inputs)` takes a step already padded to a bucket and returns its (bucket, hidden)
    output: the graph's own tensor, valid until the next replay of that graph, so the
    caller reads it at once."""

    def __init__(self, step: Step, capture: Capture | None = None) -> None:
        self.step = step
        self.capture = capture if capture is not None else CudaCapture()
        self._graphs: dict[tuple[int, int, int, int], _Graph] = {}
        self.captures = 0  # graphs captured so far (more than len(): some were dropped)
        self.capture_seconds = 0.0
        self.replays = 0
        self.held = False  # released under memory pressure: steps run uncaptured

    def __len__(self) -> int:
        return len(self._graphs)

    def release(self) -> int:
        """Drop every graph, so their pool's memory goes back to the allocator, and capture
        none until `resume()`: meanwhile each step runs uncaptured (same kernels, launched
        one by one). Returns how many graphs were dropped."""
        dropped = len(self._graphs)
        if dropped:
            self._graphs.clear()  # all of them, never one (see the module's docstring)
            self.capture.released()
        self.held = True
        return dropped

    def resume(self) -> None:
        """Capture again: the next step of each kind is captured anew."""
        self.held = False

    def run(self, inputs: StepInputs) -> torch.Tensor:
        if self.held:
            return self.step(inputs)
        k, v = inputs.k, inputs.v
        key = (k.data_ptr(), v.data_ptr(), int(k.shape[2]), int(inputs.tokens.shape[0]))
        graph = self._graphs.get(key)
        if graph is None:
            return self._capture(key, inputs)
        for fixed, new in zip(graph.inputs, inputs, strict=True):
            if fixed is not new:  # k and v are the cache's own
                fixed.copy_(new)
        self.replays += 1
        return graph.replay()

    def _capture(self, key: tuple[int, int, int, int], inputs: StepInputs) -> torch.Tensor:
        """Capture the step for `key` with this step's inputs as its fixed inputs, and run
        it (the replay computes this step)."""
        t0 = time.perf_counter()
        if len(self._graphs) >= MAX_GRAPHS:
            self._graphs.clear()  # all of them, never one (see the module's docstring)
            self.capture.released()
        # Fixed inputs are ordinary allocations, outside the graphs' pool: a capture may
        # reuse what another graph freed in the pool, never a tensor copied into later.
        fixed = inputs._replace(
            tokens=inputs.tokens.clone(),
            positions=inputs.positions.clone(),
            write=inputs.write.clone(),
            mask=inputs.mask.clone(),
        )
        graph = _Graph(fixed, self.capture(lambda: self.step(fixed)))
        self._graphs[key] = graph
        self.captures += 1
        out = graph.replay()
        self.capture_seconds += time.perf_counter() - t0
        return out
