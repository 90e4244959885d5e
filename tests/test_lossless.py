"""Statistical losslessness: every registered strategy samples exactly the target's
distribution.

On a vocabulary of 8 tokens the target's exact distribution over the first n generated
tokens is computed by enumeration (the target run on every prefix, the same final sampling
transform applied). Each strategy then generates from the same prompt RUNS times with
different seeds, and the total-variation distance between the empirical and the exact
distribution must stay below a bound that follows from RUNS alone:

    E[TV] <= 1/2 * sum_x sqrt(P(x) (1 - P(x)) / RUNS)       (Jensen, cell by cell)
    P(TV - E[TV] > t) <= exp(-2 RUNS t^2)                  (McDiarmid: one run moves TV
                                                             by at most 1/RUNS)

so TV < E-bound + sqrt(ln(1/DELTA) / (2 RUNS)) fails a correct sampler with probability
below DELTA. A sampler that skips the residual step on rejection (resamples from p instead
of norm(max(0, p - q))) is a negative control the same bound must reject.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import speculative.verification as verify_module
from daemon.options import RuntimeOptions
from daemon.runtime import STRATEGY_BUILDERS, Runtime
from modeling.decoder import Transformer
from speculative.grammar import Constraint, Grammar
from speculative.passes import Allot, Forward, PassRequest, allot, alone, execute
from speculative.rounds import RoundSteps, Strategy
from speculative.sampling import PenaltyContext, SamplingParams, probabilities
from speculative.strategies.linear import Linear

VOCAB = 8
PROMPT = [1, 3, 4, 5, 3, 4]  # repeats itself, so n-gram drafting has something to propose
CONTEXT = 16
RUNS = 1200
DELTA = 1e-4
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    max_position_embeddings=32,
)
# name → (sampling parameters, number of generated tokens whose joint law is compared)
SETTINGS: dict[str, tuple[SamplingParams, int]] = {
    "temperature-1": (SamplingParams(temperature=1.0), 2),
    "top-k-top-p-presence": (
        SamplingParams(temperature=1.0, top_k=4, top_p=0.9, presence_penalty=0.7),
        3,
    ),
    # OpenAI's logit_bias: a token made likelier, one less likely, one banned (-100).
    "logit-bias": (
        SamplingParams(temperature=1.0, logit_bias=((2, 1.5), (4, -2.0), (6, -100.0))),
        2,
    ),
    # Penalties that count every token of a node's own path, at a temperature below 1,
    # and min_p.
    "repetition-frequency-min-p": (
        SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, min_p=0.05),
        2,
    ),
}
# (strategy, draft, tree verification): every strategy the daemon registers, with each
# kind of drafter, and the tree with each verification (auto switches between both).
CASES = [
    ("autoregressive", None, "auto"),
    ("linear", "model", "auto"),
    ("linear", "ngram", "auto"),
    ("tree", "model", "auto"),
    ("tree", "model", "walk"),
    ("tree", "model", "rejection"),
    ("tree", "ngram", "auto"),
    # The target's own 2-bit layers (it streams them all), drafting in its KV cache.
    ("tree", "substitute", "auto"),
    ("linear", "substitute", "auto"),
]


@pytest.fixture(scope="module")
def pair(tiny_checkpoint) -> tuple[Path, Path]:
    # A peaked-but-not-degenerate target, and an unrelated, more confident draft: it
    # disagrees often, so rejections (and the residual) carry real probability mass.
    target = tiny_checkpoint(init_std=0.5, seed=11, **TINY)
    draft = tiny_checkpoint(init_std=1.0, seed=14, **TINY)
    return target, draft


@pytest.fixture(scope="module")
def unequal_pairs(tiny_checkpoint) -> dict[str, tuple[Path, Path]]:
    """Pairs sharing the VOCAB-entry tokenizer with embeddings of different sizes (Qwen2.5
    0.5B vs 72B: 151,936 vs 152,064 rows). Random padding rows are far from unused here: a
    wider target samples ids the draft has no row for, a wider draft would propose ids the
    target lacks unless they are masked."""
    sizes = {"target-wider": (VOCAB + 2, VOCAB), "draft-wider": (VOCAB, VOCAB + 4)}
    tiny = {k: v for k, v in TINY.items() if k != "vocab_size"}
    return {
        name: (
            tiny_checkpoint(init_std=0.5, seed=11, vocab_size=t, tokenizer_size=VOCAB, **tiny),
            tiny_checkpoint(init_std=1.0, seed=14, vocab_size=d, tokenizer_size=VOCAB, **tiny),
        )
        for name, (t, d) in sizes.items()
    }


def runtime(
    pair: tuple[Path, Path],
    strategy: str,
    draft: str | None,
    verification: str = "auto",
    prefix_cache: int = 0,
) -> Runtime:
    """The prefix cache is off unless asked for: the runs share one prompt, so with it on
    nearly every token after the first few hundred runs is drawn from cached rows and the
    tree's verification goes untested (a tree that skipped the residual passed)."""
    target, draft_path = pair
    options = RuntimeOptions(
        model=str(target),
        draft={"model": str(draft_path), "ngram": "ngram", None: None}.get(draft, draft),
        strategy=strategy,
        spec_length=2,
        budget=6,
        max_depth=3,
        tree_verification=verification,
        context=CONTEXT,
        prefix_cache=prefix_cache,
    )
    if draft == "substitute":
        options = replace(options, substitute_bits=2, offload="stream", resident_layers=0)
    return Runtime(options)


