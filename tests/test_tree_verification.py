"""Trees that never lose to a chain: rejection verification of sampled children (exact at
one node, a negative control that skips the residual), calibrated growth (an aligned
draft grows a chain, a weak one a wide tree), the acceptance tables, and `auto`'s choice
of verification. End-to-end losslessness of both verifications is tests/test_lossless.py."""

from __future__ import annotations

import math

import pytest
import torch

import speculative.verification as verification
from modeling.checkpoints.checkpoint import load
from speculative.acceptance import AcceptanceModel, AcceptanceTable, regime
from speculative.children import DraftRows, SampledChildren, _ordered_draw
from speculative.draft_tree import DraftTree
from speculative.generation import Generation
from speculative.passes import alone
from speculative.prefix_cache import PrefixCache
from speculative.sampling import SamplingParams
from speculative.strategies.tree import TreeSpeculation
from speculative.strategies.tree_verification import (
    EXPLORE_GENERATIONS,
    EXPLORE_ROUNDS,
    REJECTION_FIRST,
    REJECTION_STAYS,
    choose_verification,
)
from speculative.verification import rejection_walk

T1 = SamplingParams(temperature=1.0)
# One node: a target that favours token 0 and a draft that favours 1 and 2, so children
# are rejected often and what follows a rejection carries most of the mass.
P = torch.tensor([0.55, 0.05, 0.1, 0.2, 0.1])
Q = torch.tensor([0.05, 0.5, 0.25, 0.1, 0.1])
TRIALS = 1500  # the bound is 0.078; without the residual the TV is 0.26


def _first_tokens(children: int, trials: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    """Over `trials` one-level trees (root children sampled from Q without replacement,
    as the tree strategy samples them), the distribution of the token rejection
    verification emits at the root, and how often it moved to a child."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(P), dtype=torch.float64)
    moved = 0
    for _ in range(trials):
        tree = DraftTree(7, children + 1)
        rows = DraftRows()
        policy = SampledChildren(AcceptanceTable("rejection"), T1, None, gen, rows)
        candidates = policy.children(tree, torch.tensor([0]), Q.log()[None, :], children)
        tree.add_candidates(candidates.pick(torch.topk(candidates.values, children).indices))
        logits = torch.cat((P.log()[None], torch.zeros(children, len(P))))  # (N, V)
        out = rejection_walk(
            tree.token_list(), tree.parents[: tree.size].tolist(),
            tree.ranks[: tree.size].tolist(), logits, rows, T1, None, None, gen,
        )  # fmt: skip
        counts[out.tokens[0]] += 1
        moved += bool(out.path)
    return counts / trials, moved / trials


def _bound(exact: torch.Tensor, trials: int, delta: float = 1e-4) -> float:
    """tests/test_lossless.py's bound on the TV of an empirical distribution."""
    expected = 0.5 * float(torch.sqrt(exact * (1 - exact) / trials).sum())
    return expected + math.sqrt(math.log(1 / delta) / (2 * trials))


@pytest.mark.parametrize("children", [1, 2, 3])
def test_rejection_at_a_node_emits_the_target_distribution(children: int) -> None:
    emitted, moved = _first_tokens(children, TRIALS)
    tv = 0.5 * float((emitted - P.double()).abs().sum())
    assert tv < _bound(P.double(), TRIALS), (children, emitted)
    if children == 1:  # one child: Leviathan/Chen, which accepts with 1 - TV(p, q)
        accept = float(torch.minimum(P, Q).sum())
        assert abs(moved - accept) < 4 * math.sqrt(accept * (1 - accept) / TRIALS)


def test_a_sampled_childs_worth_does_not_depend_on_its_token() -> None:
    """Which sampled children join the tree must not depend on which tokens were drawn
    (rejection sampling is exact only for children offered whatever they are): with a
    table whose acceptance differs sharply by draft probability, every sampled child is
    still valued by its rank alone, and children beyond q's support are offered too."""
    table = AcceptanceTable("rejection")
    for _ in range(200):  # likely children accepted, unlikely ones never
        table.observe(torch.tensor([1, 1]), torch.tensor([0.9, 0.02]), torch.tensor([True, False]))
    assert (
        float(table.log_acceptance(torch.tensor([1]), torch.tensor([0.9])))
        > float(table.log_acceptance(torch.tensor([1]), torch.tensor([0.02]))) + 1.0
    )
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.6, 0.3, 0.1, 0.0, 0.0])
    values = set()
    for _ in range(20):
        tree = DraftTree(7, 8)
        policy = SampledChildren(table, T1, None, gen, DraftRows())
        found = policy.children(tree, torch.tensor([0]), q.log()[None, :], 5)
        assert found.ranks.tolist() == [1, 2, 3, 4, 5]  # two beyond the support of three
        values.add(tuple(round(v, 6) for v in found.values.tolist()))
    assert len(values) == 1  # the same whatever was drawn


