"""Compiled passes: a resident model's single-sequence steps as compiled graphs.

On a small model, and on a resident draft on a GPU, a step is a few hundred tiny kernels and
its time goes to Python and PyTorch dispatch (and kernel launches), not to arithmetic; the
draft runs one such step per tree depth, so its cost shrinks the tree the budget can afford.
`torch.compile` traces `Transformer.hidden_states` into fused kernels (Inductor: C++ with a
C++ wrapper on a CPU, Triton on CUDA).

A graph must not depend on where the sequence stands, so a compiled pass stores through
`FixedSlots`: the new tokens' keys and values go to slots named by a tensor, and every new
token attends over the cache's whole allocation under a (tokens, slots) mask. The
allocation grows by doubling (modeling/kv_cache.py), and graphs are compiled with dynamic
sizes, so two graphs serve every step: one for single tokens (the compiler specialises size
1) and one for 2..MAX_TOKENS tokens, each over any allocation.

Eligible: a model on its own layers (a streamer's list moves weights between calls), whose
packed projections are computed where they lie (the CPU kernels) or rebuilt by operations a
graph traces (`PackedLinear.traceable`: HQQ, the substitute draft's; then into the graph's
own temporaries, which a CUDA graph's pool keeps: the plan counts them), passes of one sequence with
at most MAX_TOKENS tokens whose attention fits one query chunk over the allocation (the
memory bound `attend` keeps, modeling/layers/attention.py's ATTENTION_CHUNK_BYTES). Everything
else runs eager, and so does a model whose graph fails (logged once). The head (norm,
vocabulary projection) stays eager over the rows that want logits, so a compiled pass holds
what the plan's pass figure counts; attention over the whole allocation costs at most twice
the eager attention's keys, within the same bound. (CUDA graphs hold memory for good; the
plan counts that apart: offload/device_parts.py.)
Outputs equal eager ones up to float rounding (the fused kernels sum in another order, as a
batched pass does): greedy tokens identical in the tests, fp32 logits within 1e-5 plus 2e-6
of the largest.

On CUDA the step is also captured as CUDA graphs (modeling/graphs.py): each step padded
to a token bucket and replayed with one launch per KV storage and bucket, so a resident
draft's step costs its kernels' time, not their launches'. With `compile=False` the graphs
capture the eager step (no compiler needed).

Compiled code is cached on disk by PyTorch (Inductor's FX graph cache) under `cache_dir`,
so a restarted daemon loads its graphs instead of compiling them again.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modeling.decoder import Transformer
from modeling.graphs import (
    BUCKETS,
    GRAPH_ATTENTION_BYTES,
    Capture,
    StepGraphs,
    StepInputs,
    bucket_for,
)
from modeling.kv_cache import INITIAL_SLOTS, KVCache
from modeling.layers.attention import FixedSlots, full_mask, query_chunk, query_scales
from modeling.protocol import Segment
from modeling.weights import cpu_kernels
from modeling.weights.packed import PackedLinear

log = logging.getLogger("specd.compile")

# Tokens of the largest compiled pass: a draft's frontier at one depth and a decode step fit;
# a prefill chunk or a target's tree pass, with enough work per weight to hide dispatch,
# runs eager.
MAX_TOKENS = 64
# Compiled steps the warm-up runs: one per graph (see the module's docstring); with CUDA
# graphs, one per bucket (graphs.BUCKETS) too.
WARM_TOKENS = (1, 2)


def ineligible(model: Transformer) -> str | None:
    """Why `model`'s passes cannot be compiled, or None when they can."""
    if not isinstance(model.layers, nn.ModuleList):
        return "its layers are streamed (weights move between passes)"
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not all(m.traceable or m.computed_in_place(model.dtype, model.device) for m in packed):
        return "its projections are packed (each is rebuilt into a scratch per pass)"
    if model.windowed:
        return "its layers attend through sliding windows (a compiled pass holds one mask)"
    if model.device.type not in ("cpu", "cuda"):
        return f"device {model.device.type} has no compiler backend here"
    return None


def rebuilds_in_graph(model: Transformer) -> bool:
    """Whether a compiled pass of `model` rebuilds packed projections (the HQQ substitute's)
    rather than computing them where they lie."""
    return any(
        isinstance(m, PackedLinear)
        and m.traceable
        and not m.computed_in_place(model.dtype, model.device)
        for m in model.modules()
    )


def use_cache_dir(path: Path) -> None:
    """Keep PyTorch's compile caches in `path` (specd's cache folder) unless the user chose
    a folder already, so compiled graphs survive restarts and /tmp cleaning."""
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path))


