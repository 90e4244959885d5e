"""Generation's stopping rules over the autoregressive strategy, on the real stories
checkpoint (its greedy output is known from reference.json), and session reuse."""

from __future__ import annotations

import json
import shutil

import pytest

from modeling.checkpoints.checkpoint import load
from speculative.generation import ContextFullError, Generation
from speculative.sampling import SamplingParams
from speculative.strategies.autoregressive import Autoregressive

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def stories(stories_target):  # type: ignore[no-untyped-def]
    model, tok, _ = load(stories_target)
    return Autoregressive(model), tok


@pytest.fixture(scope="module")
def reference(stories_reference) -> dict:  # type: ignore[no-untyped-def]
    return next(i for i in stories_reference["items"] if i["prompt"] == "Once upon a time")


def _generate(stories, prompt_ids, session=None, **kwargs) -> Generation:  # type: ignore[no-untyped-def]
    strategy, tok = stories
    session = session or strategy.new_session(kwargs.pop("capacity", 256))
    kwargs.setdefault("max_tokens", 64)
    return Generation(strategy, session, tok, prompt_ids, kwargs.pop("params", GREEDY), **kwargs)


def test_chunks_add_up_to_the_result(stories, reference) -> None:
    gen = _generate(stories, reference["prompt_ids"], max_tokens=20)
    chunks = list(gen)
    assert [t for c in chunks for t in c.token_ids] == gen.token_ids
    assert "".join(c.text for c in chunks) == gen.text
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert gen.token_ids == reference["new_token_ids"][:20]
    _, tok = stories
    assert (
        gen.text == tok.decode(reference["prompt_ids"] + gen.token_ids)[len("Once upon a time") :]
    )


def test_max_tokens(stories, reference) -> None:
    gen = _generate(stories, reference["prompt_ids"], max_tokens=7).run()
    assert len(gen.token_ids) == 7 and gen.finish_reason == "length"
    assert gen.stats.generated_tokens == 7
    assert gen.stats.decode_passes == 7


def test_stop_token_ids(stories, reference) -> None:
    new = reference["new_token_ids"]
    stop_at = 5
    stopper = new[stop_at]
    assert stopper not in new[:stop_at]
    gen = _generate(stories, reference["prompt_ids"], stop_token_ids=[stopper]).run()
    assert gen.token_ids == new[:stop_at]
    assert gen.finish_reason == "stop" and gen.stopped_by_token
    assert gen.completion_tokens == stop_at + 1  # the stop token counts, is not shown


def test_eos_from_the_generation_config_unless_ignored(stories_target, tmp_path, reference) -> None:
    """Without explicit stop ids, any of the tokenizer's EOS ids (generation_config.json may
    list several) ends the generation; --ignore-eos turns that off."""
    folder = tmp_path / "stories"
    shutil.copytree(stories_target, folder)
    stopper = reference["new_token_ids"][4]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stopper]}))
    model, tok, _ = load(folder)
    pair = (Autoregressive(model), tok)
    gen = _generate(pair, reference["prompt_ids"], max_tokens=12).run()
    assert gen.token_ids == reference["new_token_ids"][:4]
    assert gen.finish_reason == "stop"
    ignoring = _generate(pair, reference["prompt_ids"], max_tokens=12, ignore_eos=True).run()
    assert ignoring.token_ids == reference["new_token_ids"][:12]


def test_stop_string_spanning_tokens(stories, reference) -> None:
    _, tok = stories
    plain = _generate(stories, reference["prompt_ids"]).run()
    stop = "girl named"
    # The stop string really spans several tokens.
    pieces = [tok.decode([t]) for t in plain.token_ids]
    assert not any(stop in p for p in pieces)
    gen = _generate(stories, reference["prompt_ids"], stop=[stop]).run()
    assert gen.finish_reason == "stop"
    assert gen.text == plain.text[: plain.text.index(stop)]
    assert stop not in gen.text
    # Generation stops at the token that completed the stop string.
    consumed = tok.decode(reference["prompt_ids"] + gen.token_ids)
    assert consumed.endswith("named") or stop in consumed