def exact_distribution(
    target: Transformer,
    prompt: Sequence[int],
    params: SamplingParams,
    n: int,
    allows: Callable[[tuple[int, ...]], set[int]] | None = None,
) -> torch.Tensor:
    """(V**n,) the target's probability of each n-token continuation, index = base-V number;
    V is the target's width (its embedding rows, which may exceed the tokenizer). With
    `allows` (generated prefix → the tokens a grammar allows next): constrained decoding,
    the logits of every other token at -inf before the sampling transform."""
    vocab = target.config.vocab_size
    next_token: dict[tuple[int, ...], torch.Tensor] = {}  # generated prefix → (V,)

    def distribution_after(generated: tuple[int, ...]) -> torch.Tensor:
        if generated not in next_token:
            ids = [*prompt, *generated]
            logits = target(
                torch.tensor(ids),
                torch.arange(len(ids)),
                target.new_cache(len(ids)),
                last_only=True,
            )  # (1, V)
            if allows is not None:
                keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
                keep[sorted(allows(generated))] = True
                logits = logits.masked_fill(~keep, float("-inf"))
            penalties = PenaltyContext(vocab, prompt, "cpu")
            penalties.append(generated)
            next_token[generated] = probabilities(logits, params, penalties.rows())[0].double()
        return next_token[generated]

    joint = torch.zeros(vocab**n, dtype=torch.float64)
    for seq in itertools.product(range(vocab), repeat=n):
        prob = 1.0
        for i in range(n):
            prob *= float(distribution_after(seq[:i])[seq[i]])
            if prob == 0.0:
                break
        joint[_index(seq, vocab)] = prob
    return joint


def _index(seq: Sequence[int], vocab: int) -> int:
    index = 0
    for t in seq:
        index = index * vocab + t
    return index


def empirical_distribution(
    strategy: Strategy,
    prompt: Sequence[int],
    params: SamplingParams,
    n: int,
    runs: int,
    constraint: Callable[[], Constraint] | None = None,
) -> torch.Tensor:
    """(V**n,) frequencies of the first n tokens over `runs` seeded generations. One session
    serves every run (reuse_prefix rolls it back to the prompt), as the daemon reuses one.
    `constraint` makes each run's grammar state."""
    vocab = strategy.target.config.vocab_size
    session = strategy.new_session(CONTEXT)
    counts = torch.zeros(vocab**n, dtype=torch.float64)
    for seed in range(runs):
        session.reuse_prefix(prompt)
        generator = torch.Generator().manual_seed(seed)
        rounds = alone(
            strategy.steps(session, prompt, params, n, generator)
            if constraint is None
            else strategy.steps(session, prompt, params, n, generator, constraint())
        )
        tokens: list[int] = []
        for rnd in rounds:
            tokens += rnd.tokens
            if len(tokens) >= n:
                break
        rounds.close()
        assert len(tokens) >= n, "the context has room for n tokens"
        counts[_index(tokens[:n], vocab)] += 1
    return counts / runs


