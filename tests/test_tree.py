"""Tree speculation: the tree mask, KV compaction, greedy parity with the target, and the
edge cases (EOS inside the tree, max_tokens mid-round, end of context, penalties)."""

from __future__ import annotations

import weakref

import pytest
import torch

import speculative.strategies.tree as tree_strategy
import speculative.strategies.tree_verification as tree_verification
from modeling.checkpoints.checkpoint import load
from modeling.decoder import Transformer
from speculative.acceptance import AcceptanceTable
from speculative.children import RankedChildren
from speculative.draft_tree import (
    DraftTree,
    grow_tree,
    tree_from_continuations,
    verification_mask,
)
from speculative.generation import Generation
from speculative.passes import alone
from speculative.prefix_cache import PrefixCache
from speculative.sampling import SamplingParams, probabilities
from speculative.session import Session
from speculative.strategies.autoregressive import Autoregressive
from speculative.strategies.tree import TreeSpeculation

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom"]


@pytest.fixture(scope="module")
def tiny_pair(tiny_checkpoint) -> tuple[Transformer, Transformer]:
    target, _, _ = load(tiny_checkpoint("llama", vocab_size=64, num_layers=2, init_std=0.3))
    draft, _, _ = load(
        tiny_checkpoint("llama", vocab_size=64, num_layers=1, hidden_size=32, seed=1, init_std=0.3)
    )
    return target, draft


@pytest.fixture(scope="module")
def stories(stories_target, stories_draft):
    target, tok, _ = load(stories_target)
    draft, _, _ = load(stories_draft)
    return target, draft, tok


def _grown_tree(
    target: Transformer, draft: Transformer, prefix: list[int], budget: int, depth: int
):
    """Feed prefix[:-1] to a draft cache and grow a tree rooted at prefix[-1]."""
    dcache = draft.new_cache(128)
    n = len(prefix)
    draft(torch.tensor(prefix[:-1]), torch.arange(n - 1), dcache)
    root_logits = draft(torch.tensor(prefix[-1:]), torch.tensor([n - 1]), dcache)[0]
    tree = DraftTree(prefix[-1], budget + 1)
    grow_tree(draft, dcache, tree, root_logits, n - 1, budget, depth, _ranked())
    return tree, dcache


def _ranked() -> RankedChildren:
    """The walk's children for greedy requests, valued by the walk's prior."""
    return RankedChildren(AcceptanceTable("walk"))


def _path(tree: DraftTree, node: int) -> list[int]:
    tokens, parents = tree.token_list(), tree.parents.tolist()
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


def test_tree_mask_logits_equal_plain_sequences(tiny_pair):
    target, draft = tiny_pair
    prefix = [1, 5, 9, 12, 3]
    tree, _ = _grown_tree(target, draft, prefix, budget=24, depth=5)
    assert tree.size == 25 and int(tree.depths[: tree.size].max()) <= 5
    cache = target.new_cache(128)
    target(torch.tensor(prefix[:-2]), torch.arange(len(prefix) - 2), cache)
    pending = prefix[-2:-1]  # one committed token folded into the verification pass
    n = len(prefix) - 1
    tokens = torch.cat((torch.tensor(pending), tree.tokens[: tree.size]))
    positions = torch.cat((torch.tensor([n - 1]), n + tree.depths[: tree.size]))
    logits = target(
        tokens, positions, cache, mask=verification_mask(tree.mask, 1), logits_from=1
    )  # (N, V)
    for node in range(tree.size):
        seq = prefix[:-1] + _path(tree, node)
        plain = target(torch.tensor(seq), torch.arange(len(seq)), target.new_cache(128))[-1]
        assert torch.allclose(logits[node], plain, atol=1e-4), node


def test_draft_tree_rows_are_parent_plus_self():
    tree = DraftTree(7, 5)
    tree.add(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([-0.1, -0.2]))
    tree.add(torch.tensor([3, 4]), torch.tensor([1, 1]), torch.tensor([-0.3, -0.4]))
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 0, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(tree.mask, expected)
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert tree.children() == {(0, 1): 1, (0, 2): 2, (1, 3): 3, (1, 4): 4}


