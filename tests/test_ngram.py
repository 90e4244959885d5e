"""Prompt-lookup drafting: which continuations are found and in which order, the n-gram
drafter's proposal (a point mass on what it proposes), and the n-gram tree."""

from __future__ import annotations

import torch

from speculative.ngram import (
    NgramDrafter,
    ngram_continuations,
    ngram_proposal,
    ngram_tree,
    ngram_tree_prefixes,
)
from speculative.passes import run_alone
from speculative.sampling import PenaltyContext, SamplingParams


def test_longest_suffix_wins_and_most_recent_comes_first():
    #          0  1  2  3  4  5  6  7  8  9 10
    context = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    # Suffix (1, 2, 3) occurred at 0 and 4: the continuation after 4 is more recent.
    assert ngram_continuations(context) == [[5, 1, 2, 3], [4, 1, 2, 3, 5, 1, 2, 3]]
    assert ngram_continuations(context, max_len=2) == [[5, 1], [4, 1]]
    assert ngram_continuations(context, max_len=2, max_candidates=1) == [[5, 1]]


def test_a_shorter_ngram_is_used_only_when_the_longer_never_occurred():
    context = [7, 8, 9, 5, 6, 8, 9]
    # The 3-gram (6, 8, 9) never occurred before; the 2-gram (8, 9) did, at 1.
    assert ngram_continuations(context, max_len=3) == [[5, 6, 8]]
    # With min_ngram above what matches there is nothing to propose.
    assert ngram_continuations(context, min_ngram=3) == []


def test_frequent_continuations_rank_above_recent_ones():
    # After token 4: "9" twice (positions 1 and 5), then "6" once most recently (position 9).
    context = [4, 9, 0, 0, 4, 9, 0, 0, 4, 6, 0, 0, 4]
    assert ngram_continuations(context, max_ngram=1, max_len=1) == [[9], [6]]


def test_no_match_and_degenerate_inputs():
    assert ngram_continuations([]) == []
    assert ngram_continuations([5]) == []
    assert ngram_continuations([1, 2, 3]) == []
    assert ngram_continuations([1, 2, 1], max_len=0) == []
    # A run of one token continues itself; the match may not be the suffix itself.
    assert ngram_continuations([3, 3, 3, 3]) == [[3]]
    # Continuations cut short by the end of the context count for the longer ones they
    # begin, so the proposal is as long as the context allows.
    assert ngram_proposal([3, 3, 3, 3, 3, 3], 4) == [3, 3, 3]


def test_truncated_continuations_merge_and_candidates_are_bounded():
    context = [1, 2] * 20 + [1]
    assert ngram_continuations(context, max_len=5) == [[2, 1, 2, 1, 2]]
    context = [1, 5, 0, 1, 5, 0, 1, 6, 0, 1, 7, 0, 1, 8, 0, 1]
    found = ngram_continuations(context, max_ngram=1, max_len=2, max_candidates=3)
    assert found == [[5, 0], [8, 0], [7, 0]]  # 5 follows twice, then by recency


def test_ngram_drafter_proposal_is_a_point_mass():
    drafter = NgramDrafter(vocab_size=10)
    penalties = PenaltyContext(10, [1, 2, 3], "cpu")
    proposal = run_alone(
        drafter.propose(
            None,  # type: ignore[arg-type]  # the n-gram drafter keeps no per-session state
            [1, 2, 3, 4, 1, 2, 3],
            3,
            SamplingParams(),
            penalties,
            torch.Generator(),
        )
    )
    assert proposal.tokens == [4, 1, 2]
    assert proposal.passes == 0
    assert torch.equal(proposal.q, torch.nn.functional.one_hot(torch.tensor([4, 1, 2]), 10).float())
    empty = run_alone(
        drafter.propose(None, [1, 2, 3], 3, SamplingParams(), penalties, torch.Generator())
    )  # type: ignore[arg-type]
    assert empty.tokens == [] and empty.q.shape == (0, 10)


def test_tree_prefixes_follow_what_most_often_came_next():
    """After "1 2" the context continued with 3 three times (then 5 twice) and with 4
    once: the tree takes 3, then "3 5", before the once-seen 4; among prefixes seen once,
    shorter first, then the more recent; parents always precede their children."""
    context = [1, 2, 3, 5, 9, 1, 2, 3, 5, 8, 1, 2, 4, 7, 1, 2, 3, 6, 0, 1, 2]
    prefixes = ngram_tree_prefixes(context, budget=6, max_len=3)
    assert prefixes == [(3,), (3, 5), (4,), (3, 6), (4, 7), (3, 6, 0)]
    seen: set[tuple[int, ...]] = {()}
    for p in ngram_tree_prefixes(context, budget=20, max_len=3):
        assert p[:-1] in seen  # the parent came first
        seen.add(p)
    assert ngram_tree_prefixes([1, 2, 3], budget=4) == []


def test_ngram_tree_is_the_trie_of_the_best_prefixes():
    """Tree speculation's prompt-lookup tree: rooted at the context's last token, its nodes
    are `ngram_tree_prefixes` in order, each under its parent prefix."""
    #          0  1  2  3  4  5  6  7
    context = [1, 2, 3, 1, 2, 4, 1, 2]
    # "1 2" was followed by "3 1" and (more recently) "4 1": 4, then 3, then "4 1".
    assert ngram_tree_prefixes(context, budget=3, max_len=2) == [(4,), (3,), (4, 1)]
    tree = ngram_tree(context, budget=3, max_depth=2)
    assert tree.token_list() == [2, 4, 3, 1]
    assert tree.parents[: tree.size].tolist() == [-1, 0, 0, 1]
    assert ngram_tree([1, 2, 3], budget=4, max_depth=2).size == 1  # nothing repeats: the root
