"""Linear speculation reproduces the target exactly: greedy parity with autoregressive
decoding (random tiny pairs, the real stories260k pair, n-gram drafting), the acceptance
pattern of a draft identical to the target, and the edges (EOS inside a drafted block,
max_tokens, the end of the context, penalties)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import torch

from daemon.cli import main
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.checkpoints.checkpoint import load
from speculative.drafting import ModelDrafter
from speculative.generation import Generation
from speculative.ngram import NgramDrafter
from speculative.passes import alone
from speculative.rounds import Strategy
from speculative.sampling import SamplingParams, make_generator
from speculative.strategies.autoregressive import Autoregressive
from speculative.strategies.linear import Linear

GREEDY = SamplingParams(temperature=0.0)
PENALISED = SamplingParams(
    temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3
)


def generate(
    strategy: Strategy,
    tokenizer,
    prompt_ids: Sequence[int],
    max_tokens: int,
    params: SamplingParams = GREEDY,
    capacity: int = 256,
    **options,
) -> Generation:
    session = strategy.new_session(capacity)
    return Generation(
        strategy,
        session,
        tokenizer,
        prompt_ids,
        params,
        max_tokens=max_tokens,
        ignore_eos=options.pop("ignore_eos", True),
        **options,
    ).run()


@pytest.fixture(scope="module")
def tiny_pair(tiny_checkpoint):
    target = tiny_checkpoint(num_layers=2, hidden_size=64, init_std=0.3, seed=1)
    draft = tiny_checkpoint(
        num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, seed=2
    )
    return target, draft


@pytest.fixture(scope="module")
def stories(stories_target, stories_draft):
    target, tok, _ = load(stories_target)
    draft, _, _ = load(stories_draft)
    return target, draft, tok


TINY_PROMPTS = [[1, 17, 42, 99], [1, 5], [1, 200, 201, 202, 200, 201], [7]]


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
def test_greedy_parity_on_random_tiny_pairs(tiny_pair, draft_kind):
    target_path, draft_path = tiny_pair
    draft = str(draft_path) if draft_kind == "model" else "ngram"
    rt = Runtime(
        RuntimeOptions(
            model=str(target_path), draft=draft, strategy="linear", spec_length=3, context=256
        )
    )
    reference = rt.strategy("autoregressive")
    linear = rt.strategy("linear")
    assert isinstance(linear, Linear)
    for prompt in TINY_PROMPTS:
        want = generate(reference, rt.tokenizer, prompt, 200).token_ids
        got = generate(linear, rt.tokenizer, prompt, 200)
        assert got.token_ids == want, prompt
        assert got.finish_reason == "length"
        assert got.stats.target_passes <= 201


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
def test_greedy_parity_on_the_real_pair(stories, stories_reference, draft_kind):
    target, draft, tok = stories
    drafter = ModelDrafter(draft) if draft_kind == "model" else NgramDrafter(512)
    linear = Linear(target, drafter, spec_length=4)
    reference = Autoregressive(target)
    for item in stories_reference["items"][:3]:
        prompt = item["prompt_ids"]
        want = generate(reference, tok, prompt, 200, capacity=512).token_ids
        assert want[:64] == item["new_token_ids"]
        got = generate(linear, tok, prompt, 200, capacity=512)
        assert got.token_ids == want, item["prompt"]
        stats = got.stats.to_dict()
        assert stats["drafted"] > 0 and stats["accepted"] > 0
        if draft_kind == "model":  # a distilled draft: well over one token per target pass
            assert stats["tokens_per_target_pass"] > 2.0


def test_draft_identical_to_target_accepts_everything(stories):
    target, _, tok = stories
    k = 4
    linear = Linear(target, ModelDrafter(target), spec_length=k)
    gen = generate(linear, tok, [1, 403, 407, 261, 378], 23, capacity=512)
    stats = gen.stats
    assert (
        gen.token_ids
        == generate(Autoregressive(target), tok, [1, 403, 407, 261, 378], 23).token_ids
    )
    # 23 = 5 + 5 + 5 + 5 + 3: four full rounds of K+1, then K shrinks to what is left.
    assert stats.rounds == 5
    assert stats.decode_passes == 5
    assert stats.drafted == stats.accepted == 4 * k + 2
    assert stats.draft_passes == 4 * k + 2
    assert gen.stats.to_dict()["acceptance_rate"] == 1.0


def test_draft_identical_to_target_round_by_round(stories):
    target, _, _ = stories
    k = 3
    linear = Linear(target, ModelDrafter(target), spec_length=k)
    session = linear.new_session(512)
    prompt = [1, 403, 407, 261, 378]
    session.reuse_prefix(prompt)
    steps = list(alone(linear.steps(session, prompt, GREEDY, 30, make_generator(0))))
    assert [len(r.tokens) for r in steps[:1]] == [0]  # the prompt's prefill step
    rounds = steps[1:]
    sizes = [len(r.tokens) for r in rounds]
    assert sizes[:-1] == [k + 1] * (len(sizes) - 1) and sum(sizes) == 30
    assert all(r.stats.accepted == r.stats.drafted for r in rounds)
    # Both caches hold exactly the committed sequence minus the unfed last token.
    committed = prompt + [t for r in rounds for t in r.tokens]
    assert session.target_tokens == committed[:-1]
    assert session.target_cache.length == len(committed) - 1
    assert session.draft_tokens == committed[: len(session.draft_tokens)]
    assert session.draft_cache is not None
    assert session.draft_cache.length == len(session.draft_tokens) >= len(committed) - 2


def test_draft_identical_to_target_sampling_accepts_nearly_everything(stories):
    # p and q are the same model's distributions up to float rounding, so min(1, p/q) is 1
    # up to rounding and rejections are (almost) impossible.
    target, _, tok = stories
    linear = Linear(target, ModelDrafter(target), spec_length=4)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    stats = generate(linear, tok, [1, 403, 407], 60, params, capacity=512).stats.to_dict()
    assert stats["acceptance_rate"] > 0.97


def test_eos_inside_a_drafted_block_stops_there_and_the_session_stays_usable(stories):
    target, _, tok = stories
    linear = Linear(target, ModelDrafter(target), spec_length=4)
    reference = Autoregressive(target)
    prompt = [1, 403, 407, 261, 378]
    full = generate(reference, tok, prompt, 40, capacity=512).token_ids
    # With a self-draft every round emits 5 tokens, the last of them the bonus; pick a stop
    # token that first appears in the middle of a drafted block.
    stop_at = next(
        i for i, t in enumerate(full) if i >= 5 and i % 5 in (1, 2, 3) and t not in full[:i]
    )
    session = linear.new_session(512)
    gen = Generation(
        linear, session, tok, prompt, GREEDY, max_tokens=40, stop_token_ids=[full[stop_at]]
    ).run()
    assert gen.token_ids == full[:stop_at]
    assert gen.finish_reason == "stop"
    assert gen.completion_tokens == stop_at + 1
    # The session's caches went past the stop token; a new request must still be exact.
    other = [1, 400, 300, 263]
    again = Generation(linear, session, tok, other, GREEDY, max_tokens=30, ignore_eos=True).run()
    assert again.token_ids == generate(reference, tok, other, 30, capacity=512).token_ids
    follow_up = prompt + full[:10]
    again = Generation(linear, session, tok, follow_up, GREEDY, max_tokens=12, ignore_eos=True)
    again.run()
    assert again.stats.cached_prompt_tokens > 0
    assert again.token_ids == full[10:22]


def test_max_tokens_reached_mid_round(stories):
    target, draft, tok = stories
    reference = Autoregressive(target)
    prompt = [1, 403, 407, 261, 378]
    want = generate(reference, tok, prompt, 7, capacity=512).token_ids
    for drafter in (ModelDrafter(draft), ModelDrafter(target), NgramDrafter(512)):
        gen = generate(Linear(target, drafter, spec_length=4), tok, prompt, 7, capacity=512)
        assert gen.token_ids == want
        assert gen.finish_reason == "length"
        assert gen.completion_tokens == 7


def test_stop_string_inside_a_round(stories):
    target, _, tok = stories
    prompt = tok.encode("Once upon a time")
    text = generate(Autoregressive(target), tok, prompt, 40, capacity=512).text
    stop = text[12:17]
    want = text[: text.index(stop)]
    linear = Linear(target, ModelDrafter(target), spec_length=4)
    gen = generate(linear, tok, prompt, 40, capacity=512, stop=[stop])
    assert gen.text == want and gen.finish_reason == "stop"


@pytest.mark.parametrize(("free", "drafted_per_round"), [(7, [4, 1]), (6, [4, 0]), (1, [0])])
def test_prompt_at_the_end_of_the_context_shrinks_k_then_steps_plainly(
    stories, free, drafted_per_round
):
    target, _, _ = stories
    prompt = [1, 403, 407, 261, 378]
    capacity = len(prompt) - 1 + free  # the target cache holds prompt[:-1]
    linear = Linear(target, ModelDrafter(target), spec_length=4)
    session = linear.new_session(capacity)
    session.reuse_prefix(prompt)
    rounds = list(alone(linear.steps(session, prompt, GREEDY, 100, make_generator(0))))
    assert not rounds[0].tokens and rounds[0].stats.prefill_passes == 1  # the prompt
    rounds = rounds[1:]
    assert [r.stats.drafted for r in rounds] == drafted_per_round
    tokens = [t for r in rounds for t in r.tokens]
    assert len(tokens) == free  # every slot used, nothing written past the cache
    assert session.target_cache.length == capacity
    reference = Autoregressive(target)
    ref_session = reference.new_session(capacity)
    ref_session.reuse_prefix(prompt)
    ref = alone(reference.steps(ref_session, prompt, GREEDY, 100, make_generator(0)))
    assert tokens == [t for r in ref for t in r.tokens]


def test_generation_at_the_end_of_the_context(stories):
    target, draft, tok = stories
    prompt = [1, 403, 407, 261, 378] * 3
    for drafter in (ModelDrafter(draft), NgramDrafter(512)):
        linear = Linear(target, drafter, spec_length=4)
        gen = generate(linear, tok, prompt, 100, capacity=len(prompt) + 3)
        ref = generate(Autoregressive(target), tok, prompt, 100, capacity=len(prompt) + 3)
        assert gen.token_ids == ref.token_ids and len(gen.token_ids) == 3
        assert gen.finish_reason == "length"


@pytest.mark.parametrize("draft_kind", ["model", "ngram", "self"])
def test_penalties_with_speculation(stories, draft_kind):
    target, draft, tok = stories
    drafter = {
        "model": ModelDrafter(draft),
        "ngram": NgramDrafter(512),
        "self": ModelDrafter(target),
    }[draft_kind]
    linear = Linear(target, drafter, spec_length=4)
    prompt = tok.encode("Lily and Tom")
    want = generate(Autoregressive(target), tok, prompt, 120, PENALISED, capacity=512)
    plain = generate(Autoregressive(target), tok, prompt, 120, GREEDY, capacity=512)
    assert want.token_ids != plain.token_ids  # the penalties do change the output
    got = generate(linear, tok, prompt, 120, PENALISED, capacity=512)
    assert got.token_ids == want.token_ids
    if draft_kind == "self":  # same model, same penalty counts along the chain: all accepted
        assert got.stats.accepted == got.stats.drafted


def test_spec_length_must_be_positive(stories):
    target, draft, _ = stories
    with pytest.raises(ValueError, match="--spec-length"):
        Linear(target, ModelDrafter(draft), spec_length=0)


def test_cli_samples_prints_one_json_line_per_seed(stories_target, stories_draft, capsys):
    common = [
        "generate",
        "--model",
        str(stories_target),
        "--draft",
        str(stories_draft),
        "--strategy",
        "linear",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "12",
        "--temperature",
        "1",
    ]
    assert main([*common, "--seed", "10", "--samples", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    records = [json.loads(line) for line in lines]
    for i, record in enumerate(records):
        assert set(record) == {"prompt_ids", "token_ids", "text", "finish_reason", "stats"}
        assert record["stats"]["strategy"] == "linear"
        assert main([*common, "--seed", str(10 + i), "--json"]) == 0
        single = json.loads(capsys.readouterr().out)
        assert single["token_ids"] == record["token_ids"]
    assert len({tuple(r["token_ids"]) for r in records}) > 1  # independent seeds differ
    assert main([*common, "--samples", "0"]) == 2
    assert "--samples" in capsys.readouterr().err


def test_a_token_drawn_where_the_draft_gave_it_nothing_is_rejected() -> None:
    """Each drafted token was drawn from q, so q of it is positive; one where q is 0 (a
    sampler's fault) is rejected, not let through by p/0 = inf (or 0/0 = nan, which no
    comparison fails): the position's residual is drawn instead."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])  # the second token, 1, had q = 0
    linear = Linear.__new__(Linear)  # (verify needs nothing of the models)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        accepted, token = linear.verify(p, q, [0, 1], gen)
        assert accepted == 1 and token in (1, 2)  # token 0 (p = q) stays; the residual's
    p0 = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    q0 = torch.tensor([[0.0, 1.0]])  # token 0: p = q = 0 (nan)
    assert Linear.__new__(Linear).verify(p0, q0, [0], torch.Generator())[0] == 0
