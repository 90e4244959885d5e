"""Compiled passes (modeling/compiled.py) give the eager passes' outputs.

One module-scoped compile of the real stories260k draft (two graphs, the warm-up's), shared
by every test: compiling is the expensive part (tens of seconds on a cold disk cache), the
steps afterwards are cheap."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from modeling.checkpoints.checkpoint import load
from modeling.compiled import MAX_TOKENS, CompiledPasses, ineligible
from modeling.decoder import Transformer
from modeling.kv_cache import KVCache
from modeling.layers.attention import ATTENTION_CHUNK_BYTES, attention_row_bytes, query_chunk
from modeling.layers.norms import RMSNorm
from modeling.substitute import build_substitute
from modeling.weights import cpu_kernels
from modeling.weights.hqq import HQQLinear
from modeling.weights.packed import PackedLinear
from scripts.tiny_models import make_checkpoint
from speculative.drafting import ModelDrafter
from speculative.generation import Generation
from speculative.rounds import Strategy
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive
from speculative.strategies.linear import Linear
from speculative.strategies.tree import TreeSpeculation

# Inductor's fused kernels sum in another order than the eager kernels: measured up to
# 1.7e-5 on fp32 logits whose largest magnitude is ~13 (1.3e-6 of it), so the bound scales
# with the row's magnitude: 1e-5 plus 2e-6 of the largest logit.
ATOL, SCALE = 1e-5, 2e-6


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert float((a - b).abs().max()) <= ATOL + SCALE * float(b.abs().max())


@pytest.fixture(scope="module")
def draft(stories_draft: Path) -> Transformer:
    model = load(str(stories_draft))[0]
    return model


@pytest.fixture(scope="module")
def compiled(draft: Transformer) -> Iterator[CompiledPasses]:
    passes = CompiledPasses(draft)
    lines: list[str] = []
    passes.warm(lines.append)
    assert lines == ["compiling 1-token steps", "compiling 2-token steps"]
    yield passes
    draft.compiled = None


def _steps(model: Transformer) -> tuple[list[int], list[torch.Tensor]]:
    """A 3-token prompt, 30 greedy decode steps, then a 5-node tree pass growing past them
    (a mask over the whole cache, as the drafter's per-depth passes use)."""
    cache = model.new_cache(512)
    logits = [model.forward(torch.tensor([1, 403, 261]), torch.arange(3), cache)]
    token = logits[-1][-1:].argmax(-1)
    tokens: list[int] = []
    for i in range(30):
        logits.append(model.forward(token, torch.tensor([3 + i]), cache))
        token = logits[-1].argmax(-1)
        tokens.append(int(token))
    n = cache.length
    mask = torch.zeros(5, n + 5, dtype=torch.bool)
    mask[:, :n] = True
    for row, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4]]):
        mask[row, [n + a for a in ancestors]] = True
    positions = torch.tensor([n, n + 1, n + 1, n + 2, n + 2])
    logits.append(model.forward(torch.tensor([5, 6, 7, 8, 9]), positions, cache, mask=mask))
    return tokens, logits


def test_compiled_steps_equal_eager(draft: Transformer, compiled: CompiledPasses) -> None:
    draft.compiled = None
    eager_tokens, eager_logits = _steps(draft)
    draft.compiled = compiled
    graphs = counters["stats"]["unique_graphs"]
    tokens, logits = _steps(draft)
    assert compiled.passes == 32  # prompt, 30 decode steps, the tree: all compiled
    assert counters["stats"]["unique_graphs"] == graphs  # the warm-up's graphs served all
    assert tokens == eager_tokens
    for a, b in zip(logits, eager_logits, strict=True):
        _close(a, b)


def test_a_warm_up_inside_inference_mode_compiles_the_sessions_graphs(
    draft: Transformer,
) -> None:
    """The daemon warms on a thread inside inference mode; a KV cache made there is still a
    normal tensor, so the graphs it compiles are the ones sessions' caches hit: a session's
    steps afterwards compile nothing new."""
    passes = CompiledPasses(draft)
    with torch.inference_mode():
        passes.warm()  # loads the kernels from the disk cache (the fixture compiled them)
    graphs = counters["stats"]["unique_graphs"]
    draft.compiled = passes
    try:
        _steps(draft)
    finally:
        draft.compiled = None
    assert passes.passes == 32
    assert counters["stats"]["unique_graphs"] == graphs


