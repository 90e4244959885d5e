"""`Transformer.forward_batch`: one pass over several sequences equals each sequence's own
pass (logits within 1e-5 in fp32, the caches' new entries the same), for ragged caches
(different lengths, nothing padded), tree masks, prefill chunks with `logits_from`, Qwen's
biases and Qwen3's q/k norms, and streamed layers (host slots: each layer is fetched once
per batched pass, not once per sequence)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from modeling.checkpoints.checkpoint import load
from modeling.decoder import Transformer
from modeling.kv_cache import KVCache
from modeling.protocol import Segment
from offload.placement import build_streamer
from speculative.acceptance import AcceptanceTable
from speculative.children import RankedChildren
from speculative.draft_tree import DraftTree, grow_tree_steps
from speculative.passes import Allot, Forward, allot, execute
from tests.test_stream import TREE_PARENTS, tree_mask


def tree_segment(model: Transformer, cache: KVCache, seed: int) -> Segment:
    """The root and five nodes (tests/test_stream.py's tree) after what `cache` holds,
    with the ancestor mask over every slot."""
    mask, positions = tree_mask(cache.length)  # (T, slots), (T,)
    tokens = torch.randint(
        1,
        model.config.vocab_size,
        (len(TREE_PARENTS),),
        generator=torch.Generator().manual_seed(seed),
    )
    return Segment(tokens, positions, cache, mask)


def prefilled(model: Transformer, length: int, seed: int) -> KVCache:
    cache = model.new_cache(256)
    if length:
        gen = torch.Generator().manual_seed(seed)
        model(
            torch.randint(1, model.config.vocab_size, (length,), generator=gen),
            torch.arange(length),
            cache,
        )
    return cache


def clone(cache: KVCache) -> KVCache:
    return cache.clone()


def mixed_segments(model: Transformer) -> list[Segment]:
    """Four sequences with caches of 0, 3, 17 and 40 entries: a prefill chunk (logits for
    its last row only), a decode step, a causal chain (linear verification) and a tree."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    chunk = torch.randint(1, vocab, (9,), generator=gen)
    c0, c3, c17, c40 = (prefilled(model, n, seed=n) for n in (0, 3, 17, 40))
    return [
        Segment(chunk, torch.arange(9), c0, logits_from=8),
        Segment(torch.tensor([5]), torch.tensor([3]), c3),
        Segment(torch.randint(1, vocab, (5,), generator=gen), torch.arange(17, 22), c17),
        tree_segment(model, c40, seed=1),
    ]


def check_batch_equals_alone(model: Transformer) -> None:
    segments = mixed_segments(model)
    alone_caches = [clone(s.cache) for s in segments]
    alone = [
        model.forward_batch(
            [
                Segment(
                    s.tokens,
                    s.positions,
                    c,
                    None if s.mask is None else s.mask.clone(),
                    s.logits_from,
                )
            ]
        )[0]
        for s, c in zip(segments, alone_caches, strict=True)
    ]
    batched = model.forward_batch(segments)
    for s, a, b, c in zip(segments, alone, batched, alone_caches, strict=True):
        assert b.shape == a.shape == (s.logit_rows, model.vocab_width)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        assert s.cache.length == c.length
        n = c.length
        torch.testing.assert_close(s.cache.k[:, :, :n], c.k[:, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s.cache.v[:, :, :n], c.v[:, :, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "family, options",
    [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("llama", {"num_kv_heads": 4})],
)
def test_a_batched_pass_equals_each_sequence_alone(
    tiny_checkpoint: Callable[..., Path], family: str, options: dict
) -> None:
    model, _, _ = load(tiny_checkpoint(family, **options), "fp32", "cpu")
    check_batch_equals_alone(model)


def test_a_streamed_batched_pass_fetches_each_layer_once(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    path = tiny_checkpoint("llama", num_layers=4)
    resident, _, _ = load(path, "fp32", "cpu")
    model, _, _ = load(path, "fp32", "cpu")
    streamer = build_streamer(list(model.layers), [0], "cpu", 2, "ram", None)
    model.set_layers(streamer)
    segments = mixed_segments(model)
    reference = [clone(s.cache) for s in segments]
    expected = [
        resident.forward_batch([Segment(s.tokens, s.positions, c, s.mask, s.logits_from)])[0]
        for s, c in zip(segments, reference, strict=True)
    ]
    streamer.fetch_log.clear()
    got = model.forward_batch(segments)
    # The three streamed layers, once each (the ring reads ahead across passes: any order).
    assert sorted(streamer.fetch_log) == [1, 2, 3]
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_execute_runs_one_pass_per_model_and_hands_each_request_its_rows(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    target, _, _ = load(tiny_checkpoint("llama"), "fp32", "cpu")
    draft, _, _ = load(tiny_checkpoint("llama", num_layers=1, seed=3), "fp32", "cpu")
    calls: list[tuple[str, int]] = []
    for name, model in (("target", target), ("draft", draft)):
        real = model.forward_batch

        def counted(segments: list[Segment], name: str = name, real=real) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
            calls.append((name, len(segments)))
            return real(segments)

        model.forward_batch = counted  # type: ignore[method-assign]
    requests = [
        Forward(target, Segment(torch.tensor([3, 4]), torch.arange(2), target.new_cache(16))),
        Forward(draft, Segment(torch.tensor([5]), torch.arange(1), draft.new_cache(16))),
        Forward(
            target,
            Segment(torch.tensor([6, 7, 8]), torch.arange(3), target.new_cache(16), logits_from=2),
        ),
    ]
    execute(requests)
    assert calls == [("target", 2), ("draft", 1)]
    rows = [r.take() for r in requests]
    assert [r.logits.shape[0] for r in rows] == [2, 1, 1]
    assert [(r.tokens, r.sequences) for r in rows] == [(5, 2), (1, 1), (5, 2)]
    with pytest.raises(RuntimeError, match="without running it"):
        requests[0].take()  # handed over once


def test_segments_sharing_a_cache_are_refused(tiny_checkpoint: Callable[..., Path]) -> None:
    model, _, _ = load(tiny_checkpoint("llama"), "fp32", "cpu")
    cache = model.new_cache(16)
    one = Segment(torch.tensor([1]), torch.tensor([0]), cache)
    with pytest.raises(ValueError, match="share a KV cache"):
        model.forward_batch([one, Segment(torch.tensor([2]), torch.tensor([1]), cache)])
    assert cache.length == 0  # refused before anything was written


def test_allot_ranks_every_trees_candidates_together() -> None:
    def asks(*offers: list[float], wanted: int = 2) -> list[Allot]:
        return [Allot(torch.tensor(o), wanted) for o in offers]

    confident, unsure = [-0.1, -0.2, -0.3], [-1.0, -2.0, -3.0]
    requests = asks(confident, unsure)
    # As many nodes as both would take alone (2 + 2), to the best candidates: 3 + 1.
    assert allot(requests, budget=10) == 4
    assert [r.take() for r in requests] == [3, 1]
    requests = asks(unsure, confident)
    assert allot(requests, budget=1) == 1  # the forest's last node goes to the best one
    assert [r.take() for r in requests] == [0, 1]  # the other waits
    requests = asks(confident, unsure)
    assert allot(requests, budget=0) == 0
    assert [r.take() for r in requests] == [None, None]  # spent: stop growing
    with pytest.raises(RuntimeError, match="without answering"):
        Allot(torch.tensor([0.0]), 1).take()


def test_trees_growing_for_one_pass_get_nodes_where_the_draft_is_surest(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """Two trees grown in lockstep under one node budget: the tree whose draft is sure of
    its continuations (a peaked model) takes more of the forest than the unsure one, and
    together they never exceed the budget; alone, each would take its own budget."""
    peaked, _, _ = load(tiny_checkpoint("llama", init_std=1.0, seed=5), "fp32", "cpu")
    flat, _, _ = load(tiny_checkpoint("llama", init_std=0.01, seed=6), "fp32", "cpu")
    budget, forest = 24, 24
    trees, streams = [], []
    for model in (peaked, flat):
        cache = model.new_cache(64)
        root_logits = model(torch.tensor([1, 7, 3]), torch.arange(3), cache, last_only=True)[0]
        tree = DraftTree(3, budget + 1)
        trees.append(tree)
        policy = RankedChildren(AcceptanceTable("walk"))
        streams.append(grow_tree_steps(model, cache, tree, root_logits, 2, budget, 4, policy))
    waiting = [next(s) for s in streams]
    while any(w is not None for w in waiting):
        asking = [w for w in waiting if isinstance(w, Allot)]
        if asking:
            forest -= allot(asking, forest)
        execute([w for w in waiting if isinstance(w, Forward)])
        for i, stream in enumerate(streams):
            if waiting[i] is not None:
                try:
                    waiting[i] = next(stream)
                except StopIteration:
                    waiting[i] = None
    sure, unsure = (t.size - 1 for t in trees)
    assert sure + unsure <= 24 and forest >= 0
    assert sure > unsure > 0


@pytest.mark.parametrize("name", ["autoregressive", "linear", "tree"])
def test_no_strategy_holds_a_passs_logits_through_the_next_pass(
    stories_target: Path, stories_draft: Path, name: str
) -> None:
    """The plan counts one pass's logits: every earlier pass's are freed by the time the
    next target pass starts (a review found each strategy kept its last ones alive, which
    in a batched pass keeps the whole pass's (rows, vocabulary) tensor)."""
    import gc
    import weakref

    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from speculative.generation import Generation
    from speculative.sampling import SamplingParams

    rt = Runtime(
        RuntimeOptions(
            model=str(stories_target), draft=str(stories_draft), device="cpu", budget=8,
            prefix_cache=0,
        )
    )  # fmt: skip
    earlier: list[weakref.ref] = []
    alive_at_pass: list[int] = []
    real = rt.target.forward_batch

    def watched(segments: list[Segment]) -> list[torch.Tensor]:
        gc.collect()
        alive_at_pass.append(sum(ref() is not None for ref in earlier))
        out = real(segments)
        earlier.extend(weakref.ref(t) for t in out)
        return out

    rt.target.forward_batch = watched  # type: ignore[method-assign]
    strategy = rt.strategy(name)
    ids = rt.tokenizer.encode("Once upon a time, there was a little girl")
    Generation(
        strategy, rt.new_session(strategy), rt.tokenizer, ids, SamplingParams(), 64,
        ignore_eos=True,
    ).run()  # fmt: skip
    assert len(alive_at_pass) > 3 and set(alive_at_pass) == {0}, alive_at_pass


def test_the_plan_holds_every_generations_tree_mask() -> None:
    """Each concurrent generation's draft tree preallocates its (budget + 1)² ancestor
    mask: the plan counts the other generations' besides the pass's one."""
    from daemon.footprint import footprint
    from daemon.memory_plan import OffloadOptions, plan_request
    from offload.plan import MemoryBudget
    from offload.planning import make_plan
    from scripts.real_shapes import full_config

    target = footprint(full_config("llama-3.1-8b"), torch.bfloat16, "8b")
    draft = footprint(full_config("llama-3.2-1b"), torch.bfloat16, "1b")
    gpu = MemoryBudget("cuda", int(80e9), "test", int(64e9), "test", 25e9, "test")
    parts = {}
    for sequences in (1, 8):
        request = plan_request(target, draft, 4096, OffloadOptions(sequences=sequences), 64)
        parts[sequences] = make_plan(request, gpu).device_parts
    assert not any("ancestor masks" in k for k in parts[1])
    assert parts[8]["draft trees' ancestor masks (7 more)"] == 7 * 65**2
