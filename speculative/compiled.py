"""Compiled passes: a resident model's single-sequence steps as compiled graphs.

On a small model, and on a resident draft on a GPU, a step is a few hundred tiny kernels and
its time goes to Python and PyTorch dispatch (and kernel launches), not to arithmetic; the
draft runs one such step per tree depth, so its cost shrinks the tree the budget can afford.
`torch.compile` traces `Transformer.hidden_states` into fused kernels (Inductor: C++ with a
C++ wrapper on a CPU; on CUDA the graphs are replayed as CUDA graphs).

A graph must not depend on where the sequence stands, so a compiled pass stores through
`FixedSlots`: the new tokens' keys and values go to slots named by a tensor, and every new
token attends over the cache's whole allocation under a (tokens, slots) mask. The
allocation grows by doubling (speculative/kv_cache.py), and graphs are compiled with dynamic
sizes, so two graphs serve every step: one for single tokens (the compiler specialises size
1) and one for 2..MAX_TOKENS tokens, each over any allocation. On CUDA the token count is
padded to a power of two, so that CUDA graphs are recorded for a handful of shapes; padding
rows write free slots past the sequence's end (overwritten later, never committed) and
attend only to themselves.

Eligible: a model on its own layers (a streamer's list moves weights between calls), with
no packed projections (rebuilt per call into a shared scratch), passes of one sequence with
at most MAX_TOKENS tokens. Everything else runs eager. The head (norm, vocabulary
projection) stays eager over the rows that want logits, so the memory plan is unchanged;
attention over the whole allocation costs at most twice the eager attention's keys.
Outputs equal eager ones up to float rounding (the fused kernels sum in another order):
fp32 logits within 1e-5, greedy tokens identical in the tests.

Compiled code is cached on disk by PyTorch (Inductor's FX graph cache) under `cache_dir`,
so a restarted daemon loads its graphs instead of compiling them again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from speculative.kv_cache import KVCache
from speculative.quant import PackedLinear

if TYPE_CHECKING:
    from speculative.model import Segment, Transformer

# Tokens of the largest compiled pass: a draft's frontier at one depth and a decode step fit;
# a prefill chunk or a target's tree pass, with enough work per weight to hide dispatch,
# runs eager.
MAX_TOKENS = 64
# Compiled steps the warm-up runs: one per graph (see the module's docstring).
WARM_TOKENS = (1, 2)


def ineligible(model: Transformer) -> str | None:
    """Why `model`'s passes cannot be compiled, or None when they can."""
    if not isinstance(model.layers, nn.ModuleList):
        return "its layers are streamed (weights move between passes)"
    if any(isinstance(m, PackedLinear) for m in model.layers.modules()):
        return "its projections are packed (each is rebuilt into a scratch per pass)"
    if model.device.type not in ("cpu", "cuda"):
        return f"device {model.device.type} has no compiler backend here"
    return None


def use_cache_dir(path: Path) -> None:
    """Keep PyTorch's compile caches in `path` (specd's cache folder) unless the user chose
    a folder already, so compiled graphs survive restarts and /tmp cleaning."""
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path))


def _bucket(tokens: int) -> int:
    """The padded token count of a CUDA-graphed pass: the next power of two."""
    return 1 << (tokens - 1).bit_length()