def tv_bound(exact: torch.Tensor, runs: int, delta: float = DELTA) -> float:
    expected = 0.5 * float(torch.sqrt(exact * (1 - exact) / runs).sum())
    return expected + math.sqrt(math.log(1 / delta) / (2 * runs))


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(("strategy_name", "draft", "verification"), CASES)
def test_strategy_samples_exactly_the_target_distribution(
    pair, strategy_name, draft, verification, setting
):
    assert strategy_name in STRATEGY_BUILDERS, (
        f"strategy {strategy_name!r} is not registered in daemon/runtime.py"
    )
    params, n = SETTINGS[setting]
    rt = runtime(pair, strategy_name, draft, verification)
    strategy = rt.strategy(strategy_name)
    exact = exact_distribution(rt.target, PROMPT, params, n)
    assert abs(float(exact.sum()) - 1.0) < 1e-6
    empirical = empirical_distribution(strategy, PROMPT, params, n, RUNS)
    tv, bound = total_variation(empirical, exact), tv_bound(exact, RUNS)
    assert tv < bound, (
        f"{strategy_name}/{draft}/{verification} {setting}: TV {tv:.4f} >= bound {bound:.4f}"
    )
    if strategy_name == "tree" and draft == "model" and verification != "walk":
        # Rejection really ran (auto tries both in its first rounds).
        assert rt.acceptance.table("rejection", params).rounds > 0


# (at T=0.7 with min_p the ids the draft lacks are too rarely sampled to test them)
@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "repetition-frequency-min-p"])
@pytest.mark.parametrize("strategy_name", ["linear", "tree"])
@pytest.mark.parametrize("widths", ["target-wider", "draft-wider"])
def test_unequal_embedding_widths_sample_exactly_the_target_distribution(
    unequal_pairs, widths, strategy_name, setting
):
    params, n = SETTINGS[setting]
    rt = runtime(unequal_pairs[widths], strategy_name, "model")
    assert rt.draft is not None and rt.draft.vocab_width == rt.target.config.vocab_size
    strategy = rt.strategy(strategy_name)
    exact = exact_distribution(rt.target, PROMPT, params, n)
    assert abs(float(exact.sum()) - 1.0) < 1e-6
    if widths == "target-wider":  # the ids the draft lacks really are sampled
        assert float(exact.view(-1, rt.target.config.vocab_size)[:, VOCAB:].sum()) > 0.01
    empirical = empirical_distribution(strategy, PROMPT, params, n, RUNS)
    tv, bound = total_variation(empirical, exact), tv_bound(exact, RUNS)
    assert tv < bound, f"{strategy_name} {widths} {setting}: TV {tv:.4f} >= bound {bound:.4f}"


# A grammar over the tiny vocabulary (ids 3..7 spell a..e): a or b, then c (forced: the
# one token allowed), then d or e; or d, then a, b or e, then any letter. Its masks differ
# from node to node of a tree, and one forced token sits mid-tree.
GRAMMAR = "[ab]c[de]|d[abe][a-e]"
A, B, C, D, E = 3, 4, 5, 6, 7


def grammar_allows(generated: tuple[int, ...]) -> set[int]:
    """What GRAMMAR allows after `generated`, written out by hand (the reference does not
    ask the engine)."""
    if not generated:
        return {A, B, D}
    first, length = generated[0], len(generated)
    if first in (A, B):
        return {C} if length == 1 else {D, E}
    return {A, B, E} if length == 1 else {A, B, C, D, E}


@pytest.mark.parametrize(("strategy_name", "draft", "verification"), CASES)
def test_under_a_grammar_every_strategy_samples_the_constrained_target(
    pair, strategy_name, draft, verification
):
    """The reference is constrained autoregressive decoding: each position's logits masked
    to what the grammar allows there, then penalties, temperature, top-k/p."""
    params, n = SETTINGS["top-k-top-p-presence"]
    rt = runtime(pair, strategy_name, draft, verification)
    strategy = rt.strategy(strategy_name)
    grammar = Grammar.regex(GRAMMAR, "grammar")
    width = rt.target.vocab_width
    exact = exact_distribution(rt.target, PROMPT, params, n, grammar_allows)
    assert abs(float(exact.sum()) - 1.0) < 1e-6
    empirical = empirical_distribution(
        strategy, PROMPT, params, n, RUNS, lambda: Constraint(grammar, rt.tokenizer, width)
    )
    tv, bound = total_variation(empirical, exact), tv_bound(exact, RUNS)
    assert tv < bound, f"{strategy_name}/{draft}/{verification}: TV {tv:.4f} >= {bound:.4f}"


