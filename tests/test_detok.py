"""Incremental detokenization never emits half a character and concatenates to exactly the
full decode; stop strings spanning tokens are held back until resolved."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeling.checkpoints.checkpoint import open_checkpoint
from modeling.text.detok import REPLACEMENT, IncrementalDetokenizer, StopMatcher, StopsOutsideCalls
from modeling.text.tokenizer import Tokenizer

TEXTS = [
    "Once upon a time, a café served crème brûlée.",
    "Emoji 😀🎉 and 你好 and naïve façade",
    " leading space and trailing ",
    "é",
]


def _tokenizer(folder: Path) -> Tokenizer:
    ckpt = open_checkpoint(folder)
    return Tokenizer.from_folder(ckpt.path, ckpt.config, ckpt.generation_defaults)


@pytest.fixture(params=["stories-byte-fallback", "tiny-byte-level-bpe"])
def tokenizer(request, stories_target, tiny_checkpoint) -> Tokenizer:  # type: ignore[no-untyped-def]
    if request.param == "stories-byte-fallback":
        return _tokenizer(stories_target)
    return _tokenizer(tiny_checkpoint("llama", vocab_size=320))


def _deltas(tok: Tokenizer, context: list[int], ids: list[int], step: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok, context)
    out = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    out.append(detok.flush())
    return out


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer: Tokenizer, text: str, step: int):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Multi-byte characters really are split over several tokens here.
    pieces = [tokenizer.decode([i]) for i in ids]
    if "😀" in text:
        assert any(REPLACEMENT in p for p in pieces)
    deltas = _deltas(tokenizer, [], ids, step)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any(REPLACEMENT in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_after_a_prompt(tokenizer: Tokenizer, text: str) -> None:
    """With a prompt as context, the first token's leading space is kept (a decoder that
    sees a token first would strip it)."""
    prompt = tokenizer.encode("The story begins.")
    ids = tokenizer.encode(" " + text, add_special_tokens=False)
    deltas = _deltas(tokenizer, prompt, ids)
    full, before = tokenizer.decode(prompt + ids), tokenizer.decode(prompt)
    assert "".join(deltas) == full[len(before) :]
    assert not any(REPLACEMENT in d for d in deltas)


def test_incomplete_character_at_the_end_is_flushed_as_replacement(stories_target) -> None:
    tok = _tokenizer(stories_target)
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 2  # byte fallback: one token per byte (after the space piece)
    detok = IncrementalDetokenizer(tok)
    held = "".join(detok.push([i]) for i in ids[:-1])
    assert REPLACEMENT not in held
    assert held + detok.flush() == tok.decode(ids[:-1])


def _run(stops: list[str], pieces: list[str]) -> tuple[list[str], str, bool]:
    matcher = StopMatcher(stops)
    out = [matcher.push(p) for p in pieces]
    return out, matcher.flush(), matcher.stopped


def test_stop_string_across_pieces_is_held_back() -> None:
    out, tail, stopped = _run(["THE END"], ["and so", " TH", "E E", "ND more"])
    assert out == ["and so", " ", "", ""]
    assert stopped and tail == ""


def test_held_text_is_released_when_it_cannot_be_a_stop() -> None:
    out, tail, stopped = _run(["THE END"], ["a TH", "E", " BEGINNING"])
    assert out == ["a ", "", "THE BEGINNING"]
    assert not stopped and tail == ""


def test_partial_stop_at_the_end_is_flushed() -> None:
    out, tail, stopped = _run(["</answer>"], ["x </ans"])
    assert out == ["x "] and tail == "</ans" and not stopped


def test_earliest_of_several_stops_wins() -> None:
    out, _, stopped = _run(["world", "lo"], ["hel", "lo world"])
    assert "".join(out) == "hel" and stopped


def test_nothing_after_a_stop() -> None:
    matcher = StopMatcher(["."])
    assert matcher.push("One. Two.") == "One"
    assert matcher.push("more") == "" and matcher.flush() == ""


def test_no_stops_passes_everything() -> None:
    out, tail, stopped = _run([], ["a", "b"])
    assert out == ["a", "b"] and tail == "" and not stopped


def _reference(stops: list[str], pieces: list[str]) -> tuple[list[str], str, bool]:
    """Stop strings by brute force: the earliest start of any stop in all the text, and
    the longest tail that is a proper prefix of a stop held back."""
    text, shown, out = "", 0, []
    for piece in pieces:
        text += piece
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            out.append(text[shown : min(hits)])
            return out + [""] * (len(pieces) - len(out)), "", True
        hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        out.append(text[shown : len(text) - hold])
        shown = len(text) - hold
    return out, text[shown:], False


def test_stop_matching_equals_brute_force_on_random_text() -> None:
    """Stops that overlap themselves and each other ('abab', 'aab', 'b'), over pieces of
    random lengths: the same text shown, held and cut as the brute force gives."""
    import random

    rng = random.Random(7)
    for _ in range(3000):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        pieces = [
            "".join(rng.choices("abc", k=rng.randint(0, 4))) for _ in range(rng.randint(1, 6))
        ]
        assert _run(stops, pieces) == _reference(stops, pieces), (stops, pieces)


@pytest.mark.parametrize("step", [1, 3, 7, 20])
def test_real_text_is_shown_as_soon_as_it_is_whole(tokenizer: Tokenizer, step: int) -> None:
    """Emoji and CJK spelled byte by byte: after each step (one token, or as many as a
    tree's round accepts), all that decodes whole so far has been shown: a stop string in
    it is found at the same token as in the full text."""
    ids = tokenizer.encode("Emoji 😀🎉 and 你好 and naïve façade " * 3, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    shown = ""
    for end in range(step, len(ids) + step, step):
        shown += detok.push(ids[end - step : end])
        so_far = tokenizer.decode(ids[:end])
        if not so_far.endswith(REPLACEMENT):
            assert shown == so_far


def test_a_real_replacement_character_is_shown_at_once(tokenizer: Tokenizer) -> None:
    """A U+FFFD that is text (its bytes EF BF BD) is shown as it comes: no later byte can
    change it (an attacker's schema const of 300 streamed nothing until the end, and a
    stop string after them was found 300 tokens late)."""
    assert tokenizer.byte_tokens is not None
    ids = tokenizer.encode("ab\ufffdc\ufffd", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    shown = [detok.push([i]) for i in ids]
    assert "".join(shown) == "ab\ufffdc\ufffd"  # all of it before any flush
    assert detok.flush() == ""


@pytest.mark.parametrize("byte", [0x80, 0xE2, 0xF0])  # a stray tail byte; leads, forever
def test_bytes_no_character_completes_are_shown_as_they_come(tokenizer: Tokenizer, byte) -> None:
    """A run of one byte token (a logit_bias can force it): shown as it comes, never
    more than one token held, so each step decodes a short window (the held window grew
    by a token a step and was decoded again each time: 8,000 tokens took 8 s); the text is
    the full decode's."""
    assert tokenizer.byte_tokens is not None
    token = tokenizer.byte_tokens.get(byte) or tokenizer.backend.token_to_id(f"<0x{byte:02X}>")
    if token is None:  # (the probes' bytes are always there; F0 in byte-level vocabularies)
        from modeling.text.byte_level import BYTE_LEVEL

        token = tokenizer.backend.token_to_id(BYTE_LEVEL[byte])
    ids = [token] * 200
    detok = IncrementalDetokenizer(tokenizer)
    shown = ""
    for i, t in enumerate(ids, 1):
        shown += detok.push([t])
        assert detok.read >= i - 1 and len(shown) >= i - 1
    shown += detok.flush()
    assert shown == tokenizer.decode(ids)


LEAD = '<tool_call>\n{"name":'  # the Hermes format's


def _through(stops: StopsOutsideCalls, pieces: list[str]) -> str:
    out = ""
    for piece in pieces:
        out += stops.push(piece)
        if stops.stopped:
            return out
    return out + stops.flush()


def test_stop_strings_never_cut_a_tool_call_but_cut_a_text_answer() -> None:
    """An answer that begins as a call (its lead) is generated under the grammar: no stop
    string cuts it (a stop of "}" cut the arguments, "\n" the whole call). A text answer
    is cut as ever, also one that began like a call's lead."""
    call = ["<tool_", "call>\n", '{"name":"f",', '"arguments":{"a":"}"}}', "\n</tool_call>"]
    for stops in (["}"], ["\n"], ['"'], ["call"]):
        assert _through(StopsOutsideCalls(stops, LEAD), call) == "".join(call)
    assert _through(StopsOutsideCalls(["}"], LEAD), ["It is ", "{warm}", " today"]) == "It is {warm"
    # a prefix of the lead, then text: held while it could be a call, then cut as text
    assert _through(StopsOutsideCalls(["call"], LEAD), ["<tool_", "calls are"]) == "<tool_"
    assert _through(StopsOutsideCalls(["x"], LEAD), ["<tool"]) == "<tool"  # ended undecided
    assert _through(StopsOutsideCalls([], LEAD), ["plain"]) == "plain"