def _mark_sizes(
    width: int,
    cache: KVCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    write: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    """Tell the compiler which sizes vary, so that it compiles them as symbols from the first
    trace: the allocation (slots), and the token count when above 1 (a single token is a
    graph of its own). Nothing else is symbolic, so no size is ever unified with a model
    dimension that happens to be equal at trace time."""
    mark = torch._dynamo.mark_dynamic
    for tensor in (cache.k, cache.v):
        mark(tensor, 2)
    mark(mask, 1)
    if width > 1:
        for tensor in (tokens, positions, write, mask):
            mark(tensor, 0)


class CompiledPasses:
    """One model's compiled single-sequence passes (`Transformer.compiled`).

    `hidden_states(segment)` runs a pass through the compiled graph and returns its final
    hidden states, or None when the pass is not one it compiles (the model then runs it
    eager)."""

    def __init__(self, model: Transformer, pad: bool | None = None) -> None:
        reason = ineligible(model)
        if reason is not None:
            raise ValueError(f"cannot compile this model's passes: {reason}")
        self.model = model
        self.cuda = model.device.type == "cuda"
        # Padding only buys something where graphs are recorded per shape (CUDA graphs);
        # tests turn it on on a CPU to check the padded path.
        self.pad = self.cuda if pad is None else pad
        options: dict[str, str | int | bool | Callable[..., Any]] = (
            {"triton.cudagraphs": True} if self.cuda else {"cpp_wrapper": True}
        )
        # Every compiled model adds its two graphs to the one traced function's cache (its
        # guards tell the models apart); past the limit PyTorch would run them eager.
        limits = torch._dynamo.config
        limits.recompile_limit = max(limits.recompile_limit, 64)
        limits.accumulated_recompile_limit = max(limits.accumulated_recompile_limit, 256)
        self._graph: Callable[..., torch.Tensor] = torch.compile(
            self._traced, fullgraph=True, options=options
        )
        self._slot_ids: dict[int, torch.Tensor] = {}  # allocation → arange(allocation)
        self.passes = 0  # passes that ran compiled
        self.warm_seconds: float | None = None

    def _traced(
        self,
        tokens: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        k: torch.Tensor,  # (layers, Hkv, slots, hd)
        v: torch.Tensor,
        write: torch.Tensor,  # (T,) slots
        mask: torch.Tensor,  # (T, slots) bool
    ) -> torch.Tensor:
        from speculative.model import FixedSlots

        fixed = FixedSlots(int(tokens.shape[0]), k, v, write, mask)
        return self.model.hidden_states(tokens, positions, [fixed])

    def hidden_states(self, segment: Segment) -> torch.Tensor | None:
        """Append `segment` to its cache through the compiled graph: its final hidden states
        (T, hidden), the cache's new entries written but not committed (the caller commits,
        as in the eager pass). None: not compiled, nothing done."""
        t = segment.length
        if not 1 <= t <= MAX_TOKENS:
            return None
        width = _bucket(t) if self.pad else t
        cache = segment.cache
        if cache.length + width > cache.capacity:
            return None  # the padding would not fit: the last steps of a full context
        device = self.model.device
        start = cache.reserve(width)
        mask = self._mask(segment, cache, start, width)
        # Copies made here, in the pass's inference mode: a graph's guards tell inference
        # tensors from normal ones, and callers hand both (a prompt, a sampled token).
        tokens = segment.tokens.to(device, copy=True)
        positions = segment.positions.to(device, copy=True)
        if width > t:
            tokens = torch.cat((tokens, tokens.new_zeros(width - t)))
            positions = torch.cat((positions, positions.new_zeros(width - t)))
        write = self._slots(cache)[start : start + width]
        _mark_sizes(width, cache, tokens, positions, write, mask)
        if self.cuda:
            # CUDA graphs replay fixed addresses: the cache is updated in place, so it is
            # marked static (a grown cache is a new tensor, marked on first use).
            for tensor in (cache.k, cache.v):
                torch._dynamo.mark_static_address(tensor)
        x = self._graph(tokens, positions, cache.k, cache.v, write, mask)
        self.passes += 1
        return x[:t]

    def _slots(self, cache: KVCache) -> torch.Tensor:
        n = cache.allocated
        ids = self._slot_ids.get(n)
        if ids is None:
            ids = torch.arange(n, device=self.model.device)
            self._slot_ids[n] = ids
        return ids

    def _mask(self, segment: Segment, cache: KVCache, start: int, width: int) -> torch.Tensor:
        """The (width, allocation) mask: each real token's row as the eager pass builds it
        (full_mask), padding rows seeing only their own slot."""
        from speculative.model import full_mask

        t, slots = segment.length, cache.allocated
        ids = self._slots(cache)
        if t == 1 and width == 1 and segment.mask is None:
            return (ids < start + 1)[None, :]  # (1, slots): a decode step sees its prefix
        device = self.model.device
        mask = torch.zeros(width, slots, dtype=torch.bool, device=device)
        rows = full_mask(segment.mask, start, t, device)
        if rows is None:  # one token, padded: it sees the whole prefix and itself
            mask[0, : start + 1] = True
        else:
            mask[:t, : start + t] = rows
        if width > t:
            pad = torch.arange(t, width, device=device)
            mask[pad, start + pad] = True
        return mask

    def warm(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile every graph now (one step per graph on a scratch cache), so no request
        waits for the compiler; loads them from the disk cache when they were compiled
        before. Returns the seconds it took."""
        t0 = time.perf_counter()
        model = self.model
        cache = KVCache(model.config, MAX_TOKENS * 2, dtype=model.dtype, device=model.device)
        from speculative.model import Segment

        for n in WARM_TOKENS:
            if progress is not None:
                progress(f"compiling {n}-token steps")
            cache.truncate(0)
            tokens = torch.zeros(n, dtype=torch.long)
            positions = torch.arange(n)
            with torch.inference_mode():
                if self.hidden_states(Segment(tokens, positions, cache)) is None:
                    raise RuntimeError(f"a {n}-token warm-up step did not compile")
        self.passes = 0
        self.warm_seconds = time.perf_counter() - t0
        return self.warm_seconds
