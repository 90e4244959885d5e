"""Captured steps (modeling/graphs.py) give the eager passes' outputs.

Each test runs twice: on a CPU, where a "capture" runs the step once and a replay runs it
again on the same fixed tensors (what a CUDA graph's replay does with the addresses it
recorded: so the padding, the fixed inputs, the keys by KV storage and the bounds are
checked without a GPU), and on CUDA with real CUDA graphs (skipped without a GPU). The
steps are the eager ones (`compile=False`): the compiler is tests/test_compiled.py's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import modeling.graphs as graphs_module
from modeling.checkpoints.checkpoint import load
from modeling.compiled import CompiledPasses
from modeling.decoder import Transformer
from modeling.graphs import BUCKETS, bucket_for
from modeling.kv_cache import KVCache
from speculative.generation import Generation
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive
from speculative.strategies.tree import TreeSpeculation

# Padded steps multiply other matrix shapes than the eager ones (the BLAS may block them
# differently): fp32 logits within 1e-5 plus 2e-6 of the largest, as compiled ones.
ATOL, SCALE = 1e-5, 2e-6
# Over hundreds of steps each run's cache holds its own roundings, and they compound: up to
# 6e-5 on logits of magnitude 12 after 520 steps (5e-6 of the largest).
DRIFT = 2e-5


class NoHostSync(TorchDispatchMode):
    """Refuses what a CUDA graph capture refuses: reading a tensor's value on the host
    (`.item()`, `bool()`, `int()` of a tensor, `nonzero`)."""

    aten = torch.ops.aten
    SYNCS = (aten.item.default, aten.is_nonzero.default, aten._local_scalar_dense.default,
             aten.nonzero.default)  # fmt: skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in self.SYNCS:
            raise RuntimeError(f"{func} reads a value on the host: not capturable")
        return func(*args, **(kwargs or {}))


class Replaying:
    """A CPU stand-in for capturing: the warm-up run, the "captured" run refusing host
    syncs, then each replay reruns the step on the tensors it was given (it reads nothing
    else, as a graph reads nothing else) and writes its result into one output tensor, as
    a graph's replays all do. Counts the times every graph was dropped."""

    def __init__(self) -> None:
        self.releases = 0

    def released(self) -> None:
        self.releases += 1

    def __call__(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        step()
        with NoHostSync():
            out = step().clone()

        def replay() -> torch.Tensor:
            out.copy_(step())
            return out

        return replay


DEVICES = [
    pytest.param("cpu", id="cpu-replayed"),
    pytest.param(
        "cuda",
        id="cuda-graphs",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def model(stories_draft: Path, device: str) -> Iterator[Transformer]:
    draft = load(str(stories_draft), device=device)[0]
    yield draft
    draft.compiled = None


def graphed(model: Transformer) -> CompiledPasses:
    capture = Replaying() if model.device.type == "cpu" else None
    return CompiledPasses(model, compile=False, graphs=True, capture=capture)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert float((a - b).abs().max()) <= ATOL + SCALE * float(b.abs().max())


def _tree(cache: KVCache, nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A binary tree of `nodes` nodes after the cache's entries: (ids, positions, mask)."""
    n = cache.length
    mask = torch.zeros(nodes, n + nodes, dtype=torch.bool)
    mask[:, :n] = True
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
    depth = [0] * nodes
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
            depth[i] = depth[parent] + 1
        mask[i, n + i] = True
    return torch.arange(nodes) + 5, n + torch.tensor(depth), mask.to(cache.k.device)


def _steps(model: Transformer, capacity: int = 600) -> tuple[list[int], list[torch.Tensor]]:
    """A 3-token prompt, greedy decode steps past the first allocation (512 slots), and
    tree passes of 3, 5 and 17 nodes (padded to 4, 8 and 32)."""
    cache = model.new_cache(capacity)
    logits = [model.forward(torch.tensor([1, 403, 261]), torch.arange(3), cache)]
    token = logits[-1][-1:].argmax(-1)
    tokens: list[int] = []
    for i in range(520):
        logits.append(model.forward(token, torch.tensor([3 + i]), cache))
        token = logits[-1].argmax(-1)
        tokens.append(int(token))
    for nodes in (3, 5, 17):
        n = cache.length
        ids, positions, mask = _tree(cache, nodes)
        logits.append(model.forward(ids, positions, cache, mask=mask))
        cache.truncate(n + 1)  # keep the root, as a round commits its accepted path
    assert bool(torch.isfinite(cache.k).all() and torch.isfinite(cache.v).all())
    return tokens, [x.cpu() for x in logits]


def test_graphed_steps_equal_eager(model: Transformer) -> None:
    """520 decode steps and three trees: the same greedy tokens, and logits that stay
    within DRIFT of the eager ones although each run's cache holds its own roundings."""
    eager_tokens, eager_logits = _steps(model)
    passes = graphed(model)
    model.compiled = passes
    tokens, logits = _steps(model)
    assert passes.graphs is not None
    assert tokens == eager_tokens
    for a, b in zip(logits, eager_logits, strict=True):
        assert float((a - b).abs().max()) <= DRIFT * float(b.abs().max())
    # One capture per (storage, bucket), every other step a replay: the prompt (bucket 4)
    # and the decode steps on the first allocation (512 slots), then the decode steps and
    # the trees (buckets 4, 8 and 32) on the grown one.
    assert passes.graphs.captures == 6
    assert passes.graphs.replays == len(logits) - 6
    assert passes.passes == len(logits)


def test_a_graphed_step_is_the_eager_step(model: Transformer) -> None:
    """From the same cache (two eager prefills, identical), each step shape graphed gives
    the eager step's logits within ATOL plus SCALE of the largest."""
    caches = [model.new_cache(700) for _ in range(2)]
    prompt = torch.arange(515) % 400 + 3
    for cache in caches:
        for start in range(0, 515, 128):  # eager: each chunk is above MAX_TOKENS or unpadded
            chunk = prompt[start : start + 128]
            model.forward(chunk, torch.arange(start, start + chunk.shape[0]), cache)
    passes = graphed(model)
    for nodes in (1, 3, 5, 17, 64):
        ids, positions, mask = _tree(caches[0], nodes)
        out = []
        for cache, compiled in zip(caches, (passes, None), strict=True):
            model.compiled = compiled
            out.append(model.forward(ids, positions, cache, mask=mask).cpu())
            cache.truncate(515)
        _close(*out)
    assert passes.graphs is not None and passes.graphs.captures == 5


def test_padding_never_crosses_the_context(model: Transformer) -> None:
    """A step whose bucket would pass the cache's capacity runs unpadded (and ungraphed
    unless its count is a bucket), so a generation can use its context to the last slot."""
    passes = graphed(model)
    model.compiled = passes
    cache = model.new_cache(12)
    model.forward(torch.arange(9), torch.arange(9), cache)  # 9 tokens: bucket 16 > 12
    assert passes.graphs is not None and passes.graphs.captures == 0
    eager = model.new_cache(12)
    model.compiled = None
    model.forward(torch.arange(9), torch.arange(9), eager)
    model.compiled = passes
    out = model.forward(torch.tensor([4, 5, 6]), torch.arange(9, 12), cache)  # bucket 4 > 3
    model.compiled = None
    _close(out.cpu(), model.forward(torch.tensor([4, 5, 6]), torch.arange(9, 12), eager).cpu())
    assert cache.length == 12 and passes.passes == 2 and passes.graphs.captures == 0


def test_each_kv_storage_has_its_graphs_and_they_are_bounded(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two live caches are two storages: their graphs never mix (each cache's steps stay
    exact), and no more than MAX_GRAPHS are kept (past it all are dropped); a dropped one
    is captured again."""
    monkeypatch.setattr(graphs_module, "MAX_GRAPHS", 3)
    passes = graphed(model)
    caches = [model.new_cache(64) for _ in range(4)]
    eager = [model.new_cache(64) for _ in range(4)]
    for step in range(3):
        for i in range(4):
            token = torch.tensor([10 * i + step + 1])
            position = torch.tensor([step])
            model.compiled = passes
            out = model.forward(token, position, caches[i])
            model.compiled = None
            _close(out.cpu(), model.forward(token, position, eager[i]).cpu())
    assert passes.graphs is not None and len(passes.graphs) == 3
    assert passes.graphs.captures == 12  # 4 storages round-robin over 3 kept graphs
    if isinstance(passes.graphs.capture, Replaying):  # on CUDA, the pool renewed each time
        assert passes.graphs.capture.releases == 3  # (captured into a dead one: an assert)


def test_released_graphs_free_their_pool_and_steps_stay_exact(model: Transformer) -> None:
    """Memory pressure's `graph_pools` step: every graph dropped (on CUDA the device memory
    they held goes back to the allocator), steps uncaptured and exact while held, and
    captured anew once resumed."""
    passes = graphed(model)
    model.compiled = passes
    graphs = passes.graphs
    assert graphs is not None
    caches, eager = model.new_cache(64), model.new_cache(64)
    cuda = model.device.type == "cuda"

    def step(position: int) -> None:
        token, where = torch.tensor([position + 3]), torch.tensor([position])
        model.compiled = passes
        out = model.forward(token, where, caches)
        model.compiled = None
        _close(out.cpu(), model.forward(token, where, eager).cpu())

    step(0)
    step(1)
    assert len(graphs) == 1 and graphs.captures == 1 and graphs.replays == 1
    if cuda:
        torch.cuda.synchronize()
        held = torch.cuda.memory_reserved()
    assert graphs.release() == 1 and len(graphs) == 0 and graphs.held
    if cuda:
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() < held
    for position in range(2, 5):
        step(position)
    assert graphs.captures == 1 and len(graphs) == 0  # nothing captured while held
    graphs.resume()
    step(5)
    step(6)
    assert graphs.captures == 2 and len(graphs) == 1 and graphs.replays == 2


def test_warm_up_captures_every_bucket(model: Transformer) -> None:
    passes = graphed(model)
    lines: list[str] = []
    passes.warm(lines.append)
    assert lines == [f"compiling {n}-token steps and their CUDA graph" for n in BUCKETS]
    assert passes.graphs is not None and passes.graphs.captures == len(BUCKETS)


def test_buckets() -> None:
    assert [bucket_for(n) for n in (1, 2, 3, 5, 17, 33, 64, 65)] == [1, 2, 4, 8, 32, 64, 64, None]


def test_graphed_tree_speculation_is_lossless(
    model: Transformer, stories_target: Path, device: str
) -> None:
    """Greedy tree speculation with a graphed draft emits the target's own greedy text, and
    the draft proposes what the eager draft proposes (the same passes)."""
    target, tokenizer = load(str(stories_target), device=device)[:2]
    prompt = tokenizer.encode("Once upon a time")

    def run(strategy: TreeSpeculation | Autoregressive) -> tuple[list[int], int]:
        session = strategy.new_session(len(prompt) + 48)
        params = SamplingParams(temperature=0.0)
        gen = Generation(strategy, session, tokenizer, prompt, params, max_tokens=48)
        gen.run()
        return gen.token_ids, gen.stats.decode_passes

    reference = run(Autoregressive(target))[0]
    eager = run(TreeSpeculation(target, model, budget=16))
    passes = graphed(model)
    model.compiled = passes
    tree = run(TreeSpeculation(target, model, budget=16))
    assert passes.graphs is not None and passes.graphs.replays > 0
    assert tree[0] == reference and tree == eager


def test_graphs_need_a_cuda_device_or_a_capture(stories_draft: Path) -> None:
    model = load(str(stories_draft))[0]
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CompiledPasses(model, compile=False, graphs=True)
    assert CompiledPasses(model, compile=False).graphs is None  # a CPU model: no graphs


def test_a_kv_cache_allocation_is_a_bucketed_size(stories_draft: Path) -> None:
    """Graphs are keyed by allocation: caches grow by doubling from INITIAL_SLOTS, so a
    long conversation passes through a handful of sizes, not one per step."""
    config = load(str(stories_draft))[0].config
    cache = KVCache(config, 5000)
    sizes = set()
    for _ in range(5000):
        cache.reserve(1)
        cache.commit_append(1)
        sizes.add(cache.allocated)
    assert sorted(sizes) == [512, 1024, 2048, 4096, 5000]


def test_a_step_whose_scores_pass_the_graph_bound_runs_uncaptured(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph's pool keeps its working memory, so a step whose attention scores would pass
    GRAPH_ATTENTION_BYTES runs uncaptured (and unpadded); a single row is always captured."""
    import modeling.compiled as compiled_module
    from modeling.layers.attention import attention_row_bytes

    row = attention_row_bytes(model.config.num_heads, 512)
    monkeypatch.setattr(compiled_module, "GRAPH_ATTENTION_BYTES", 4 * row)  # 4 rows at 512
    passes = graphed(model)
    cache, eager = model.new_cache(512), model.new_cache(512)
    model.forward(torch.arange(4), torch.arange(4), eager)
    model.compiled = passes
    model.forward(torch.arange(4), torch.arange(4), cache)  # bucket 4: captured
    assert passes.graphs is not None and passes.graphs.captures == 1
    ids, positions, mask = _tree(cache, 5)  # bucket 8 > 4 rows: uncaptured, unpadded
    out = model.forward(ids, positions, cache, mask=mask)
    assert passes.graphs.captures == 1 and passes.passes == 2 and cache.length == 9
    model.compiled = None
    _close(out.cpu(), model.forward(ids, positions, eager, mask=mask).cpu())
    model.compiled = passes
    model.forward(torch.tensor([3]), torch.tensor([9]), cache)
    assert passes.graphs.captures == 2


def test_a_failed_capture_falls_back_to_eager(model: Transformer) -> None:
    """A step that synchronises with the host cannot be captured: the model runs eager from
    then on, on the stream it was on (on CUDA: not the capture stream), with the eager
    results."""
    passes = graphed(model)
    step = passes._step

    def syncing(*inputs: torch.Tensor) -> torch.Tensor:
        out = step(*inputs)
        if bool(out.abs().sum() < 0):  # a host sync: illegal while capturing
            raise AssertionError("unreachable")
        return out

    passes._step = syncing
    cuda = model.device.type == "cuda"
    caller = torch.cuda.current_stream() if cuda else None
    model.compiled = passes
    try:
        out = model.forward(torch.arange(3), torch.arange(3), model.new_cache(64))
    finally:
        model.compiled = None
    assert passes.failure is not None and passes.passes == 0
    assert not cuda or torch.cuda.current_stream() == caller
    _close(out.cpu(), model.forward(torch.arange(3), torch.arange(3), model.new_cache(64)).cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_new_cache_on_a_freed_storage_replays_its_graphs(stories_draft: Path) -> None:
    """What lets a few storages serve a daemon: a finished session's cache is freed, the
    next one gets its block from the caching allocator, and its steps replay the graphs
    captured for that address (with their own, exact results)."""
    model = load(str(stories_draft), device="cuda")[0]
    passes = CompiledPasses(model, compile=False)
    model.compiled = passes
    first = model.new_cache(64)
    model.forward(torch.arange(3), torch.arange(3), first)
    address = (first.k.data_ptr(), first.v.data_ptr())
    assert passes.graphs is not None and passes.graphs.captures == 1
    del first
    second = model.new_cache(64)
    if (second.k.data_ptr(), second.v.data_ptr()) != address:
        pytest.skip("the allocator gave the new cache other memory: nothing to replay")
    out = model.forward(torch.tensor([7, 8, 9]), torch.arange(3), second)
    assert passes.graphs.captures == 1 and passes.graphs.replays == 1
    model.compiled = None
    eager = model.forward(torch.tensor([7, 8, 9]), torch.arange(3), model.new_cache(64))
    _close(out.cpu(), eager.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_what_the_graphs_hold_is_within_the_plan(stories_draft: Path) -> None:
    """The device memory reserved while a model warms and captures every bucket on three
    storages stays within what the plan counts for its graphs (offload/device_parts.py)."""
    from daemon.footprint import footprint
    from daemon.memory_plan import GRAPHS
    from offload.device_parts import graph_bytes

    model = load(str(stories_draft), device="cuda")[0]
    context = 2048
    caches = [model.new_cache(context) for _ in range(3)]
    for cache in caches:
        cache.reserve(context)  # the caches' own memory before the baseline
    # An eager step first: its own cuBLAS workspace (on the caller's stream) is the eager
    # passes', not the graphs'.
    model.forward(torch.arange(4), torch.arange(4), model.new_cache(64))
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    before = _segments()
    passes = CompiledPasses(model, compile=False)
    passes.warm()
    warmed = torch.cuda.memory_reserved() - base
    model.compiled = passes
    for cache in caches:
        for n in BUCKETS:
            model.forward(torch.arange(n), torch.arange(n), cache)
            cache.truncate(0)
    torch.cuda.synchronize()
    held = torch.cuda.memory_reserved() - base
    planned = graph_bytes(footprint(model.config, model.dtype, "draft"), GRAPHS, context)
    print(
        f"reserved by graphs {held / 2**20:.1f} MiB (after the warm-up {warmed / 2**20:.1f}),"
        f" planned {planned / 2**20:.1f} MiB"
    )
    after = _segments()
    for key in sorted(after, key=str):
        if after[key] != before.get(key, (0, 0)):
            print(f"  new segments {key}: {after[key]} (before {before.get(key, (0, 0))})")
    assert passes.graphs is not None and passes.graphs.captures == 4 * len(BUCKETS)
    assert held <= planned


def _segments() -> dict[tuple[object, ...], tuple[int, int]]:
    """The allocator's segments by (stream, pool, type): (count, MiB)."""
    out: dict[tuple[object, ...], tuple[int, int]] = {}
    for seg in torch.cuda.memory_snapshot():
        key = (seg["stream"], tuple(seg.get("segment_pool_id", ())), seg["segment_type"])
        count, mib = out.get(key, (0, 0))
        out[key] = (count + 1, mib + seg["total_size"] // 2**20)
    return out
