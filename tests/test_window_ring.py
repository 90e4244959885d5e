"""Window layers keep only what their window sees (modeling/kv_cache.py's ring): a ring
that has wrapped many times decodes exactly as a cache that holds every slot, under tree
and linear speculation, a substitute draft sharing the cache, and a Gemma 3 mix of local
and global layers; a rollback past what the ring holds is refused or prefilled anew; and
the cache's bytes are the plan's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling import kv_cache
from modeling.checkpoints.checkpoint import load
from modeling.config import ModelConfig
from modeling.kv_cache import KVCache, window_ring_size
from modeling.models import config_from_hf, kv_bytes
from speculative.generation import Generation
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive
from tests.greedy_checks import speculation_runtime

GREEDY = SamplingParams(temperature=0.0)
WINDOW, NEW, BUDGET = 6, 48, 16
ROOM = BUDGET + 1  # the room's relation to a tree: at least its largest pass


@pytest.fixture
def small_ring(monkeypatch: pytest.MonkeyPatch) -> int:
    """Rings of the window and 34 slots ahead (twice a 16-node tree's pass), so a tiny
    model's ring wraps every 40 tokens."""
    monkeypatch.setattr(kv_cache, "WINDOW_ROOM", ROOM)
    return WINDOW + 2 * ROOM


def greedy_ids(path: Path, prompt: list[int], context: int = 128) -> tuple[list[int], KVCache]:
    target, tok, _ = load(path)
    ar = Autoregressive(target)
    session = ar.new_session(context)
    gen = Generation(ar, session, tok, prompt, GREEDY, NEW, ignore_eos=True).run()
    return gen.token_ids, session.target_cache


@pytest.fixture(scope="module")
def windowed(tiny_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint("mistral", vocab_size=96, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def whole(windowed: Path, prompt: list[int]) -> list[int]:
    """The greedy ids with a ring that never wraps (the default room covers 128 slots)."""
    ids, cache = greedy_ids(windowed, prompt)
    assert not cache.wrapped and cache.ring_size == 128
    return ids


def test_a_wrapped_ring_decodes_as_the_whole_cache(
    windowed: Path, prompt: list[int], whole: list[int], small_ring: int
) -> None:
    ids, cache = greedy_ids(windowed, prompt)
    assert cache.ring_size == small_ring and cache.written >= small_ring  # wrapped
    assert cache.k.shape[0] == 0 and cache.ring_k is not None  # every layer slides
    assert ids == whole


@pytest.mark.parametrize(
    ("draft", "strategy", "extra"),
    [
        ("ngram", "tree", {}),
        ("substitute", "tree", {"offload": "stream", "resident_layers": 0, "substitute_bits": 4}),
        ("substitute", "linear", {"offload": "stream", "resident_layers": 0, "substitute_bits": 4}),
    ],
    ids=["ngram-tree", "substitute-tree", "substitute-linear"],
)
def test_speculation_over_a_wrapped_ring_is_the_targets_greedy(
    windowed: Path, prompt: list[int], whole: list[int], small_ring: int,
    draft: str, strategy: str, extra: dict,
) -> None:  # fmt: skip
    rt = Runtime(
        RuntimeOptions(
            model=str(windowed), draft=draft, strategy=strategy, budget=BUDGET, device="cpu",
            context=128, **extra,
        )
    )  # fmt: skip
    gen = rt.generation(prompt, GREEDY, NEW, ignore_eos=True).run()
    assert gen.token_ids == whole


def test_gemma3_local_layers_ring_while_global_ones_keep_all(
    tiny_checkpoint, small_ring: int
) -> None:  # type: ignore[no-untyped-def]
    path = tiny_checkpoint("gemma3", vocab_size=96)
    prompt = torch.randint(3, 96, (8,), generator=torch.Generator().manual_seed(4)).tolist()
    ids, cache = greedy_ids(path, prompt)
    assert cache.wrapped and cache.k.shape[0] == 1 and cache.ring_k.shape[0] == 1  # type: ignore[union-attr]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_cache, "WINDOW_ROOM", 4096)
        assert greedy_ids(path, prompt)[0] == ids
    for draft, extra in (("ngram", {}), ("substitute", {"offload": "stream",
                                                        "resident_layers": 0,
                                                        "substitute_bits": 4})):  # fmt: skip
        speculation_runtime(path, draft, "tree", extra, seed=4, new=NEW)


def test_a_rollback_past_the_ring_is_refused_or_prefilled_anew(
    windowed: Path, prompt: list[int], whole: list[int], small_ring: int
) -> None:
    target, tok, _ = load(windowed)
    ar = Autoregressive(target)
    session = ar.new_session(128)
    Generation(ar, session, tok, prompt, GREEDY, NEW, ignore_eos=True).run()
    cache = session.target_cache
    assert cache.wrapped and not cache.can_truncate(len(prompt))
    assert cache.can_truncate(cache.length - 1) and cache.can_truncate(0)
    with pytest.raises(ValueError, match="ring"):
        cache.truncate(len(prompt))
    # The conversation goes back to its prompt: the session keeps nothing, and decodes right.
    assert session.reuse_prefix(prompt) == 0 and session.target_cache.length == 0
    again = Generation(ar, session, tok, prompt, GREEDY, NEW, ignore_eos=True).run()
    assert again.token_ids == whole


def gemma3_27b() -> ModelConfig:
    return config_from_hf({
        "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
        "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
        "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "vocab_size": 262208,
    })  # fmt: skip


def test_the_cache_holds_what_the_plan_counts_at_real_shapes() -> None:
    """Gemma-3-27B's shapes at a 32k context, a 2,048-token pass: 10 global layers hold
    every slot, 52 local ones 5,120, under a third of a cache that holds every slot; the
    meta device allocates nothing."""
    cfg = gemma3_27b()
    context, bf16 = 32768, torch.bfloat16
    cache = KVCache(cfg, context, dtype=bf16, device="meta", initial=context, positions=True)
    for _ in range(context // 2048):  # prefilled a chunk at a time
        cache.reserve(2048)
        cache.commit_append(2048)
    ring = window_ring_size(1024, context, 2048)
    assert cache.ring_size == ring == 5120
    per_layer = 2 * 16 * 128 * 2
    assert cache.nbytes == 10 * per_layer * context + 52 * per_layer * ring + 8 * context
    assert kv_bytes(cfg, bf16, context, 2048) == cache.nbytes
    every_slot = 62 * per_layer * context
    assert cache.nbytes < every_slot / 3  # 4.5 GiB, not 15.5
