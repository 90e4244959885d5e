"""A seed reproduces a sampled generation whatever the tree looked like: the autoregressive
strategy, the tree walk (any budget, auto) and the prefix-cache walk all draw the token at
position t with noise made from (seed, t), so the same seed gives the same text from all of
them, in a fresh or a reused session."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeling.checkpoints.checkpoint import load
from speculative.generation import Generation
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive
from speculative.strategies.tree import TreeSpeculation


@pytest.fixture(scope="module")
def pair(stories_target: Path, stories_draft: Path):
    target, tok, _ = load(stories_target)
    draft, _, _ = load(stories_draft)
    return target, draft, tok


def run(strategy, session, tok, params: SamplingParams, prompt: str = "Once upon a time"):
    gen = Generation(strategy, session, tok, tok.encode(prompt), params, 48, ignore_eos=True)
    return gen.run().token_ids


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, presence_penalty=0.5, seed=11),
])  # fmt: skip
def test_same_seed_same_sample_across_strategies_and_sessions(pair, params):
    target, draft, tok = pair
    ar = Autoregressive(target)
    expected = run(ar, ar.new_session(512), tok, params)
    for budget in (8, 32, "auto"):
        tree = TreeSpeculation(target, draft, budget=budget)
        session = tree.new_session(512)
        # Three times in one session: the later runs walk the prefix cache and reuse KV.
        for _ in range(3):
            assert run(tree, session, tok, params) == expected, budget
    ngram = TreeSpeculation(target, None, budget=16)
    assert run(ngram, ngram.new_session(512), tok, params) == expected


def test_different_seeds_differ(pair):
    target, _, tok = pair
    ar = Autoregressive(target)
    a = run(ar, ar.new_session(512), tok, SamplingParams(temperature=1.0, seed=1))
    b = run(ar, ar.new_session(512), tok, SamplingParams(temperature=1.0, seed=2))
    assert a != b