def test_each_model_has_graphs_of_its_own(
    stories_draft: Path, draft: Transformer, compiled: CompiledPasses
) -> None:
    """Guards on the model's modules are not checked before a step (`_input_guards`): each
    model's passes compile a code object of their own, so two models of one architecture
    never run each other's graphs. Here a second copy whose norms have another epsilon (a
    constant the graph bakes in; the weights are read at each call): its steps give its own
    eager logits, not the first model's."""
    other = load(str(stories_draft))[0]
    for module in other.modules():
        if isinstance(module, RMSNorm):
            module.eps = 0.5
    other_passes = CompiledPasses(other)
    other.compiled = other_passes
    draft.compiled = compiled
    try:
        cache, other_cache = draft.new_cache(64), other.new_cache(64)
        first = draft.forward(torch.arange(3), torch.arange(3), cache)
        second = other.forward(torch.arange(3), torch.arange(3), other_cache)
    finally:
        draft.compiled = other.compiled = None
    assert other_passes.passes == 1
    _close(second, other.forward(torch.arange(3), torch.arange(3), other.new_cache(64)))
    assert float((first - second).abs().max()) > 1e-3


def test_cache_growth_keeps_the_compiled_graphs(
    draft: Transformer, compiled: CompiledPasses
) -> None:
    """Decoding past the first allocation (512 slots, then doubling) stays on the same
    graphs: the allocation is a symbolic size."""
    draft.compiled = compiled
    try:
        graphs, before = counters["stats"]["unique_graphs"], compiled.passes
        cache = draft.new_cache(1024)
        token = torch.tensor([1])
        for i in range(600):
            token = draft.forward(token, torch.tensor([i]), cache).argmax(-1)
        assert cache.allocated == 1024 and compiled.passes - before == 600
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        draft.compiled = None


def test_passes_outside_the_graphs_run_eager(draft: Transformer, compiled: CompiledPasses) -> None:
    draft.compiled = compiled
    try:
        before = compiled.passes
        cache = draft.new_cache(512)
        long = draft.forward(torch.arange(MAX_TOKENS + 1), torch.arange(MAX_TOKENS + 1), cache)
        assert compiled.passes == before  # a prefill chunk above MAX_TOKENS: eager
        assert long.shape[0] == MAX_TOKENS + 1 and cache.length == MAX_TOKENS + 1
        # An allocation so long that MAX_TOKENS queries over it pass the attention chunk
        # bound: eager (which splits the queries); a single token still fits one chunk.
        heads = draft.config.num_heads
        slots = 2 * ATTENTION_CHUNK_BYTES // attention_row_bytes(heads, 1) // MAX_TOKENS
        assert query_chunk(heads, slots) < MAX_TOKENS
        wide = KVCache(draft.config, slots, initial=slots)
        draft.forward(torch.arange(3), torch.arange(3), wide)
        assert compiled.passes == before + 1
        big = draft.forward(torch.arange(MAX_TOKENS), torch.arange(3, 3 + MAX_TOKENS), wide)
        assert compiled.passes == before + 1 and big.shape[0] == MAX_TOKENS
        draft.forward(torch.tensor([5]), torch.tensor([3 + MAX_TOKENS]), wide)
        assert compiled.passes == before + 2 and wide.length == MAX_TOKENS + 4
    finally:
        draft.compiled = None


def test_a_failing_graph_falls_back_to_eager_for_good(
    draft: Transformer, compiled: CompiledPasses, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes = CompiledPasses(draft)

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("the compiled kernel failed")

    monkeypatch.setattr(passes, "_step", broken)
    draft.compiled = passes
    try:
        cache = draft.new_cache(64)
        eager_cache = draft.new_cache(64)
        out = draft.forward(torch.arange(3), torch.arange(3), cache)
        assert passes.failure is not None and passes.passes == 0
        draft.compiled = None
        _close(out, draft.forward(torch.arange(3), torch.arange(3), eager_cache))
        assert cache.length == 3
    finally:
        draft.compiled = None


def test_generations_through_compiled_drafts_stay_lossless(
    stories_target: Path, draft: Transformer, compiled: CompiledPasses
) -> None:
    """Speculation over a compiled draft emits what it emits over the eager draft, and the
    draft proposes the same (the same tokens accepted per pass): greedy tree, and linear
    sampled at temperature 1 with a seed (its accept/reject draws read the draft's
    probabilities, so a different draft would change the text)."""
    target, tokenizer = load(str(stories_target))[:2]
    prompt = tokenizer.encode("Once upon a time")

    def run(strategy: Strategy, params: SamplingParams) -> tuple[list[int], int]:
        session = strategy.new_session(len(prompt) + 40)
        gen = Generation(strategy, session, tokenizer, prompt, params, max_tokens=40)
        gen.run()
        return gen.token_ids, gen.stats.decode_passes

    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=7)
    reference = run(Autoregressive(target), greedy)[0]
    eager_tree = run(TreeSpeculation(target, draft, budget=16), greedy)
    eager_linear = run(Linear(target, ModelDrafter(draft), 4), sampled)
    draft.compiled = compiled
    before = compiled.passes
    try:
        tree = run(TreeSpeculation(target, draft, budget=16), greedy)
        linear = run(Linear(target, ModelDrafter(draft), 4), sampled)
    finally:
        draft.compiled = None
    assert compiled.passes > before
    assert tree[0] == reference and tree == eager_tree
    assert linear == eager_linear