def test_prompt_over_the_context(stories) -> None:
    with pytest.raises(ContextFullError, match="the context holds 8"):
        _generate(stories, list(range(3, 11)), capacity=8)
    with pytest.raises(ContextFullError, match="empty"):
        _generate(stories, [])


def test_context_limits_max_tokens(stories, reference) -> None:
    prompt = reference["prompt_ids"]
    gen = _generate(stories, prompt, capacity=len(prompt) + 3, max_tokens=50).run()
    assert gen.token_ids == reference["new_token_ids"][:3]
    assert gen.finish_reason == "length"


def test_session_reuse_prefills_only_new_tokens(stories, reference) -> None:
    strategy, tok = stories
    session = strategy.new_session(256)
    first = _generate(stories, reference["prompt_ids"], session=session, max_tokens=12).run()
    assert first.stats.cached_prompt_tokens == 0
    follow_up = tok.encode(" Then they went home.", add_special_tokens=False)
    prompt2 = reference["prompt_ids"] + first.token_ids + follow_up
    second = _generate(stories, prompt2, session=session, max_tokens=16).run()
    # Everything fed before is reused: prompt + output, except the last output token,
    # which was sampled but never fed (it was the next round's root).
    reused = len(reference["prompt_ids"]) + len(first.token_ids) - 1
    assert second.stats.cached_prompt_tokens == reused
    assert second.stats.prefill_passes == 1
    assert session.target_tokens[:reused] == prompt2[:reused]
    fresh = _generate(stories, prompt2, max_tokens=16).run()
    assert fresh.stats.cached_prompt_tokens == 0
    assert second.token_ids == fresh.token_ids
    # A diverging prompt rolls back to the common prefix.
    third = _generate(stories, [*reference["prompt_ids"][:3], 300, 301], session=session).run()
    assert third.stats.cached_prompt_tokens == 3
    again = _generate(stories, [*reference["prompt_ids"][:3], 300, 301]).run()
    assert third.token_ids == again.token_ids


def test_seeded_sampling_is_reproducible(stories, reference) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    a = _generate(stories, reference["prompt_ids"], params=params, max_tokens=24).run()
    b = _generate(stories, reference["prompt_ids"], params=params, max_tokens=24).run()
    c = _generate(
        stories,
        reference["prompt_ids"],
        params=SamplingParams(temperature=1.0, top_p=0.9, seed=12),
        max_tokens=24,
    ).run()
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_stats_record(stories, reference) -> None:
    gen = _generate(stories, reference["prompt_ids"], max_tokens=10).run()
    record = gen.stats.to_dict()
    assert record["strategy"] == "autoregressive"
    assert record["prompt_tokens"] == len(reference["prompt_ids"])
    assert record["generated_tokens"] == 10
    assert record["target_passes"] == 10 + record["prefill_passes"]
    assert record["tokens_per_target_pass"] == 1.0
    assert record["acceptance_rate"] is None
    assert record["tokens_per_second"] > 0


def test_a_trace_has_only_rounds_that_verified_a_draft(stories, reference) -> None:
    """An n-gram tree round where the lookup found nothing verifies the root alone: it
    sends no trace (it sent `"nodes": 0`), while rounds that drafted still do."""
    from speculative.strategies.tree import TreeSpeculation

    target, tok = stories[0].target, stories[1]
    strategy = TreeSpeculation(target, None, budget=8)
    session = strategy.new_session(256)
    gen = Generation(strategy, session, tok, reference["prompt_ids"], GREEDY, max_tokens=48,
                     trace=True)  # fmt: skip
    chunks = list(gen)
    traced = [t for c in chunks for t in c.trace]
    assert gen.token_ids == reference["new_token_ids"][:48]
    assert traced and all(t["nodes"] > 0 for t in traced)
    assert len(traced) < gen.stats.target_passes  # (rounds with nothing to look up sent none)
