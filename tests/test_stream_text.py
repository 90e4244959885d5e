"""Streamed text is the whole text: the detokenizer's deltas join to the whole decode (or,
where byte fallback reads a run of bytes all or nothing, show each byte once, as its
character or as one U+FFFD), stop strings cut the text and the log-probabilities in the
same place whatever the split, think blocks, calls and harmony turns read alike streamed
and whole, and the daemon's stream carries what its whole body does (text, reasoning,
calls, log-probabilities and their text offsets). Real tokenizers: stories260k
(SentencePiece with byte fallback; its tokenizer.json and its GGUF), SmolLM2's GGUF
(byte-level BPE), the tiny byte-level BPE of scripts/tiny_models.py. A few seconds in all.
"""

from __future__ import annotations

import codecs
import random
import types
from functools import partial
from pathlib import Path

import pytest

from daemon.http.openai_responses import ResponseShape
from modeling.checkpoints.checkpoint import open_checkpoint
from modeling.checkpoints.gguf_file import read_gguf
from modeling.text.detok import IncrementalDetokenizer, StopMatcher, StopsOutsideCalls
from modeling.text.gguf_tokenizer import tokenizer_from_gguf
from modeling.text.thinking import Thinking, ThinkingStops
from modeling.text.tokenizer import Tokenizer
from speculative.generation import Chunk, Generation
from speculative.harmony import HarmonyReader
from speculative.rounds import Round, RoundStats
from speculative.sampling import SamplingParams, TokenLogprob
from speculative.thinking import ThinkReader
from speculative.tool_calls import HERMES, LLAMA3, MISTRAL, CallStream
from tests.served_choice import serve_choice

SEEDS = range(3)
TEXTS = ["ab", " é", "€", "😀", "你好", "\n", " cd", "x", " ", "\ufffd", " \ufffd😀"]


@pytest.fixture(scope="module", params=["stories", "stories-gguf", "smollm2-gguf", "tiny-bpe"])
def tok(request, shared_models: Path) -> Tokenizer:  # type: ignore[no-untyped-def]
    return _tokenizer(request.param, shared_models)


@pytest.fixture(scope="module", params=["smollm2-gguf", "tiny-bpe"])
def byte_level(request, shared_models: Path) -> Tokenizer:  # type: ignore[no-untyped-def]
    """The byte-level BPE tokenizers among `tok`'s."""
    return _tokenizer(request.param, shared_models)


def _tokenizer(name: str, shared_models: Path) -> Tokenizer:
    if name == "stories":
        ckpt = open_checkpoint(shared_models / "stories260k")
        return Tokenizer.from_folder(ckpt.path, ckpt.config, ckpt.generation_defaults)
    if name == "tiny-bpe":
        from scripts.tiny_models import build_tokenizer

        return Tokenizer(build_tokenizer(320), bos_token="<s>", eos_token="</s>", eos_token_ids=[2])
    path = (
        shared_models / "gguf" / "stories260k-F32.gguf"
        if name == "stories-gguf"
        else shared_models / "smollm2-135m-instruct" / "smollm2-135m-instruct-q4_1.gguf"
    )
    return tokenizer_from_gguf(read_gguf(path).metadata, path.name)


def _steps(rng: random.Random, n: int) -> list[int]:
    out = []
    while n:
        out.append(min(n, rng.choice([1, 1, 2, 3, 5])))
        n -= out[-1]
    return out


def _streamed(tok: Tokenizer, context: list[int], ids: list[int], steps: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, context)
    out, at = [], 0
    for step in steps:
        out.append(detok.push(ids[at : at + step]))
        at += step
    return [*out, detok.flush()]


