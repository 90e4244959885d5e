"""The tree walk draws only along its path, and the row-granular prefix cache works at real
vocabulary sizes: a 256-node tree at vocabulary 128k (a 134 MB block of fp32 logits, which
the old block cache silently dropped) still leaves rows that a second sample walks through."""

from __future__ import annotations

import pytest
import torch

from modeling.config import ModelConfig
from modeling.decoder import Transformer
from speculative.draft_tree import DraftTree
from speculative.passes import alone
from speculative.prefix_cache import PrefixCache
from speculative.sampling import PenaltyContext, PositionNoise, SamplingParams, draw, make_generator
from speculative.strategies.tree import TreeSpeculation
from speculative.verification import walk as tree_walk

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.9, presence_penalty=1.0, seed=3),
]


def _random_tree(vocab: int, nodes: int, seed: int) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    tree = DraftTree(int(torch.randint(vocab, (1,), generator=gen)), nodes)
    while tree.size < nodes:
        parent = int(torch.randint(tree.size, (1,), generator=gen))
        tree.add(torch.randint(vocab, (1,), generator=gen), torch.tensor([parent]), torch.zeros(1))
    return tree


def _old_all_node_walk(
    tree: DraftTree,
    logits: torch.Tensor,  # (N, V)
    params: SamplingParams,
    penalties: PenaltyContext | None,
    noise: PositionNoise,
    position: int,
) -> tuple[list[int], list[int]]:
    """The rule the walk replaced: draw every node at once, penalties counting each node's
    own path (an (N, V) matrix), then follow the draws."""
    n, vocab = tree.size, logits.shape[1]
    extra = None
    if penalties is not None and n > 1:
        onehot = torch.zeros(n, vocab)  # (N, V)
        onehot[torch.arange(1, n), tree.tokens[1:n]] = 1.0
        extra = tree.mask.float() @ onehot  # (N, V) tokens on each node's path, root excluded
    at = (position + tree.depths[:n]).tolist()
    draws = draw(logits, params, penalties, noise, extra, positions=at).tolist()  # (N,)
    children = tree.children()
    tokens, path, node = [], [], 0
    while True:
        tokens.append(draws[node])
        child = children.get((node, draws[node]))
        if child is None:
            break
        path.append(child)
        node = child
    if penalties is not None:
        penalties.append(tokens)
    return tokens, path


def walk(
    tree: DraftTree,
    logits: torch.Tensor,
    params: SamplingParams,
    penalties: PenaltyContext | None,
    noise: PositionNoise,
    position: int,
) -> tuple[list[int], list[int]]:
    """Today's walk (speculative/verification.py) over `tree`: (tokens, path)."""
    out = tree_walk(
        tree.token_list(), tree.parents[: tree.size].tolist(), logits, params, penalties, noise,
        position,
    )  # fmt: skip
    return out.tokens, out.path


