"""CUDA graphs of a resident model's steps: a whole decode or draft step in one launch.

A GPU step of a small resident model (a 1B draft at one tree depth, a decode step) is a few
hundred kernels of microseconds each; launching them from Python costs more than running
them. A captured CUDA graph replays every kernel of the step with one call. What a replay
cannot change is any address or size: the graph reads and writes exactly the memory it was
captured with. So a step is captured per

- KV storage: the (k, v) tensors of the cache it writes, by address and allocation. A
  cache's storage only changes when it grows (doubling, speculative/kv_cache.py), and the
  caching allocator hands a new session's cache the block a finished one freed, so a few
  storages serve a daemon's conversations; a graph is valid for any cache whose storage
  sits at its addresses, with its size;
- token bucket: the step's token count padded to the next of BUCKETS. The padding rows
  read token 0, write their keys and values to the slots after the step's (reserved, past
  the cache's length: never attended by anyone, overwritten by the next step) and attend
  only to their own slot, so that every row's softmax stays finite;
- a bound on working memory: a step's attention scores stay under GRAPH_ATTENTION_BYTES,
  since the pool keeps what a graph used (the memory plan counts it:
  offload/planning.py).

Everything else a step varies goes through the graph's static inputs, copied in before
each replay: tokens, positions, the slots written and the (tokens, slots) mask. At most
MAX_GRAPHS graphs are kept per model (least recently used dropped); they share one memory
pool, which is safe because a replay's output is read (by the eager head) before the next
replay starts.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Padded token counts of the captured steps: a decode step, a linear draft's few tokens and
# a tree's frontier at each depth, up to compiled.MAX_TOKENS.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The most attention scores a captured step may hold (speculative/attention.py's bound for
# any pass is 128 MiB): a graph's pool keeps its working memory for good, so a captured step
# attends with at most this many bytes of scores and a wider one runs uncaptured. 32 MiB
# holds a 64-token step over 4k slots of a 32-head model, 8 tokens over 16k, one row over
# 128k (a single row is always allowed: eager holds it too).
GRAPH_ATTENTION_BYTES = 32 * 2**20
# Graphs kept per model: every bucket for several KV storages (a daemon's few live caches
# and the sizes each grew through). Each holds its inputs, its (bucket, hidden) output and
# its share of the pool's intermediates.
MAX_GRAPHS = 64

# A step as the graph runs it: (tokens, positions, k, v, write, mask) -> hidden states.
Step = Callable[..., torch.Tensor]
# Captures a step over fixed tensors; returns the function that replays it.
Capture = Callable[[Callable[[], torch.Tensor], Any], Callable[[], torch.Tensor]]


def bucket_for(tokens: int) -> int | None:
    """The padded token count of a `tokens`-token step, or None above the largest bucket."""
    return next((b for b in BUCKETS if b >= tokens), None)


def capture_cuda_graph(step: Callable[[], torch.Tensor], pool: Any) -> Callable[[], torch.Tensor]:
    """Capture `step` (reading and writing only fixed tensors) as a CUDA graph in `pool`.
    One run on a side stream first, as capturing requires: it initialises the libraries'
    workspaces outside the graph (its writes are the step's own, redone by the replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the offload streamer's threads may copy layers while this captures.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


@dataclass
class _Graph:
    """One captured step and the fixed inputs it reads."""

    tokens: torch.Tensor  # (B,)
    positions: torch.Tensor  # (B,)
    write: torch.Tensor  # (B,) slots
    mask: torch.Tensor  # (B, slots) bool
    replay: Callable[[], torch.Tensor]  # returns the (B, hidden) output, overwritten next time


class StepGraphs:
    """One model's captured steps (see the module's docstring).

    `run(tokens, positions, k, v, write, mask)` takes a step already padded to a bucket
    and returns its (bucket, hidden) output: the graph's own tensor, valid until the next
    replay of that graph, so the caller reads it at once."""

    def __init__(self, step: Step, capture: Capture | None = None) -> None:
        self.step = step
        self.capture = capture or capture_cuda_graph
        self.pool = torch.cuda.graph_pool_handle() if capture is None else None
        self._graphs: OrderedDict[tuple[int, int, int, int], _Graph] = OrderedDict()
        self.captures = 0  # graphs captured so far (more than len(): some were dropped)
        self.capture_seconds = 0.0
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(
        self,
        tokens: torch.Tensor,  # (B,)
        positions: torch.Tensor,  # (B,)
        k: torch.Tensor,  # (layers, Hkv, slots, hd) the cache's whole allocation
        v: torch.Tensor,
        write: torch.Tensor,  # (B,)
        mask: torch.Tensor,  # (B, slots) bool
    ) -> torch.Tensor:
        key = (k.data_ptr(), v.data_ptr(), int(k.shape[2]), int(tokens.shape[0]))
        graph = self._graphs.get(key)
        if graph is None:
            return self._capture(key, tokens, positions, k, v, write, mask)
        self._graphs.move_to_end(key)
        graph.tokens.copy_(tokens)
        graph.positions.copy_(positions)
        graph.write.copy_(write)
        graph.mask.copy_(mask)
        self.replays += 1
        return graph.replay()

    def _capture(
        self,
        key: tuple[int, int, int, int],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        write: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Capture the step for `key` with this step's inputs as its fixed inputs, and run
        it (the replay computes this step)."""
        t0 = time.perf_counter()
        while len(self._graphs) >= MAX_GRAPHS:
            self._graphs.popitem(last=False)
        # Fixed inputs are ordinary allocations, outside the graphs' pool: a capture may
        # reuse what another graph freed in the pool, never a tensor copied into later.
        tokens, positions, write, mask = (x.clone() for x in (tokens, positions, write, mask))
        replay = self.capture(lambda: self.step(tokens, positions, k, v, write, mask), self.pool)
        graph = _Graph(tokens, positions, write, mask, replay)
        self._graphs[key] = graph
        self.captures += 1
        out = graph.replay()
        self.capture_seconds += time.perf_counter() - t0
        return out