def test_more_sampled_children_only_add_acceptance() -> None:
    rates = [_first_tokens(k, 1000, seed=k)[1] for k in (1, 2, 3)]  # 0.39, 0.57, 0.64
    assert rates[0] < rates[1] < rates[2], rates


def test_the_bound_rejects_rejection_without_the_residual(monkeypatch) -> None:
    """Judging the next child against p again (and drawing the last token from p) instead
    of norm(max(0, p - q)) over-weights what the rejected children took."""
    monkeypatch.setattr(verification, "residual_distribution", lambda p, q: p)
    emitted, _ = _first_tokens(2, TRIALS)
    tv = 0.5 * float((emitted - P.double()).abs().sum())
    assert tv > 2 * _bound(P.double(), TRIALS), (tv, emitted)


@pytest.fixture(scope="module")
def stories(stories_target, stories_draft):
    target, tok, _ = load(stories_target)
    draft, _, _ = load(stories_draft)
    return target, draft, tok


def _tree_rounds(strategy, tok, prompt, params, n=96):
    """(nodes, depth, accepted) of each round's tree."""
    out = []
    gen = torch.Generator().manual_seed(0)
    ids = tok.encode(prompt)
    for rnd in alone(strategy.steps(strategy.new_session(512), ids, params, n, gen)):
        if rnd.tree is not None:
            depth = {0: 0}
            for v in range(1, len(rnd.tree.tokens)):
                depth[v] = depth[rnd.tree.parents[v]] + 1
            out.append((len(rnd.tree.tokens) - 1, max(depth.values()), len(rnd.tree.path)))
    return out


def test_an_exact_draft_grows_a_chain_and_every_node_is_accepted(stories) -> None:
    """Draft == target: verification accepts every first child, growth learns it within a
    round or two, and the tree becomes a chain of the budget's length, all of it accepted:
    as many tokens per pass as the best chain (budget + 1)."""
    target, _, tok = stories
    for params, kind in ((SamplingParams(temperature=0.0), "walk"), (T1, "rejection")):
        strategy = TreeSpeculation(
            target, target, budget=16, prefix_cache=PrefixCache(0), verification=kind
        )
        rounds = _tree_rounds(strategy, tok, "Once upon a time", params)
        full = rounds[2:-1]  # learnt; the last is cut by max_tokens
        assert full and all(depth == 16 and accepted == 16 for _, depth, accepted in full), (
            kind,
            rounds,
        )


def test_a_weak_draft_grows_wide(tiny_checkpoint, stories) -> None:
    """An unrelated random draft is rarely right: its calibrated acceptance stays low, and
    its trees spend the budget near the root instead of on a long chain (after a few
    rounds: a path is valued by what the evidence so far predicts, and the first rounds'
    few misses leave a deep chain some value; measured: depths 32, 30, 16, 10, 9, 8, ...)."""
    target, _, tok = stories
    noise = tiny_checkpoint(
        "llama", vocab_size=512, num_layers=1, hidden_size=32, seed=3, init_std=0.02
    )
    draft, _, _ = load(noise)
    strategy = TreeSpeculation(target, draft, budget=32, prefix_cache=PrefixCache(0))
    rounds = _tree_rounds(strategy, tok, "Once upon a time", SamplingParams(temperature=0.0))
    learnt = [depth for nodes, depth, _ in rounds[5:] if nodes == 32]
    assert learnt and max(learnt) <= 8, rounds