@pytest.mark.parametrize("params", PARAMS)
def test_walk_draws_what_drawing_every_node_drew(params: SamplingParams) -> None:
    vocab, nodes = 40, 60
    deep = 0
    for seed in range(30):
        tree = _random_tree(vocab, nodes, seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        logits = torch.randn(nodes, vocab, generator=gen)  # (N, V)
        # Favour each node's children so that walks go deep.
        for (parent, tok), _ in tree.children().items():
            logits[parent, tok] += 4.0
        prompt = [1, 2, 3, 2]
        results = []
        for fn in (_old_all_node_walk, walk):  # the old rule, and today's walk
            penalties = PenaltyContext(vocab, prompt, "cpu") if params.has_penalties else None
            if penalties is not None:
                penalties.append([5, 5, 7])
            noise = PositionNoise(make_generator(seed), vocab)
            tokens, path = fn(tree, logits, params, penalties, noise, 17)
            counts = None if penalties is None else penalties.counts.clone()
            results.append((tokens, path, counts))
        (old_tokens, old_path, old_counts), (tokens, path, counts) = results
        assert tokens == old_tokens and path == old_path, seed
        if counts is not None:
            assert old_counts is not None and torch.equal(counts, old_counts)
        deep = max(deep, len(path))
    assert deep >= 2  # the comparison covered walks below the first level


def _big_vocab_model(vocab: int) -> Transformer:
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # peaked distributions, so trees get accepted
    return model


def _sample(strategy: TreeSpeculation, session, prompt, params, n):  # type: ignore[no-untyped-def]
    session.reuse_prefix(prompt)
    tokens: list[int] = []
    hits = misses = passes = 0
    gen = make_generator(params.seed)
    for rnd in alone(strategy.steps(session, prompt, params, n, gen)):
        tokens += rnd.tokens
        hits += rnd.stats.prefix_cache_hits
        misses += rnd.stats.prefix_cache_misses
        passes += rnd.stats.target_passes
    return tokens[:n], hits, misses, passes


@torch.no_grad()
def test_big_vocabulary_tree_rows_are_cached_and_reused_exactly() -> None:
    vocab, budget, n = 131_072, 256, 16
    model = _big_vocab_model(vocab)
    prompt = [1, 50, 700, 9000, 120_000, 33]
    cache = PrefixCache(max_bytes=64 << 20, dtype=model.dtype)  # the old default
    assert 0 < cache.capacity_rows(vocab, model.dtype) < budget + 1  # a tree does not fit
    cached = TreeSpeculation(model, model, budget=budget, max_depth=8, prefix_cache=cache)
    plain = TreeSpeculation(model, model, budget=budget, max_depth=8, prefix_cache=PrefixCache(0))
    session, plain_session = cached.new_session(256), plain.new_session(256)
    runs = []
    expected = {}
    for seed in (5, 5, 6):  # like --samples: the same session, the same strategy
        params = SamplingParams(temperature=0.7, seed=seed)
        if seed not in expected:
            expected[seed], no_hits, _, _ = _sample(plain, plain_session, prompt, params, n)
            assert no_hits == 0
        before = cache.stats.hits
        tokens, hits, misses, passes = _sample(cached, session, prompt, params, n)
        assert tokens == expected[seed], seed  # the cache never changes the sample
        assert hits == cache.stats.hits - before
        assert cache.bytes <= cache.max_bytes and cache.rows > 0
        runs.append((hits, misses, passes))
    (hits0, misses0, passes0), (hits1, _, passes1), (hits2, _, _) = runs
    assert hits0 == 0 and misses0 > 0 and passes0 > 0  # a fresh cache
    # The same seed again walks the first sample's stored paths: no target pass at all.
    assert hits1 == n and passes1 == 0
    assert hits2 > 0  # another seed still starts from the prompt's cached root row


def test_big_vocabulary_walk_allocates_no_node_by_vocabulary_temporaries() -> None:
    """At budget 1,024 and vocabulary 128k the logits are 537 MB; drawing along the walk
    must not add another (nodes × vocabulary) tensor (the old rule built several)."""
    from offload.machine import PeakMemory

    vocab, nodes = 131_072, 1025
    tree = _random_tree(vocab, nodes, seed=0)
    logits = torch.randn(nodes, vocab)  # (N, V) fp32
    params = SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.2, seed=1)
    penalties = PenaltyContext(vocab, [1, 2, 3], "cpu")
    noise = PositionNoise(make_generator(1), vocab)
    with PeakMemory("cpu") as peak:
        walk(tree, logits, params, penalties, noise, 10)
    if peak.bytes is None:
        pytest.skip("no /proc: peak memory cannot be measured here")
    # A handful of (V,) rows in fp32/fp64: a few MB, far below one (N, V) block.
    assert peak.bytes < logits.numel() * logits.element_size() // 8, peak.bytes


def test_a_cache_grown_inside_the_forward_can_be_compacted_outside() -> None:
    """The model grows its KV cache inside its inference-mode forward; a tree commit then
    compacts it outside (a budget-1,024 round grows past the first 512 slots at once)."""
    from modeling.kv_cache import KVCache

    model = _big_vocab_model(1000)
    cache = KVCache(model.config, capacity=64, initial=4)
    model(torch.arange(20), torch.arange(20), cache)
    assert cache.allocated >= 20 and not cache.k.is_inference()
    cache.keep([10, 15], start=8)
    assert cache.length == 10