@pytest.mark.parametrize("seed", SEEDS)
def test_utf8_answers_stream_as_the_whole_decode(tok: Tokenizer, seed: int) -> None:
    """Text of characters split over tokens (emoji, CJK, é, a real U+FFFD), special tokens
    (skipped) anywhere in it, after contexts of several kinds, pushed a token or several at
    a time: the deltas join to exactly the whole decode, and none shows a U+FFFD the
    whole decode has not."""
    rng = random.Random(seed)
    specials = sorted({i for i in (tok.bos_id, *tok.eos_token_ids) if i is not None})
    for _ in range(300):
        ids = tok.encode("".join(rng.choices(TEXTS, k=rng.randint(1, 8))), add_special_tokens=False)
        for _ in range(rng.randint(0, 2)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        context = tok.encode(
            rng.choice(["Hi", "é", "😀", " ", ""]), add_special_tokens=rng.random() < 0.5
        )
        deltas = _streamed(tok, context, ids, _steps(rng, len(ids)))
        whole = tok.decode(context + ids)[len(tok.decode(context)) :]
        assert "".join(deltas) == whole, (context, ids)
        if "\ufffd" not in whole:
            assert not any("\ufffd" in d for d in deltas), (context, ids)


@pytest.mark.parametrize("seed", SEEDS)
def test_byte_level_streams_any_bytes_as_the_whole_decode(byte_level: Tokenizer, seed: int) -> None:
    """Byte-level BPE (from_utf8_lossy over the whole text): random ids of the whole
    vocabulary, tokens that are parts of characters most of all, stray bytes included:
    the deltas join to the whole decode whatever the bytes."""
    tok = byte_level
    assert tok.byte_tokens is not None and not tok.fallback_bytes
    rng = random.Random(seed)
    partial = []
    for i in range(tok.vocab_size):
        raw = tok.raw_bytes(i)
        if raw is not None:
            try:
                raw.decode()
            except UnicodeDecodeError:
                partial.append(i)
    for _ in range(400):
        n = rng.randint(1, 10)
        ids = [
            rng.choice(partial) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
            for _ in range(n)
        ]
        context = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        deltas = _streamed(tok, context, ids, _steps(rng, len(ids)))
        assert "".join(deltas) == tok.decode(context + ids)[len(tok.decode(context)) :], (
            context,
            ids,
        )


class _Session:
    capacity = 4096

    def reuse_prefix(self, ids: list[int]) -> int:
        return 0


class _Scripted:
    name = "scripted"
    target = types.SimpleNamespace(device="cpu")

    def __init__(self, rounds: list[list[int]]) -> None:
        self.rounds = rounds

    def steps(self, session, prompt, params, max_new, generator, constraint=None):  # type: ignore[no-untyped-def]
        for tokens in self.rounds:
            yield Round(
                list(tokens), RoundStats(), None, [TokenLogprob(t, -1.0, []) for t in tokens]
            )


@pytest.mark.parametrize("seed", SEEDS)
def test_generation_text_and_logprobs_at_stop_strings(tok: Tokenizer, seed: int) -> None:
    """A Generation over rounds of one to four tokens, a stop string taken from the text
    (across tokens, across a character's bytes), max_tokens at a character's end: the text
    is the whole decode cut at the stop's first occurrence, the chunks join to it, and the
    log-probabilities are those of exactly the tokens whose text begins before the cut."""
    rng = random.Random(seed)
    prompt = tok.encode("Hello", add_special_tokens=True)
    for _ in range(150):
        ids = tok.encode(
            "".join(rng.choices(TEXTS[:-2], k=rng.randint(1, 8))), add_special_tokens=False
        )
        full = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
        stop = []
        if rng.random() < 0.7 and full:
            at = rng.randrange(len(full))
            stop = [full[at : at + rng.randint(1, 3)]]
        rounds, at = [], 0
        while at < len(ids):
            k = rng.choice([1, 1, 2, 4])
            rounds.append(ids[at : at + k])
            at += k
        params = SamplingParams(temperature=0.0, logprobs=0)
        gen = Generation(_Scripted(rounds), _Session(), tok, prompt, params, len(ids), stop=stop)
        chunks = list(gen)
        cut = full.find(stop[0]) if stop else -1
        expected = full[:cut] if cut >= 0 else full
        assert gen.text == expected and "".join(c.text for c in chunks) == expected
        decoder, starts, n = codecs.getincrementaldecoder("utf-8")(), [], 0
        for t in gen.token_ids:
            starts.append(n)
            n += len(decoder.decode(tok.raw_bytes(t) or b""))
        if len(full) != n:
            continue  # (a piece whose bytes are not its text: no reference here)
        if any(_mixed(tok.raw_bytes(t)) for t in gen.token_ids):
            continue  # (a token of whole characters and part of one: a bug, see the bug tests)
        given = [
            t for t, s in zip(gen.token_ids, starts, strict=True) if cut < 0 or s < len(expected)
        ]
        assert [lp.token for c in chunks for lp in c.logprobs] == given


def _mixed(raw: bytes | None) -> bool:
    """Whether a token's bytes are whole characters and then part of one (" \\xf0\\x9f\\x98")."""
    if raw is None:
        return False
    try:
        raw.decode()
    except UnicodeDecodeError:
        return raw.decode("utf-8", "ignore") != ""
    return False


def _pieces(text: str, rng: random.Random) -> list[str]:
    out, at = [], 0
    while at < len(text):
        k = rng.choice([1, 1, 2, 3, 5, 8, 40])
        out.append(text[at : at + k])
        at += k
    return out


def test_readers_read_a_turn_alike_however_it_is_split() -> None:
    """ThinkReader, CallStream (grammatical calls, cut anywhere), HarmonyReader (headers
    under MAX_HEADER) and ThinkingStops: the events (and the text the stops leave) are
    the same for the whole text and for it in random pieces."""
    rng = random.Random(1)

    def merged(events: list) -> list:
        out: list = []
        for e in events:
            e = tuple(x for j, x in enumerate(e) if not (e[0] == "call" and j == 2))  # (ids)
            if out and out[-1][0] == e[0] and e[0] in ("content", "reasoning"):
                out[-1] = (e[0], out[-1][1] + e[1])
            elif out and e[0] == "arguments" and out[-1][0] == "arguments" and out[-1][1] == e[1]:
                out[-1] = ("arguments", e[1], out[-1][2] + e[2])
            else:
                out.append(e)
        return out

    def alike(make, text: str) -> None:  # type: ignore[no-untyped-def]
        reader = make()
        whole = merged(reader.feed(text) + reader.finish())
        for _ in range(5):
            reader, events = make(), []
            for piece in _pieces(text, rng):
                events += reader.feed(piece)
            assert merged(events + reader.finish()) == whole, text

    think = ["<think>", "</think>", "\n", "\n\n", " ", "a", "<", "</", "think", ">", "</thi", "nk>"]
    harmony = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
               "<|constrain|>", "analysis", "final", "commentary to=functions.f ", "json", "hi",
               "\n", "<|", "|>", "x"]  # fmt: skip
    for _ in range(600):
        thinking = Thinking(started=rng.random() < 0.5)
        alike(partial(ThinkReader, thinking), "".join(rng.choices(think, k=rng.randint(1, 14))))
        allow = rng.random() < 0.5
        alike(partial(HarmonyReader, allow), "".join(rng.choices(harmony, k=rng.randint(1, 14))))
        fmt, only = rng.choice([HERMES, LLAMA3, MISTRAL]), rng.random() < 0.3
        args = rng.choice(['{"a":1}', '{"s":"}\\\\"{"}', '{"l":[1,{"b":"]"}]}', "{}"])
        call = f'{fmt.open}{{"name":"f","{fmt.arguments}":{args}}}{fmt.close}'
        text = fmt.begin + fmt.separator.join([call] * rng.randint(1, 2)) + fmt.end
        text = text[: rng.randint(1, len(text))] if rng.random() < 0.5 else text
        if rng.random() < 0.3:
            text = rng.choice(["plain", " <tool", "[x", '{"nam'])
        alike(partial(CallStream, fmt, only), text)
        # ThinkingStops: the text a turn's stop strings leave
        text = "".join(rng.choices([*think, "ab", "x"], k=rng.randint(1, 12)))
        stops = ["".join(rng.choices(["a", "b", "\n", "x", "<"], k=rng.randint(1, 3)))]
        lead = '<tool_call>\n{"name":' if rng.random() < 0.3 else None

        def through(
            pieces: list[str],
            stops: list[str] = stops,
            lead: str | None = lead,
            thinking: Thinking = thinking,
        ) -> tuple[str, bool]:
            inner = StopMatcher(stops) if lead is None else StopsOutsideCalls(stops, lead)
            s, out = ThinkingStops(inner, thinking), ""
            for p in pieces:
                out += s.push(p)
                if s.stopped:
                    return out, True
            return out + s.flush(), s.stopped

        assert through(_pieces(text, rng)) == through([text]), (text, stops)