def test_grow_tree_holds_one_draft_pass_of_logits_at_a_time(tiny_pair):
    """A draft pass's (t, V) fp32 logits are freed before the next pass runs. The plan
    reserves one pass's activations; at a long context a draft pass's attention fills the
    whole query chunk (ATTENTION_CHUNK_BYTES), so the previous pass's logits held through
    it were memory the plan does not have (9 MiB above it at vocabulary 128,256, context
    32,768, budget 256: scripts/bench_scale.py)."""
    target, draft = tiny_pair
    returned: list[weakref.ref] = []
    alive_at_call: list[int] = []
    forward_batch = draft.forward_batch

    def counting_forward(segments):
        # Only grow_tree's own passes: the prefix and the root were fed first.
        alive_at_call.append(sum(ref() is not None for ref in returned[2:]))
        (logits,) = forward_batch(segments)
        returned.append(weakref.ref(logits))
        return [logits]

    draft.forward_batch = counting_forward  # type: ignore[method-assign]
    try:
        tree, _ = _grown_tree(target, draft, [1, 5, 9, 13], budget=24, depth=4)
    finally:
        del draft.forward_batch
    passes = len(alive_at_call) - 2
    assert passes >= 2 and tree.size == 25
    assert alive_at_call[2:] == [0] * passes


def test_trie_from_continuations_shares_prefixes_and_respects_budget():
    tree = tree_from_continuations(9, [[1, 2, 3], [1, 2, 4], [5]], budget=4, max_depth=8)
    assert tree.size == 5
    assert {tuple(_path(tree, i)) for i in range(tree.size)} == {
        (9,),
        (9, 1),
        (9, 1, 2),
        (9, 1, 2, 3),
        (9, 1, 2, 4),
    }
    assert tree_from_continuations(9, [[1, 2, 3]], budget=8, max_depth=2).size == 3


def _assert_caches_consistent(strategy: TreeSpeculation, session: Session) -> None:
    """The caches hold exactly the session's tokens: the next pass equals a fresh prefill."""
    pairs = [(strategy.target, session.target_cache, session.target_tokens)]
    if strategy.draft is not None and session.draft_tokens:
        pairs.append((strategy.draft, session.draft_cache, session.draft_tokens))
    for model, cache, tokens in pairs:
        assert cache.length == len(tokens)
        probe = torch.tensor([3])
        n = len(tokens)
        got = model(probe, torch.tensor([n]), cache)[0]
        cache.truncate(n)
        fresh_cache = model.new_cache(n + 1)
        fresh = model(torch.tensor([*tokens, 3]), torch.arange(n + 1), fresh_cache)[-1]
        assert torch.allclose(got, fresh, atol=1e-4)


def test_kv_compaction_matches_fresh_prefill(tiny_pair):
    target, draft = tiny_pair
    strategy = TreeSpeculation(target, draft, budget=16, max_depth=4)
    session = strategy.new_session(256)
    gen = torch.Generator().manual_seed(0)
    rounds = alone(strategy.steps(session, [1, 4, 8, 2], SamplingParams(temperature=1.0), 40, gen))
    for _ in range(5):
        next(rounds)
        _assert_caches_consistent(strategy, session)
    rounds.close()


def _generate(strategy, tok, ids, max_tokens=200, capacity=512, params=GREEDY, **kw):
    session = strategy.new_session(capacity)
    return Generation(strategy, session, tok, ids, params, max_tokens, **kw).run(), session


@pytest.fixture(scope="module")
def greedy_reference(stories) -> dict[str, list[int]]:
    """The target's own greedy 200 tokens per prompt (autoregressive), computed once."""
    target, _, tok = stories
    ar = Autoregressive(target)
    return {p: _generate(ar, tok, tok.encode(p), ignore_eos=True)[0].token_ids for p in PROMPTS}


@pytest.mark.parametrize(
    ("budget", "prompts"), [(4, PROMPTS[:1]), (32, PROMPTS), (64, PROMPTS[1:]), ("auto", PROMPTS)]
)
def test_greedy_parity_real_pair(stories, greedy_reference, budget, prompts):
    target, draft, tok = stories
    tree = TreeSpeculation(target, draft, budget=budget, prefix_cache=PrefixCache(0))
    for prompt in prompts:
        ids = tok.encode(prompt)
        got, session = _generate(tree, tok, ids, ignore_eos=True)
        assert got.token_ids == greedy_reference[prompt], (budget, prompt)
        assert session.target_tokens == (ids + got.token_ids)[: len(session.target_tokens)]
        if budget != "auto":
            assert got.stats.decode_passes < 200 / 2.5  # the tree really saves target passes