def test_one_early_miss_does_not_cut_a_chain() -> None:
    """A path is valued by the posterior predictive of its first children, not by the
    estimate multiplied along it: after 6 of 7 first children accepted (a plain product
    values a 46-deep chain at 0.88^46 = 0.003), a chain of confident first children still
    outvalues a sibling at the root, and the predictive falls as evidence of misses grows
    (the same 14% misses over 700 first children: a^k again)."""
    table = AcceptanceTable("walk")
    q = torch.tensor([0.97])
    for i in range(7):  # (the miss in the same draft-probability bin: the hardest case)
        table.observe(torch.tensor([1]), q, torch.tensor([i < 6]))
    first = torch.ones(46, dtype=torch.long)
    chain = table.log_acceptance(first, q.expand(46), torch.arange(46)).sum().exp()
    alone = table.log_acceptance(first, q.expand(46)).sum().exp()  # each valued alone
    sibling = table.log_acceptance(torch.tensor([2]), torch.tensor([0.3])).exp()
    assert float(chain) > 0.1 > 0.01 > float(alone) and float(chain) > 2 * float(sibling)
    # Each next first child on a path is predicted at least as likely as the one before.
    steps = table.log_acceptance(first, q.expand(46), torch.arange(46)).exp()
    assert bool((steps[1:] >= steps[:-1]).all()) and float(steps[0]) == pytest.approx(
        float(table.log_acceptance(first[:1], q[:1]).exp())
    )
    many = AcceptanceTable("walk")
    for _ in range(100):
        many.observe(torch.ones(7, dtype=torch.long), torch.full((7,), 0.97),
                     torch.tensor([True] * 6 + [False]))  # fmt: skip
    deep = many.log_acceptance(first, q.expand(46), torch.arange(46)).sum().exp()
    plain = many.log_acceptance(first, q.expand(46)).sum().exp()
    assert float(deep) == pytest.approx(float(plain), rel=0.5) and float(deep) < 0.01


def test_a_table_learns_what_verification_did() -> None:
    table = AcceptanceTable("walk")
    ranks, q = torch.tensor([1, 2]), torch.tensor([0.3, 0.2])
    before = table.log_acceptance(ranks, q).exp()
    for _ in range(50):  # the first child always taken, the second never
        table.observe(ranks, q, torch.tensor([True, False]))
    after = table.log_acceptance(ranks, q).exp()
    # (The prior is a chain already: a first child almost always, a second rarely.)
    assert after[0] > max(0.98, float(before[0])) and after[1] < before[1] / 4
    # Cells never seen follow their rank's outcomes, not the prior alone.
    unseen = table.log_acceptance(torch.tensor([1]), torch.tensor([0.9])).exp()
    assert float(unseen) > 0.9
    # With every first child accepted and no other, a tree is a chain: budget + 1 tokens.
    assert table.expected_tokens(10) == pytest.approx(11, abs=0.6)


def test_regimes_and_kinds_have_their_own_tables() -> None:
    model = AcceptanceModel()
    cold, hot = SamplingParams(temperature=0.3), SamplingParams(temperature=1.0)
    assert regime(cold) != regime(hot) and regime(SamplingParams(temperature=0.0)) == "greedy"
    assert model.table("walk", cold) is not model.table("walk", hot)
    assert model.table("walk", hot) is not model.table("rejection", hot)
    assert model.table("walk", hot) is model.table("walk", SamplingParams(temperature=1.05))