def _serve(chunks: list[Chunk], thinking: Thinking | None, calls, harmony: bool, together=False):  # type: ignore[no-untyped-def]
    """The chunks through `_collect_choice` and `_stream_choice` (tests/served_choice.py)."""
    shape = ResponseShape(chat=True, model="m", piece=lambda token, before: f"t{token}")
    return serve_choice(
        chunks, shape, calls=calls, harmony=harmony, thinking=thinking, together=together
    )


def test_daemon_streams_a_thinking_turn_as_it_collects_it() -> None:
    """The daemon's own `_stream_choice` and `_collect_choice` on the same chunks (a think
    block, then text or a Hermes call; split at random): the streamed content, reasoning
    and calls add up to the whole body's."""
    rng = random.Random(2)
    call = '<tool_call>\n{"name":"f","arguments":{"a":"}"}}\n</tool_call>'
    for _ in range(60):
        thinking = Thinking(started=rng.random() < 0.5)
        head = "" if thinking.started else rng.choice(["", "\n", "<think>"])
        answer = rng.choice(["Hello.\n\nBye", call, "", "<tool"])
        text = head + "\nI think.\n\n</think>\n\n" + answer
        chunks = [Chunk(p, [0]) for p in _pieces(text, rng)]
        whole, events = _serve(chunks, thinking, HERMES, False)
        message = whole["choices"][0]["message"]
        deltas = [c["delta"] for e in events for c in e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message.get(
            "reasoning_content", ""
        )
        args = "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", []))
        assert args == "".join(t["function"]["arguments"] for t in message.get("tool_calls") or [])