def test_greedy_parity_ngram_drafting(stories, greedy_reference):
    target, _, tok = stories
    for budget in (16, "auto"):
        tree = TreeSpeculation(target, None, budget=budget, prefix_cache=PrefixCache(0))
        accepted = 0
        for prompt in PROMPTS[:2]:
            got, _ = _generate(tree, tok, tok.encode(prompt), ignore_eos=True)
            assert got.token_ids == greedy_reference[prompt]
            accepted += got.stats.accepted
        if budget == 16:
            assert accepted > 0  # stories repeat phrases: lookup finds some


def test_greedy_parity_random_tiny_pair(tiny_pair):
    target, draft = tiny_pair

    class Ids:  # Generation needs only eos ids and decode for ids-only use
        eos_token_ids = (2,)

        def decode(self, ids, **_):
            return " ".join(map(str, ids))

    ar = Autoregressive(target)
    for budget, prompts in ((3, ([1, 5, 7], [1])), ("auto", ([1, 9, 9, 9, 4],))):
        tree = TreeSpeculation(target, draft, budget=budget, prefix_cache=PrefixCache(0))
        for ids in prompts:
            ref, _ = _generate(ar, Ids(), ids, ignore_eos=True)
            got, _ = _generate(tree, Ids(), ids, ignore_eos=True)
            assert got.token_ids == ref.token_ids


def test_draft_identical_to_target_accepts_every_greedy_token(stories):
    """With draft == target, the draft's best child of every node is the target's greedy
    token: a one-node tree is accepted every round, and a bigger tree (whose first pick
    is always the root's best child) accepts at least that much."""
    target, _, tok = stories
    ids = tok.encode("Once upon a time")
    for budget, depth in ((1, 1), (8, 4)):
        strategy = TreeSpeculation(
            target, target, budget=budget, max_depth=depth, prefix_cache=PrefixCache(0)
        )
        gen = torch.Generator().manual_seed(0)
        emitted = 0
        for rnd in alone(strategy.steps(strategy.new_session(512), ids, GREEDY, 50, gen)):
            if 50 - emitted > 1:  # the last token of the request drafts nothing
                assert rnd.stats.accepted >= 1
                if budget == 1:
                    assert rnd.stats.accepted == 1
            assert len(rnd.tokens) == rnd.stats.accepted + 1
            emitted += len(rnd.tokens)
        assert emitted == 50


def test_eos_inside_tree_and_max_tokens_mid_round(stories):
    target, draft, tok = stories
    ar = Autoregressive(target)
    tree = TreeSpeculation(target, draft, budget=32, max_depth=8, prefix_cache=PrefixCache(0))
    ids = tok.encode("Once upon a time")
    ref, _ = _generate(ar, tok, ids, max_tokens=60, ignore_eos=True)
    stop_token = ref.token_ids[17]  # a token that the greedy text reaches mid-round
    want, _ = _generate(ar, tok, ids, max_tokens=60, stop_token_ids=[stop_token])
    got, session = _generate(tree, tok, ids, max_tokens=60, stop_token_ids=[stop_token])
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    assert session.target_cache.length == len(session.target_tokens)
    for n in (1, 2, 7, 13):
        got, session = _generate(tree, tok, ids, max_tokens=n, ignore_eos=True)
        assert got.token_ids == ref.token_ids[:n] and got.finish_reason == "length"
        assert session.target_cache.length == len(session.target_tokens)


def test_prompt_at_end_of_context_shrinks_tree(stories):
    target, draft, tok = stories
    ar = Autoregressive(target)
    tree = TreeSpeculation(target, draft, budget=64, prefix_cache=PrefixCache(0))
    ids = tok.encode("Once upon a time there was a little girl")
    for room in (1, 2, 5):
        capacity = len(ids) + room
        ref, _ = _generate(ar, tok, ids, max_tokens=50, capacity=capacity, ignore_eos=True)
        got, session = _generate(tree, tok, ids, max_tokens=50, capacity=capacity, ignore_eos=True)
        assert got.token_ids == ref.token_ids and len(got.token_ids) == room
        assert session.target_cache.length <= capacity


def test_penalties_with_speculation(stories):
    target, draft, tok = stories
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3
    )
    ar = Autoregressive(target)
    tree = TreeSpeculation(target, draft, budget=32, prefix_cache=PrefixCache(0))
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        ref, _ = _generate(ar, tok, ids, max_tokens=120, params=params, ignore_eos=True)
        got, _ = _generate(tree, tok, ids, max_tokens=120, params=params, ignore_eos=True)
        assert got.token_ids == ref.token_ids