def test_every_registered_strategy_is_covered():
    assert {name for name, _, _ in CASES} >= set(STRATEGY_BUILDERS)


class ResamplesFromTarget(Linear):
    """Wrong on purpose: on rejection it samples p again instead of norm(max(0, p - q)),
    which double-counts the mass the accepted draft tokens already gave min(p, q)."""

    def correction_distribution(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return p


def test_the_bound_rejects_a_sampler_that_skips_the_residual(pair):
    params, n = SETTINGS["top-k-top-p-presence"]
    rt = runtime(pair, "linear", "model")
    linear = rt.strategy("linear")
    assert isinstance(linear, Linear)
    wrong = ResamplesFromTarget(linear.target, linear.drafter, linear.spec_length)
    exact = exact_distribution(rt.target, PROMPT, params, n)
    empirical = empirical_distribution(wrong, PROMPT, params, n, RUNS)
    tv, bound = total_variation(empirical, exact), tv_bound(exact, RUNS)
    assert tv > bound, f"the negative control passed: TV {tv:.4f} <= bound {bound:.4f}"


@pytest.mark.parametrize("setting", ["top-k-top-p-presence", "repetition-frequency-min-p"])
def test_rows_drawn_from_the_prefix_cache_have_the_target_distribution(pair, setting):
    """With the prefix cache on, the runs after the first few hundred draw nearly every
    token from rows cached by the runs before, under each run's own options."""
    params, n = SETTINGS[setting]
    rt = runtime(pair, "tree", "model", prefix_cache=1 << 30)
    strategy = rt.strategy("tree")
    exact = exact_distribution(rt.target, PROMPT, params, n)
    empirical = empirical_distribution(strategy, PROMPT, params, n, RUNS)
    tv, bound = total_variation(empirical, exact), tv_bound(exact, RUNS)
    assert tv < bound, f"prefix cache {setting}: TV {tv:.4f} >= bound {bound:.4f}"
    assert rt.prefix_cache.stats.hits > RUNS * (n - 1)  # most tokens came from the cache


def test_the_bound_rejects_a_tree_that_skips_the_residual(pair, monkeypatch):
    """The tree's rejection verification with the residual skipped (p stays p after a
    rejected child): the same bound fails it."""
    params, n = SETTINGS["top-k-top-p-presence"]
    monkeypatch.setattr(verify_module, "residual_distribution", lambda p, q: p)
    rt = runtime(pair, "tree", "model", "rejection")
    exact = exact_distribution(rt.target, PROMPT, params, n)
    empirical = empirical_distribution(rt.strategy("tree"), PROMPT, params, n, RUNS)
    tv, bound = total_variation(empirical, exact), tv_bound(exact, RUNS)
    assert tv > bound, f"the negative control passed: TV {tv:.4f} <= bound {bound:.4f}"


def empirical_in_batches(
    strategy: Strategy,
    prompt: Sequence[int],
    params: SamplingParams,
    n: int,
    runs: int,
    batch: int = 8,
    forest: int = 12,
) -> torch.Tensor:
    """`empirical_distribution` with the runs sampled `batch` at a time inside shared
    passes, as the engine runs them: every generation advances to its next pass request,
    the draft's requests run batched until all wait on the target, then one target pass
    carries them all; the trees share `forest` nodes per pass, granted in one best-first
    order over all of them."""
    vocab = strategy.target.config.vocab_size
    counts = torch.zeros(vocab**n, dtype=torch.float64)
    for first in range(0, runs, batch):
        streams: dict[int, RoundSteps] = {}
        for seed in range(first, min(first + batch, runs)):
            session = strategy.new_session(CONTEXT)
            gen = torch.Generator().manual_seed(seed)
            streams[seed] = strategy.steps(session, prompt, params, n, gen)
        tokens: dict[int, list[int]] = {seed: [] for seed in streams}
        waiting: dict[int, PassRequest] = {}
        for seed in list(streams):
            _run_to_request(seed, streams, tokens, waiting, n)
        budget = forest
        while waiting:
            asking = [s for s, r in waiting.items() if isinstance(r, Allot)]
            if asking:
                budget -= allot([r for s in asking if isinstance(r := waiting[s], Allot)], budget)
            drafting = [
                s
                for s, r in waiting.items()
                if isinstance(r, Forward) and r.model is not strategy.target
            ]
            if asking or drafting:
                group = asking + drafting
                execute([r for s in drafting if isinstance(r := waiting[s], Forward)])
            else:  # every generation waits on the target: one pass for all, a new forest
                group, budget = list(waiting), forest
                execute([r for r in waiting.values() if isinstance(r, Forward)])
            for seed in group:
                del waiting[seed]
                _run_to_request(seed, streams, tokens, waiting, n)
        for got in tokens.values():
            assert len(got) >= n, "the context has room for n tokens"
            counts[_index(got[:n], vocab)] += 1
    return counts / runs


def _run_to_request(
    seed: int,
    streams: dict[int, RoundSteps],
    tokens: dict[int, list[int]],
    waiting: dict[int, PassRequest],
    n: int,
) -> None:
    """Run one generation on to its next pass request, or close it once it has n tokens."""
    for item in streams[seed]:
        if isinstance(item, Forward | Allot):
            waiting[seed] = item
            return
        tokens[seed] += item.tokens
        if len(tokens[seed]) >= n:
            break
    streams.pop(seed).close()


@pytest.mark.parametrize(
    ("strategy_name", "verification"), [("linear", "auto"), ("tree", "walk"), ("tree", "rejection")]
)
def test_a_request_sampled_inside_a_batch_has_the_target_distribution(
    pair, strategy_name, verification
):
    params, n = SETTINGS["top-k-top-p-presence"]
    rt = runtime(pair, strategy_name, "model", verification)
    strategy = rt.strategy(strategy_name)
    exact = exact_distribution(rt.target, PROMPT, params, n)
    empirical = empirical_in_batches(strategy, PROMPT, params, n, RUNS)
    tv, bound = total_variation(empirical, exact), tv_bound(exact, RUNS)
    assert tv < bound, f"{strategy_name} in batches: TV {tv:.4f} >= bound {bound:.4f}"


@pytest.mark.parametrize(
    ("family", "experts", "draft"),
    [("qwen3_moe", "stream", "pair"), ("gpt_oss", "device", "pair"),
     ("qwen2_moe", "cpu", "substitute")],
    ids=["qwen3_moe", "gpt_oss", "qwen2_moe-substitute"],
)  # fmt: skip
def test_a_mixture_of_experts_target_is_sampled_exactly(
    pair, tiny_checkpoint, family, experts, draft
):
    """A mixture-of-experts target (Qwen3-MoE with its experts streamed through a cache of
    3; gpt-oss with its sinks, clamped experts and top-k softmax routing; Qwen2-MoE with
    its experts on the CPU, drafted by its substitute's 2-bit expert copies) under a tree:
    its exact distribution, by the same bound."""
    params, n = SETTINGS["temperature-1"]
    target = tiny_checkpoint(family, init_std=0.5, seed=11, **TINY)
    rt = Runtime(
        RuntimeOptions(
            model=str(target), draft=str(pair[1]) if draft == "pair" else draft,
            substitute_bits=2, strategy="tree", budget=6, max_depth=3, context=CONTEXT,
            experts=experts, expert_slots=3 if experts == "stream" else None,
            prefix_cache=0,
        )
    )  # fmt: skip
    assert rt.target.config.moe is not None and rt.plan.expert_mode == experts
    exact = exact_distribution(rt.target, PROMPT, params, n)
    empirical = empirical_distribution(rt.strategy("tree"), PROMPT, params, n, RUNS)
    tv, bound = total_variation(empirical, exact), tv_bound(exact, RUNS)
    assert tv < bound, f"{family}: TV {tv:.4f} >= bound {bound:.4f}"
