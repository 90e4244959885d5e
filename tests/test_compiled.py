"""Compiled passes (speculative/compiled.py) give the eager passes' outputs.

One module-scoped compile of the real stories260k draft (two graphs, the warm-up's), shared
by every test: compiling is the expensive part (tens of seconds on a cold disk cache), the
steps afterwards are cheap. CUDA graphs need a GPU; their padding is checked here on the CPU
by compiling with `pad=True`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from scripts.tiny_models import make_checkpoint
from speculative.checkpoint import load
from speculative.compiled import MAX_TOKENS, CompiledPasses, ineligible
from speculative.generation import Generation
from speculative.model import Transformer
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive
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


def test_padded_steps_equal_eager(draft: Transformer) -> None:
    """CUDA graphs' padding (tokens to a power of two, extra rows writing free slots and
    seeing only themselves) changes nothing the caller sees."""
    draft.compiled = None
    eager_tokens, eager_logits = _steps(draft)
    draft.compiled = CompiledPasses(draft, pad=True)
    try:
        tokens, logits = _steps(draft)
        assert draft.compiled.passes == 32
    finally:
        draft.compiled = None
    assert tokens == eager_tokens
    for a, b in zip(logits, eager_logits, strict=True):
        _close(a, b)


def test_passes_outside_the_graphs_run_eager(draft: Transformer, compiled: CompiledPasses) -> None:
    draft.compiled = compiled
    before = compiled.passes
    cache = draft.new_cache(512)
    long = draft.forward(torch.arange(MAX_TOKENS + 1), torch.arange(MAX_TOKENS + 1), cache)
    assert compiled.passes == before  # a prefill chunk above MAX_TOKENS: eager
    assert long.shape[0] == MAX_TOKENS + 1 and cache.length == MAX_TOKENS + 1
    padded = CompiledPasses(draft, pad=True)
    draft.compiled = padded
    full = draft.new_cache(8)
    draft.forward(torch.arange(5), torch.arange(5), full)
    draft.forward(torch.tensor([3, 4, 5]), torch.arange(5, 8), full)  # padded to 4: no room
    assert padded.passes == 1 and full.length == 8
    draft.compiled = None


def test_generations_through_compiled_drafts_stay_lossless(
    stories_target: Path, draft: Transformer, compiled: CompiledPasses
) -> None:
    """A tree whose draft steps run compiled emits the target's greedy text, token for
    token: the compiled draft only changes how much of each tree is accepted."""
    target, tokenizer = load(str(stories_target))[:2]
    prompt = tokenizer.encode("Once upon a time")

    def run(strategy: Autoregressive | TreeSpeculation) -> list[int]:
        session = strategy.new_session(len(prompt) + 40)
        gen = Generation(
            strategy, session, tokenizer, prompt, SamplingParams(temperature=0.0), max_tokens=40
        )
        gen.run()
        return gen.token_ids

    reference = run(Autoregressive(target))
    draft.compiled = compiled
    before = compiled.passes
    try:
        assert run(TreeSpeculation(target, draft, budget=16)) == reference
    finally:
        draft.compiled = None
    assert compiled.passes > before


def test_streamed_or_packed_models_are_not_compiled(tmp_path: Path) -> None:
    model = load(str(make_checkpoint(tmp_path / "m", "llama")), quantize="int8")[0]
    reason = ineligible(model)
    assert reason is not None and "packed" in reason
    with pytest.raises(ValueError, match="packed"):
        CompiledPasses(model)
    plain = load(str(make_checkpoint(tmp_path / "p", "llama")))[0]
    assert ineligible(plain) is None
    plain.set_layers(list(plain.layers))  # a layer list that is not the model's own
    reason = ineligible(plain)
    assert reason is not None and "streamed" in reason