def test_prefix_cache_serves_a_repeated_prompt_without_target_passes(stories):
    target, draft, tok = stories
    tree = TreeSpeculation(target, draft, budget=16)
    ids = tok.encode("The little dog")
    first, _ = _generate(tree, tok, ids, max_tokens=40, ignore_eos=True)
    again, _ = _generate(tree, tok, ids, max_tokens=40, ignore_eos=True)
    assert again.token_ids == first.token_ids
    assert again.stats.target_passes == 0


def expected_tokens(tree: DraftTree, probs: torch.Tensor) -> float:
    """1 + sum over nodes of the probability that the walk reaches them; `probs` (N, V) is
    the target's final sampling distribution at every node of `tree`."""
    n = tree.size
    parents, tokens = tree.parents[1:n], tree.tokens[1:n]  # (N-1,)
    edge = probs[parents, tokens].double()  # (N-1,) p_target(node token | parent prefix)
    reach = torch.ones(n, dtype=torch.float64)
    for i in range(1, n):  # parents precede children
        reach[i] = reach[int(parents[i - 1])] * edge[i - 1]
    return float(reach.sum())


def record_rounds(
    monkeypatch, target, draft, prompts, params, budget, n, seed
) -> list[tuple[int, float]]:
    """(tokens the walk emitted, their analytic expectation over the round's tree) for each
    round with a tree, from the real strategy with the walk's children chosen without the
    walk's noise (the draft's most likely tokens at the request's temperature), keeping
    each round's tree and verified target logits: the tree is then independent of the
    walk's draws, and the walk must reach node v with probability prod p_target along v's
    path."""
    temperature = params.temperature or 1.0
    captured: list[tuple[DraftTree, torch.Tensor]] = []

    def ranked(state, table, rows, drafted_with):
        return RankedChildren(table, temperature=temperature)

    def recording(session, state, tree, logits, *rest):
        captured.append((tree, logits.clone()))
        return tree_verification.accept(session, state, tree, logits, *rest)

    monkeypatch.setattr(tree_strategy, "child_policy", ranked)
    monkeypatch.setattr(tree_strategy, "accept", recording)
    strategy = TreeSpeculation(
        target, draft, budget=budget, prefix_cache=PrefixCache(0), verification="walk"
    )
    logs = []
    for i, ids in enumerate(prompts):
        session = strategy.new_session(len(ids) + n + budget + 8)
        gen = torch.Generator().manual_seed(seed + i)
        for rnd in alone(strategy.steps(session, ids, params, n, gen)):
            if rnd.tokens and captured:
                tree, logits = captured.pop()
                logs.append((len(rnd.tokens), expected_tokens(tree, probabilities(logits, params))))
    return logs


def test_expected_tokens_is_one_plus_the_reach_probabilities():
    tree = DraftTree(0, 4)
    tree.add(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.zeros(2))  # root → 1, root → 2
    tree.add(torch.tensor([3]), torch.tensor([1]), torch.zeros(1))  # 1 → 3
    probs = torch.zeros(4, 5)  # (N, V) target distribution at each node
    probs[0, 1], probs[0, 2], probs[0, 4] = 0.5, 0.25, 0.25
    probs[1, 3], probs[1, 4] = 0.4, 0.6
    probs[2:, 4] = 1.0
    assert expected_tokens(tree, probs) == pytest.approx(1 + 0.5 + 0.25 + 0.5 * 0.4)


def test_walk_emits_the_analytic_expectation(stories, monkeypatch):
    """Each round's walk must reach node v with probability prod p_target along v's path: a
    greedy round emits exactly that sum (one-hot distributions), and at temperature 1 the
    mean over many rounds matches it within sampling noise."""
    target, draft, tok = stories
    prompts = [tok.encode(p) for p in PROMPTS]
    for tokens, analytic in record_rounds(
        monkeypatch, target, draft, prompts[:2], GREEDY, 16, 48, seed=0
    ):
        assert tokens == round(analytic)
    logs = []
    for seed in range(3):
        logs += record_rounds(
            monkeypatch, target, draft, prompts, SamplingParams(temperature=1.0), 16, 48,
            seed=100 * seed,
        )  # fmt: skip
    emitted = torch.tensor([float(t) for t, _ in logs])
    analytic = torch.tensor([a for _, a in logs])
    se = emitted.std() / len(logs) ** 0.5
    assert abs(emitted.mean() - analytic.mean()) < 4 * se, (emitted.mean(), analytic.mean(), se)