def test_streamed_or_packed_models_are_not_compiled(tmp_path: Path) -> None:
    path = str(make_checkpoint(tmp_path / "m", "llama"))
    # The packed layout (as a GPU holds it), loaded here: rebuilt per product.
    model = load(path, quantize="int8", computes_on="cuda")[0]
    reason = ineligible(model)
    assert reason is not None and "packed" in reason
    with pytest.raises(ValueError, match="packed"):
        CompiledPasses(model)
    if cpu_kernels.available():  # on this CPU: Q8_0 blocks the kernels multiply, like GGUF
        assert ineligible(load(path, quantize="int8")[0]) is None
    plain = load(str(make_checkpoint(tmp_path / "p", "llama")))[0]
    assert ineligible(plain) is None
    plain.set_layers(list(plain.layers))  # a layer list that is not the model's own
    reason = ineligible(plain)
    assert reason is not None and "streamed" in reason


def test_the_hqq_substitute_compiles_and_equals_its_eager_passes(stories_draft: Path) -> None:
    """The substitute draft's HQQ projections are rebuilt inside the graph (issue 36: its
    step at compiled speed on CUDA); the same tokens and logits as its eager passes (the
    2-layer stories draft as the target it is made from: a short compile)."""
    target = load(str(stories_draft))[0]
    layers = list(target.layers)
    substitute = build_substitute(target, 4, layers, lambda i: True, torch.device("cpu"))
    assert all(isinstance(m, HQQLinear) for m in substitute.layers[0].modules()
               if isinstance(m, PackedLinear))  # fmt: skip
    assert ineligible(substitute) is None
    with pytest.raises(ValueError, match="rebuilds packed"):  # its eager step, captured
        CompiledPasses(substitute, compile=False, graphs=True)
    eager_tokens, eager_logits = _steps(substitute)
    substitute.rebuild_scratch._flat.clear()  # what the eager passes grew, given back
    passes = CompiledPasses(substitute)
    passes.warm()
    substitute.compiled = passes
    tokens, logits = _steps(substitute)
    assert passes.passes == 32  # every pass compiled, none fell back to eager
    assert substitute.rebuild_scratch.nbytes == 0  # the graphs' own temporaries, not it
    assert tokens == eager_tokens
    for a, b in zip(logits, eager_logits, strict=True):
        _close(a, b)
    substitute.compiled = None


def test_a_compiled_model_refuses_changes(stories_draft: Path) -> None:
    """Compiled passes check no guard on the model, so a change after compiling would run
    stale graphs (a wider vocabulary: a kernel indexing past the embedding's rows). Every
    way to change a loaded model refuses while its passes are attached."""
    model = load(str(stories_draft))[0]
    model.compiled = CompiledPasses(model)
    changes = {
        "set_vocab_width": lambda: model.set_vocab_width(model.config.vocab_size + 8),
        "set_layers": lambda: model.set_layers(model.layers),
        "dequantize_layers": model.dequantize_layers,
        "moving or casting": lambda: model.to(torch.float64),
    }
    for what, change in changes.items():
        with pytest.raises(RuntimeError, match=f"{what}.* after the model's passes were compiled"):
            change()
    model.compiled = None
    model.set_vocab_width(model.config.vocab_size + 8)  # before compiling: allowed


def test_the_guards_kept_are_the_inputs_and_the_global_state(
    draft: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a compiled step checks before each call (`_input_guards`): every guard on its
    six inputs, their symbolic sizes' relations and the grad/global state stay; none on
    the model's modules does (those are what cost ~70 µs a step)."""
    import modeling.compiled as compiled_module

    decisions: list[tuple[Any, bool]] = []
    real = compiled_module._input_guards

    def recording(entries: list[Any]) -> list[bool]:
        keep = real(entries)
        decisions.extend(zip(entries, keep, strict=True))
        return keep

    monkeypatch.setattr(compiled_module, "_input_guards", recording)
    CompiledPasses(draft).warm()
    assert decisions
    inputs = ("tokens", "positions", "k", "v", "write", "mask")
    kept = {id(e) for e, keep in decisions if keep}  # by identity: entries hold tensors
    for name in inputs:  # each input's tensor guard, in both graphs
        matches = [e for e, _ in decisions if e.guard_type == "TENSOR_MATCH" and e.name == name]
        assert len(matches) == 2 and all(id(e) in kept for e in matches), name
    for kind in ("SHAPE_ENV", "GRAD_MODE", "GLOBAL_STATE"):
        assert any(e.guard_type == kind and id(e) in kept for e, _ in decisions), kind
    modules = [
        e
        for e, _ in decisions
        if e.orig_guard.source is not None and e.orig_guard.source.is_unspecialized_nn_module()
    ]
    assert len(modules) > 10 * draft.config.num_layers
    assert not any(id(e) in kept for e in modules)
