"""The real regime on a CPU: vocabularies of 128,256 (Llama 3) and 262,208 (Gemma 3) and a
1,024-node tree.

Narrow random models (scripts/real_shapes.py: Llama-3.1-8B target, Llama-3.2-1B draft, one
layer, real vocabulary and head counts) check what only shows at real sizes: a tree round's
peak memory stays inside what the memory plan reserves for that pass, the prefix cache can
hold a 1,025-row verification at this vocabulary, and tree decoding stays exact.

The same three hold at Gemma 3's vocabulary (a Gemma-3-27B-shaped target of 262,208 ids,
a Gemma-3-1B-shaped draft of 262,144: one tokenizer, two widths), with two layers each, one
sliding-window layer and one global, on a prompt longer than both windows (so the sliding
layers drop keys), Gemma's head dimension apart from its width, its norms and score scale.

The bound is the plan's own figures (scripts/bench_scale.py's `pass_plan` and
`plan_figures`, the one place that reads plan parts), never a constant here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling.decoder import Transformer
from offload.machine import PeakMemory
from scripts.bench_scale import context_cache, pass_plan, plan_figures
from scripts.real_shapes import PRESETS, build_model, model_config, write_folder
from speculative.passes import alone
from speculative.prefill import feed
from speculative.rounds import Round
from speculative.sampling import SamplingParams, make_generator
from speculative.session import Session
from speculative.strategies.autoregressive import Autoregressive
from speculative.strategies.tree import TreeSpeculation

VOCAB = 128256
BUDGET = 1024
CONTEXT = 2048
ROUND_TOKENS = 64  # a request long enough not to cap the first tree's depth
PROMPT = [1, 9907, 11, 1268, 527, 499, 3432, 30, 358, 1097, 7060, 13, 5112, 1070, 574, 264]


@pytest.fixture(scope="module")
def pair() -> tuple[Transformer, Transformer]:
    target = build_model(model_config("llama-3.1-8b", layers=1, hidden_scale=1 / 32), seed=0)
    draft = build_model(model_config("llama-3.2-1b", layers=1, hidden_scale=1 / 32), seed=1)
    assert target.config.vocab_size == draft.config.vocab_size == VOCAB
    return target, draft


def _session(
    strategy: TreeSpeculation | Autoregressive,
    draft: Transformer | None,
    context: int = CONTEXT,
) -> Session:
    """A session whose caches are allocated and touched for the whole context up front, so
    a measured round's peak is the pass's own memory, not the caches growing."""
    session = strategy.new_session(context)
    for name, model in (("target_cache", strategy.target), ("draft_cache", draft)):
        if model is not None:
            setattr(session, name, context_cache(model, context))
    return session


def _generate(
    strategy: TreeSpeculation | Autoregressive,
    session: Session,
    params: SamplingParams,
    tokens: int,
    prompt: list[int] = PROMPT,
) -> list[int]:
    session.reuse_prefix(prompt)
    out: list[int] = []
    rounds = alone(strategy.steps(session, prompt, params, tokens, make_generator(params.seed)))
    for r in rounds:
        out += r.tokens
    return out[:tokens]


def _first_round(
    strategy: TreeSpeculation,
    session: Session,
    params: SamplingParams,
    prompt: list[int] = PROMPT,
) -> Round:
    """The first round of a request for `prompt` (its tree as deep as the default depth)."""
    session.reuse_prefix(prompt)
    rounds = alone(
        strategy.steps(session, prompt, params, ROUND_TOKENS, make_generator(params.seed))
    )
    first = next(rounds)
    rounds.close()
    return first


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PeakMemory reads VmHWM")
def test_tree_round_peak_is_within_the_plan(pair: tuple[Transformer, Transformer]) -> None:
    target, draft = pair
    strategy = TreeSpeculation(target, draft, budget=BUDGET)
    session = _session(strategy, draft)
    feed(target, session.target_cache, session.target_tokens, PROMPT[:-1])  # tree pass alone
    with PeakMemory("cpu") as peak:
        first = _first_round(strategy, session, SamplingParams(temperature=1.0, seed=0))
    assert first.stats.tree_nodes == BUDGET, "the draft grew a full 1,024-node tree"

    planned = plan_figures(
        pass_plan(
            target.config,
            draft.config,
            target.dtype,
            CONTEXT,
            BUDGET + 1,
            BUDGET + 1,
            strategy.prefix_cache.max_bytes,
        )
    )
    bound = planned["activations"] + planned["prefix_cache"]
    assert peak.bytes is not None
    assert peak.bytes <= bound, (
        f"a {BUDGET}-node tree round at vocabulary {VOCAB} peaked at {peak.bytes / 2**20:.0f} MiB; "
        f"the plan reserves {planned['activations'] / 2**20:.0f} MiB of activations and "
        f"{planned['prefix_cache'] / 2**20:.0f} MiB of prefix cache for that pass"
    )


def test_second_sample_of_a_prompt_hits_the_prefix_cache(
    pair: tuple[Transformer, Transformer],
) -> None:
    target, draft = pair
    strategy = TreeSpeculation(target, draft, budget=BUDGET)
    session = _session(strategy, draft)
    first = _first_round(strategy, session, SamplingParams(temperature=1.0, seed=0))
    assert first.stats.tree_nodes == BUDGET, "the first sample verified a full 1,024-node tree"
    hits = strategy.prefix_cache.stats.hits
    _first_round(strategy, session, SamplingParams(temperature=1.0, seed=1))
    # At least the prompt's own row (the root of the first tree) was verified before.
    assert strategy.prefix_cache.stats.hits > hits, (
        f"no prefix-cache hit on a regenerated prompt: the cache holds "
        f"{len(strategy.prefix_cache)} prefixes in {strategy.prefix_cache.bytes} bytes "
        f"(limit {strategy.prefix_cache.max_bytes}); one {BUDGET + 1}-row verification is "
        f"{(BUDGET + 1) * VOCAB * 4} bytes of fp32 logits"
    )


def test_greedy_tree_output_is_the_autoregressive_output(
    pair: tuple[Transformer, Transformer],
) -> None:
    target, draft = pair
    greedy = SamplingParams(temperature=0.0)
    plain = Autoregressive(target)
    expected = _generate(plain, _session(plain, None), greedy, 6)
    tree = TreeSpeculation(target, draft, budget=BUDGET)
    assert _generate(tree, _session(tree, draft), greedy, 6) == expected


# Gemma 3 at its vocabulary: the 27B's 262,208 ids verify what the 1B's 262,144 draft
GEMMA = ("gemma-3-27b", "gemma-3-1b")
GEMMA_LAYERS = 2  # one sliding-window layer and the global one (Shape.layer_types)


@pytest.fixture(scope="module")
def gemma_pair() -> tuple[Transformer, Transformer]:
    target = build_model(model_config(GEMMA[0], GEMMA_LAYERS, hidden_scale=1 / 32), seed=0)
    draft = build_model(model_config(GEMMA[1], GEMMA_LAYERS, hidden_scale=1 / 32), seed=1)
    draft.set_vocab_width(target.vocab_width)  # one tokenizer, two widths (as the daemon does)
    for model, preset in ((target, GEMMA[0]), (draft, GEMMA[1])):
        cfg = model.config
        assert cfg.vocab_size == PRESETS[preset].vocab_size
        assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}, cfg.layer_types
        assert cfg.head_dim * cfg.num_heads != cfg.hidden_size  # Gemma's heads, not hidden/heads
    return target, draft


def _gemma_prompt(pair: tuple[Transformer, Transformer]) -> list[int]:
    """Random ids both models embed, longer than either model's window: the tree's nodes
    then sit where the sliding layers no longer see the prompt's start."""
    target, draft = pair
    window = max(m.config.sliding_window or 0 for m in pair)
    ids = torch.randint(3, draft.config.vocab_size, (window + 64,), generator=_seeded(7))
    assert target.config.bos_token_id is not None
    return [target.config.bos_token_id, *ids.tolist()]


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gemma_context(prompt: list[int]) -> int:
    """Room for the prompt, a tree of BUDGET nodes past its root and a round's tokens."""
    return len(prompt) + BUDGET + 1 + ROUND_TOKENS


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PeakMemory reads VmHWM")
def test_a_262k_tree_round_is_within_the_plan_and_its_rows_are_kept(
    gemma_pair: tuple[Transformer, Transformer],
) -> None:
    """At Gemma 3's vocabulary a 1,024-node round's peak stays inside the plan's pass, and
    the prefix cache keeps every one of the verification's 1,025 rows (each a MiB in fp32)."""
    from speculative.prefix_cache import DEFAULT_MAX_BYTES, PrefixCache

    target, draft = gemma_pair
    prompt = _gemma_prompt(gemma_pair)
    context = _gemma_context(prompt)
    vocab = target.config.vocab_size
    # The shipped default (1 GiB, sized in bf16 rows: a GPU's dtype) holds one verification
    # at this vocabulary; this CPU run is fp32, so its cache is the default's rows in fp32.
    assert PrefixCache(dtype=torch.bfloat16).capacity_rows(vocab, torch.bfloat16) > BUDGET
    item = target.dtype.itemsize
    pcache = PrefixCache(DEFAULT_MAX_BYTES * item // torch.bfloat16.itemsize, dtype=target.dtype)
    strategy = TreeSpeculation(target, draft, budget=BUDGET, prefix_cache=pcache)
    session = _session(strategy, draft, context)
    feed(target, session.target_cache, session.target_tokens, prompt[:-1])  # the round alone
    feed(draft, session.draft_cache, session.draft_tokens, prompt[:-1])
    with PeakMemory("cpu") as peak:
        first = _first_round(strategy, session, SamplingParams(temperature=1.0, seed=0), prompt)
    assert first.stats.tree_nodes == BUDGET, "the draft grew a full 1,024-node tree"

    planned = plan_figures(
        pass_plan(
            target.config, draft.config, target.dtype, context, BUDGET + 1, BUDGET + 1,
            pcache.max_bytes,
        )
    )  # fmt: skip
    bound = planned["activations"] + planned["prefix_cache"]
    assert peak.bytes is not None
    assert peak.bytes <= bound, (
        f"a {BUDGET}-node tree round at vocabulary {vocab} peaked at {peak.bytes / 2**20:.0f} "
        f"MiB; the plan reserves {planned['activations'] / 2**20:.0f} MiB of activations and "
        f"{planned['prefix_cache'] / 2**20:.0f} MiB of prefix cache for that pass"
    )
    assert pcache.rows == BUDGET + 1, (
        f"the prefix cache kept {pcache.rows} of the verification's {BUDGET + 1} rows "
        f"(room for {pcache.capacity_rows(vocab, target.dtype)} in {pcache.max_bytes} bytes)"
    )
    assert pcache.held_bytes <= pcache.max_bytes
    assert pcache.get(pcache.key(prompt)) is not None, "the prompt's own row is served"


def test_greedy_tree_output_is_the_autoregressive_output_at_262k(
    gemma_pair: tuple[Transformer, Transformer],
) -> None:
    """A greedy round over a 1,024-node tree emits the target's own greedy tokens."""
    target, draft = gemma_pair
    prompt = _gemma_prompt(gemma_pair)
    context = _gemma_context(prompt)
    greedy = SamplingParams(temperature=0.0)
    tree = TreeSpeculation(target, draft, budget=BUDGET)
    session = _session(tree, draft, context)
    feed(target, session.target_cache, session.target_tokens, prompt[:-1])  # first: a tree
    feed(draft, session.draft_cache, session.draft_tokens, prompt[:-1])
    first = _first_round(tree, session, greedy, prompt)
    assert first.stats.tree_nodes == BUDGET
    plain = Autoregressive(target)
    expected = _generate(plain, _session(plain, None, context), greedy, len(first.tokens), prompt)
    assert list(first.tokens) == expected


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "llama-3.1-8b", "qwen3-0.6b", "gemma-3-27b"])
def test_preset_folder_loads_with_a_tokenizer_of_its_vocabulary(
    preset: str, tmp_path: Path
) -> None:
    from modeling.checkpoints.checkpoint import load

    # Two layers: Gemma's written layer_types then name a sliding layer and a global one.
    config = model_config(preset, layers=2, hidden_scale=1 / 32)
    model = build_model(config, seed=3)
    loaded, tokenizer, checkpoint = load(write_folder(config, tmp_path, model))
    assert checkpoint.config == config
    assert tokenizer.vocab_size == config.vocab_size
    tokens = torch.tensor(tokenizer.encode("Once upon a time"))
    positions = torch.arange(len(tokens))
    expected = model(tokens, positions, model.new_cache(8))
    assert torch.equal(loaded(tokens, positions, loaded.new_cache(8)), expected)