def test_a_call_after_a_think_block_streams_after_its_reasoning_with_its_logprobs() -> None:
    """A think block and a Hermes call in one batch (several tokens accepted at once, or a
    slow client): the reasoning is sent before the call's deltas (the call came first),
    and the block's tokens (the newlines after it too) keep their log-probabilities while
    the call's are left out, streamed and whole alike (every one was dropped)."""
    call = '<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>'
    pieces = ["<think>", "\nI think.", "\n</think>", "\n\n", call]
    chunks, at = [], 0
    for token, piece in enumerate(pieces):
        chunks.append(Chunk(piece, [token], logprobs=[TokenLogprob(token, -1.0, [], start=at)]))
        at += len(piece)
    whole, events = _serve(chunks, Thinking(), HERMES, False, together=True)
    choice = whole["choices"][0]
    assert choice["message"]["reasoning_content"] == "I think."
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["t0", "t1", "t2", "t3"]
    deltas = [c for e in events for c in e["choices"]]
    kinds = [k for d in deltas for k in ("reasoning_content", "tool_calls") if d["delta"].get(k)]
    assert kinds == ["reasoning_content", "tool_calls"], kinds
    streamed = [e["token"] for d in deltas for e in (d.get("logprobs") or {}).get("content", [])]
    assert streamed == ["t0", "t1", "t2", "t3"]