def test_auto_keeps_rejection_that_accepts_and_otherwise_measures_both(stories) -> None:
    """At T > 0 `auto` starts with rejection; where its first children are accepted at
    least REJECTION_STAYS of the time it stays (no coupling of two draws beats that), else
    it tries the walk and keeps it only where it yields clearly more tokens per round. A seeded request
    and a greedy one walk."""
    target, draft, _ = stories
    strategy = TreeSpeculation(target, draft, budget=16, prefix_cache=PrefixCache(0))

    def kind_of(params: SamplingParams) -> tuple[str, AcceptanceTable]:
        # The strategy's choice for a round of its trees (drafted by a model, not n-grams).
        return choose_verification(strategy.verification, strategy.acceptance, params, ngram=False)

    walk_t = strategy.acceptance.table("walk", T1)
    reject_t = strategy.acceptance.table("rejection", T1)
    first = torch.tensor([1]), torch.tensor([0.5])
    for _ in range(REJECTION_FIRST):
        kind, table = kind_of(T1)
        assert kind == "rejection"
        table.observe(*first, torch.tensor([True]))
        table.note_round(9)
    assert kind_of(T1)[0] == "rejection"  # it accepts: it stays
    for _ in range(40):  # now its first children mostly fail
        reject_t.observe(*first, torch.tensor([False]))
    assert reject_t.marginal()[0] < REJECTION_STAYS
    tried = []
    for _ in range(EXPLORE_ROUNDS):
        kind, table = kind_of(T1)
        tried.append(kind)
        table.note_round(12)  # the walk yields more tokens per round than rejection's 9
    assert tried == ["walk"] * EXPLORE_ROUNDS
    walk_t.note_round(12)  # (one of the first EXPLORE_GENERATIONS starts: no exploring now)
    # 12 against 9 in 5 rounds is within noise (the walk needs 9 x (1 + 1/sqrt 5) = 13)
    assert kind_of(T1)[0] == "rejection"
    for _ in range(3):
        walk_t.note_round(16)  # now clearly more
    assert walk_t.recent > reject_t.recent * (1 + 1 / 8**0.5)
    assert kind_of(T1)[0] == "walk"
    seeded = SamplingParams(temperature=1.0, seed=3)
    assert kind_of(seeded)[0] == "walk"
    assert kind_of(SamplingParams(temperature=0.0))[0] == "walk"


# drawn over a support smaller than the branch, over one larger, or over the whole row
@pytest.mark.parametrize("support", [3, 12, 64])
def test_children_are_an_ordered_draw_without_replacement_from_q(support: int) -> None:
    """The first two children of a node have the law of two ordered draws without
    replacement from q, whether q's support is small (top-p/top-k left a few tokens,
    scattered over the row: only they get noise) or the whole row; past a support smaller
    than the branch come tokens of q = 0."""
    vocab, trials = 64, 6000
    gen = torch.Generator().manual_seed(2)
    ids = torch.randperm(vocab, generator=gen)[:support]  # scattered ids
    q = torch.zeros(vocab)
    q[ids] = torch.rand(support, generator=gen) + 0.2
    q[ids[0]] *= 4  # an uneven law
    q /= q.sum()
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for _ in range(trials):
        chosen = _ordered_draw(q, 5, gen)
        assert len(set(chosen.tolist())) == 5
        if support < 5:  # the support first, then tokens of q = 0
            assert set(chosen[:support].tolist()) == set(ids.tolist())
            assert not bool(q[chosen[support:]].any())
        else:
            assert bool((q[chosen] > 0).all())
        counts[chosen[0], chosen[1]] += 1
    qd = q.double()
    exact = qd[:, None] * qd[None, :] / (1 - qd[:, None])  # P(first i) P(second j | i)
    exact.fill_diagonal_(0)
    assert float(counts[:, q == 0].sum()) == 0  # the second child too is of the support
    cells = exact > 0
    expected = 0.5 * float(torch.sqrt(exact * (1 - exact) / trials)[cells].sum())
    tv = 0.5 * float((counts / trials - exact).abs().sum())
    assert tv < expected + math.sqrt(math.log(1e4) / (2 * trials)), tv