def _mark_sizes(inputs: StepInputs) -> None:
    """Tell the compiler which sizes vary, so that it compiles them as symbols from the first
    trace: the allocation (slots), and the token count when above 1 (a single token is a
    graph of its own). Nothing else is symbolic, so no size is ever unified with a model
    dimension that happens to be equal at trace time."""
    mark = torch._dynamo.mark_dynamic
    for tensor in (inputs.k, inputs.v):
        mark(tensor, 2)
    mark(inputs.mask, 1)
    if inputs.tokens.shape[0] > 1:
        for tensor in (inputs.tokens, inputs.positions, inputs.write, inputs.mask):
            mark(tensor, 0)


def _own_code(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`method` (bound) as a function with a code object of its own: PyTorch keeps compiled
    graphs per code object, so each model's graphs are found without checking which model
    is asking (see `_input_guards`)."""
    assert isinstance(method, types.MethodType)
    func, owner = method.__func__, method.__self__
    code = func.__code__.replace(co_name=f"{func.__name__}_{id(owner):x}")
    own = types.FunctionType(
        code, func.__globals__, code.co_name, func.__defaults__, func.__closure__
    )
    return types.MethodType(own, owner)


def _input_guards(entries: list[Any]) -> list[bool]:
    """Which guards a compiled step checks before each call: those on its inputs (dtypes,
    sizes, strides, inference or not), on their symbolic sizes' relations and on the global
    grad and inference state. Dropped: those on the model's modules and attributes (~200
    per layer) and on module globals, ~70 µs of a ~500 µs CPU decode step. Safe because a
    model's weights and attributes never change once its passes are compiled (loading sets
    them all first: dtype, vocabulary width, fused projections) and each model compiles its
    own code object (`_own_code`), so no other model can reach its graphs."""
    return [
        not entry.is_global
        and not (
            entry.orig_guard.source is not None
            and entry.orig_guard.source.is_unspecialized_nn_module()
        )
        for entry in entries
    ]


class CompiledPasses:
    """One model's compiled single-sequence passes (`Transformer.compiled`, a
    modeling.decoder `HiddenStatesPass`).

    `hidden_states(segment)` runs a pass through the compiled graph (on CUDA, its captured
    CUDA graph) and returns its final hidden states, or None when the pass is not one it
    compiles (the model then runs it eager).

    `compile`: trace the step with torch.compile (False: the eager step, for graphs alone).
    `graphs`: capture CUDA graphs (None: where the model is on CUDA). `capture`: how a
    graph is captured (modeling/graphs.py; tests replay the step itself on a CPU)."""

    def __init__(
        self,
        model: Transformer,
        compile: bool = True,
        graphs: bool | None = None,
        capture: Capture | None = None,
    ) -> None:
        reason = ineligible(model)
        if reason is not None:
            raise ValueError(f"cannot compile this model's passes: {reason}")
        self.model = model
        use_graphs = model.device.type == "cuda" if graphs is None else graphs
        if use_graphs and not compile and rebuilds_in_graph(model):
            # The eager step rebuilds into the model's shared scratch, which a graph would
            # then hold and overwrite at each replay: only a traced step rebuilds its own.
            raise ValueError(
                "cannot capture this model's eager steps: it rebuilds packed projections"
            )
        if use_graphs and capture is None and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {model.device}")
        self._step: Callable[..., torch.Tensor] = self._traced
        if compile:
            if model.device.type == "cpu":
                cpu_kernels.available()  # built (or found missing) before a graph asks
            options: dict[str, str | int | bool | Callable[..., Any]] = (
                {"cpp_wrapper": True} if model.device.type == "cpu" else {}
            )
            # Each model compiles its own code object (`_own_code`), so its two graphs are
            # its alone; the limits only need to allow the recompiles a failure could cause.
            limits = torch._dynamo.config
            limits.recompile_limit = max(limits.recompile_limit, 64)
            limits.accumulated_recompile_limit = max(limits.accumulated_recompile_limit, 256)
            options["guard_filter_fn"] = _input_guards
            self._step = torch.compile(_own_code(self._traced), fullgraph=True, options=options)
        self.graphs = StepGraphs(self._marked_step, capture) if use_graphs else None
        self._slot_ids: dict[int, torch.Tensor] = {}  # allocation → arange(allocation)
        self.passes = 0  # passes that ran compiled
        self.warm_seconds: float | None = None
        self.failure: BaseException | None = None  # set when a graph failed: eager since

    def _traced(
        self,
        tokens: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        k: torch.Tensor,  # (layers, Hkv, slots, hd)
        v: torch.Tensor,
        write: torch.Tensor,  # (T,) slots
        mask: torch.Tensor,  # (T, slots) bool
    ) -> torch.Tensor:
        model = self.model
        scale = query_scales(model.config.query_scale, positions, model.dtype)
        fixed = FixedSlots(int(tokens.shape[0]), k, v, write, mask, query_scale=scale)
        return model.hidden_states(tokens, positions, [fixed])

    def _marked_step(self, inputs: StepInputs) -> torch.Tensor:
        # The graphs' fixed inputs are copies, made after the caller marked its own.
        _mark_sizes(inputs)
        return self._step(*inputs)

    def hidden_states(self, segment: Segment) -> torch.Tensor | None:
        """Append `segment` to its cache through the compiled graph: its final hidden states
        (T, hidden), the cache's new entries written but not committed (the caller commits,
        as in the eager pass). None: not compiled, nothing committed."""
        t = segment.length
        cache = segment.cache
        if self.failure is not None or not 1 <= t <= MAX_TOKENS:
            return None
        # A graphed step is padded to its bucket, when the padding fits in the context and
        # its attention scores in a graph's bound (after the cache grew for it).
        bucket = bucket_for(t) if self.graphs is not None else None
        if bucket is not None and cache.length + bucket > cache.capacity:
            bucket = None
        start = cache.reserve(bucket or t)
        heads = self.model.config.num_heads
        # A single row always fits (query_chunk is at least 1).
        if bucket is not None and bucket > query_chunk(
            heads, cache.allocated, GRAPH_ATTENTION_BYTES
        ):
            bucket = None
        width = bucket or t
        # One query chunk over the whole allocation: `attend` would split a bigger pass in
        # a Python loop over token counts, which a graph with symbolic sizes cannot hold.
        if width > query_chunk(heads, cache.allocated):
            return None
        device = self.model.device
        mask = self._mask(segment, cache, start, width)
        # Copies made here, in the pass's inference mode: a graph's guards tell inference
        # tensors from normal ones, and callers hand both (a prompt, a sampled token).
        if width == t:
            tokens = segment.tokens.to(device, copy=True)
            positions = segment.positions.to(device, copy=True)
        else:  # padding rows: token 0 at position 0 (finite, and seen by no real row)
            tokens = torch.zeros(width, dtype=torch.long, device=device)
            positions = torch.zeros(width, dtype=torch.long, device=device)
            tokens[:t] = segment.tokens
            positions[:t] = segment.positions
        write = self._slots(cache)[start : start + width]
        inputs = StepInputs(tokens, positions, cache.k, cache.v, write, mask)
        try:
            if bucket is not None and self.graphs is not None:
                x = self.graphs.run(inputs)
            else:
                x = self._marked_step(inputs)
        except Exception as exc:  # the compiler is an optimisation: fall back, say so once
            self.failure = exc
            log.error("a compiled pass failed; this model runs eager from now on", exc_info=exc)
            return None  # the slots it may have written are past the length: unused
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
        """The (width, allocation) mask: each token's row as the eager pass builds it
        (full_mask), the slots past it masked; a padding row sees only its own slot."""
        t = segment.length
        ids = self._slots(cache)
        if width == 1 and segment.mask is None:
            return (ids < start + 1)[None, :]  # (1, slots): a decode step sees its prefix
        device = self.model.device
        mask = torch.zeros(width, cache.allocated, dtype=torch.bool, device=device)
        rows = full_mask(segment.mask, start, t, device)
        assert rows is not None  # only a lone token needs no mask, and it is never padded
        mask[:t, : start + t] = rows
        if width > t:
            pads = torch.eye(width - t, dtype=torch.bool, device=device)
            mask[t:, start + t : start + width] = pads
        return mask

    def warm(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile every graph now (one step per graph on a scratch cache), so no request
        waits for the compiler; loads them from the disk cache when they were compiled
        before. With CUDA graphs, capture every bucket's too, on a cache of a session's
        first allocation (whose block a session's cache then tends to get). Returns the
        seconds it took."""
        t0 = time.perf_counter()
        model = self.model
        # A KV cache's storage is never an inference tensor (modeling/kv_cache.py), so
        # the warm-up's graphs are the ones a session's cache hits.
        slots = 2 * MAX_TOKENS if self.graphs is None else INITIAL_SLOTS
        cache = KVCache(model.config, slots, dtype=model.dtype, device=model.device)
        steps = WARM_TOKENS if self.graphs is None else BUCKETS
        for n in steps:
            if progress is not None:
                what = "steps" if self.graphs is None else "steps and their CUDA graph"
                progress(f"compiling {n}-token {what}")
            cache.truncate(0)
            tokens = torch.zeros(n, dtype=torch.long)
            positions = torch.arange(n)
            with torch.inference_mode():
                if self.hidden_states(Segment(tokens, positions, cache)) is None:
                    raise RuntimeError(
                        f"a {n}-token warm-up step did not compile: {self.failure}"
                    ) from self.failure
        self.passes = 0
        self.warm_seconds = time.perf_counter() - t0
        return self.warm_seconds