# The Llama pair (`pair`) at a short context, measured by scripts/bench_scale.py itself (its
# phases, its reading of the plan) in a child process with glibc's mmap threshold fixed
# (`fix_heap`), so that the peak resident set follows the tensors. At vocabulary 128,256 a
# 64-node tree's rows (32 MiB) dwarf the probe's noise (Python objects, page rounding).
BENCH_CONTEXT = 1024
BENCH_PREFILL = 256


def bench_rows() -> list[dict]:
    """In the child: bench_scale's warm rows for the pair at budgets 64 and 256."""
    from scripts.bench_scale import fix_heap, run_scenario

    fix_heap()
    torch.set_num_threads(1)
    target = build_model(model_config("llama-3.1-8b", layers=1, hidden_scale=1 / 32), seed=0)
    draft = build_model(model_config("llama-3.2-1b", layers=1, hidden_scale=1 / 32), seed=1)
    rows = []
    for budget in (64, 256):
        names = ("llama-3.1-8b", "llama-3.2-1b")
        found = run_scenario(names, (target, draft), BENCH_CONTEXT, budget, BENCH_PREFILL, 0)
        rows += [r.to_dict() for r in found]
    return rows


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="the CPU peak probe needs Linux /proc"
)
def test_every_phase_of_a_tree_round_is_within_the_plan() -> None:
    """The plan is an upper bound on what each phase adds and within 25% of it: the KV
    caches, a prefill chunk, a tree round (draft growth, verification, walk, prefix-cache
    store into a full cache) and a regenerated round, at tree budgets 64 and 256."""
    root = Path(__file__).resolve().parents[1]
    child = subprocess.run(
        [sys.executable, __file__],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    rows = json.loads(child.stdout)
    assert {(r["budget"], r["phase"]) for r in rows} == {
        (b, p) for b in (64, 256) for p in ("kv", "prefill", "tree", "regenerate")
    }
    for r in rows:
        assert r["measured"], r
        assert r["notes"].get("tree_nodes", r["budget"]) == r["budget"], r
        assert r["measured"] <= r["planned"] <= 1.25 * r["measured"], r


if __name__ == "__main__":
    print(json.dumps(bench_rows()))