def test_a_generation_that_walked_walks_on(stories) -> None:
    """A walk round's tree at T > 0 is drawn by the noise of positions past where the
    walk stops, so within one generation `auto` never goes from the walk to rejection
    (rejection would draw those positions afresh exactly where the walk stopped short: a
    biased law). Here the tables make `auto` try the walk, then prefer rejection: the
    generation walks to its end, and the next generation starts with rejection again."""
    target, draft, tok = stories
    strategy = TreeSpeculation(target, draft, budget=8, prefix_cache=PrefixCache(0))
    reject_t = strategy.acceptance.table("rejection", T1)
    for _ in range(REJECTION_FIRST):  # rejection had its rounds, its first children failing
        reject_t.observe(torch.tensor([1]), torch.tensor([0.5]), torch.tensor([False]))
        reject_t.note_round(100)  # but many tokens a round: preferred once the walk is seen
    assert choose_verification("auto", strategy.acceptance, T1, ngram=False)[0] == "walk"

    def kinds() -> list[str | None]:
        ids = tok.encode("The little dog")
        steps = strategy.steps(
            strategy.new_session(256), ids, T1, 48, torch.Generator().manual_seed(5)
        )
        return [rnd.stats.tree_verification for rnd in alone(steps)]

    first = kinds()
    assert first[:EXPLORE_ROUNDS] == ["walk"] * EXPLORE_ROUNDS
    # The walk's rounds were explored, and rejection's 100 tokens a round win from here...
    assert choose_verification("auto", strategy.acceptance, T1, ngram=False)[0] == "rejection"
    # ...but not within the generation that walked.
    assert len(first) > EXPLORE_ROUNDS and set(first) <= {"walk", None}
    assert kinds()[0] == "rejection"  # a new generation may start with either


def test_auto_tries_and_explores_the_walk_only_as_a_generation_starts(stories) -> None:
    """A generation that walked walks on, so the walk is tried (its first EXPLORE_ROUNDS)
    and explored (one generation in EXPLORE_GENERATIONS) only at a generation's first tree
    round: explored mid-generation, it held the rest of it, however much better rejection
    yielded (a reviewer found)."""
    target, draft, _ = stories
    strategy = TreeSpeculation(target, draft, budget=16, prefix_cache=PrefixCache(0))
    walk_t = strategy.acceptance.table("walk", T1)
    reject_t = strategy.acceptance.table("rejection", T1)
    for _ in range(REJECTION_FIRST):
        reject_t.observe(torch.tensor([1]), torch.tensor([0.5]), torch.tensor([False]))
        reject_t.note_round(9)

    def kind(first: bool) -> str:
        return choose_verification("auto", strategy.acceptance, T1, ngram=False, first=first)[0]

    assert kind(first=False) == "rejection" and kind(first=True) == "walk"
    for _ in range(EXPLORE_ROUNDS):
        walk_t.note_round(5)  # tried: it yields less
    assert [kind(first=False) for _ in range(3 * EXPLORE_GENERATIONS)] == ["rejection"] * (
        3 * EXPLORE_GENERATIONS
    )
    starts = [kind(first=True) for _ in range(EXPLORE_GENERATIONS)]
    assert starts.count("walk") == 1 and starts.count("rejection") == EXPLORE_GENERATIONS - 1


def test_stats_say_how_trees_were_verified(stories) -> None:
    target, draft, tok = stories
    strategy = TreeSpeculation(
        target, draft, budget=8, prefix_cache=PrefixCache(0), verification="rejection"
    )
    ids = tok.encode("The little dog")
    gen = Generation(strategy, strategy.new_session(256), tok, ids, T1, 32, ignore_eos=True)
    stats = gen.run().stats.to_dict()
    assert stats["tree_verification"] == "rejection"
    assert stats["acceptance_estimate"] > 1.0
    # Every round drafted and was verified by rejection, but perhaps the request's last
    # token (a plain step when one token is left: nothing to draft for).
    assert list(stats["verification_rounds"]) == ["rejection"]
    assert stats["rounds"] - 1 <= stats["verification_rounds"]["rejection"] <= stats["rounds"]


def test_auto_gives_rejection_its_first_rounds_even_failing(stories) -> None:
    """Rejection's first REJECTION_FIRST rounds in a regime are its own, however its first
    children fare (a cold run's few rounds are not split with a walk that starts cold);
    only then, failing, is the walk tried."""
    target, draft, _ = stories
    strategy = TreeSpeculation(target, draft, budget=16, prefix_cache=PrefixCache(0))
    reject_t = strategy.acceptance.table("rejection", T1)
    first = torch.tensor([1]), torch.tensor([0.5])
    for _ in range(REJECTION_FIRST):
        kind, _table = choose_verification("auto", strategy.acceptance, T1, ngram=False)
        assert kind == "rejection"
        reject_t.observe(*first, torch.tensor([False]))
        reject_t.note_round(1)
    assert reject_t.marginal()[0] < REJECTION_STAYS
    assert choose_verification("auto", strategy.acceptance, T1, ngram=False)[0] == "walk"
