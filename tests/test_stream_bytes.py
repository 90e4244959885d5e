"""Streamed text where bytes and text part ways (each case a bug a reviewer found): byte
fallback's runs decoded all or nothing (a character after a stray byte was lost, one
leftover byte read as three U+FFFD), a harmony header longer than its bound, a token
inside a stop string given a log-probability, and completions' `text_offset` counted
from the tokens' pieces instead of the text. Tokenizers only, but for one daemon run on
stories260k (a few seconds)."""

from __future__ import annotations

import json
import random
import types
from pathlib import Path

import pytest

from daemon.http.openai_responses import ResponseShape
from modeling.checkpoints.checkpoint import open_checkpoint
from modeling.text.detok import IncrementalDetokenizer
from modeling.text.tokenizer import Tokenizer
from speculative.generation import Chunk, Generation
from speculative.harmony import HarmonyReader, read_turn
from speculative.rounds import Round, RoundStats
from speculative.sampling import SamplingParams, TokenLogprob
from tests.served_choice import serve_choice

R = "\ufffd"


@pytest.fixture(scope="module")
def spm(stories_target: Path) -> Tokenizer:
    """stories260k's tokenizer: SentencePiece BPE with byte fallback (<0xNN> pieces), as
    Llama 2, Mistral and Gemma shape theirs."""
    ckpt = open_checkpoint(stories_target)
    return Tokenizer.from_folder(ckpt.path, ckpt.config, ckpt.generation_defaults)


def _bytes(tok: Tokenizer, *values: int) -> list[int]:
    return [tok.backend.token_to_id(f"<0x{v:02X}>") for v in values]


def _streamed(tok: Tokenizer, ids: list[int], steps: list[int] | None = None) -> str:
    detok = IncrementalDetokenizer(tok)
    out, at = [], 0
    for step in steps or [1] * len(ids):
        out.append(detok.push(ids[at : at + step]))
        at += step
    return "".join(out) + detok.flush()


def _weight(text: str) -> int:
    """The bytes a text accounts for: a character its UTF-8, a U+FFFD one byte (a whole
    decode's byte fallback gives one U+FFFD per byte of a run that is not UTF-8)."""
    return sum(1 if c == R else len(c.encode()) for c in text)


# --- byte fallback: bytes already shown are never decoded with new ones -------------


def test_a_character_after_a_stray_byte_is_not_lost(spm: Tokenizer) -> None:
    """<0x80> (a stray continuation byte), then é in two byte tokens. The whole decode is
    three U+FFFD (byte fallback reads the whole run as U+FFFD); streamed, U+FFFD then é.
    It was two U+FFFD: é was lost (its lead byte was probed after the stray byte, which
    keeps the run invalid whatever follows, and taken for a final U+FFFD)."""
    ids = _bytes(spm, 0x80, 0xC3, 0xA9)
    assert spm.decode(ids) == R * 3
    assert _streamed(spm, ids) == R + "é"


def test_an_emoji_after_a_stray_byte_is_not_lost(spm: Tokenizer) -> None:
    ids = _bytes(spm, 0x80, 0xF0, 0x9F, 0x98, 0x80)  # stray byte, then 😀 (was R * 2)
    assert _streamed(spm, ids) == R + "😀"


def test_a_cut_character_after_a_byte_spelled_one_reads_as_its_own_bytes(spm: Tokenizer):
    """你 in three byte tokens, then the first byte of another character, where max_tokens
    (or EOS) cut it: 你 and one U+FFFD (the whole decode: 4 x U+FFFD). It was 你 and THREE
    U+FFFD for one byte: the window's decode, 4 x U+FFFD, cut at len("你")."""
    ids = _bytes(spm, 0xE4, 0xBD, 0xA0, 0xE5)
    assert spm.decode(ids) == R * 4
    assert _streamed(spm, ids) == "你" + R


def test_every_byte_is_accounted_for_once(spm: Tokenizer) -> None:
    """Property: over runs of byte tokens (characters, characters cut short, stray bytes,
    words between them), the streamed text accounts for each byte once: as the character
    it is part of, or one U+FFFD; as the whole decode does (`_weight`). About 20% of the
    runs broke it before (lost characters, or more U+FFFD than bytes)."""
    rng = random.Random(1)
    words = spm.encode(" a b", add_special_tokens=False)
    bad = []
    for _ in range(300):
        ids: list[int] = []
        for _ in range(rng.randint(1, 5)):
            r = rng.random()
            char = rng.choice(["é", "€", "😀", "你", "a"]).encode()
            if r < 0.5:
                ids += _bytes(spm, *char)
            elif r < 0.7:
                ids += _bytes(spm, *char[:-1] or char)
            elif r < 0.85:
                ids += _bytes(spm, rng.choice([0x80, 0xBF, 0xC3, 0xE2, 0xF0]))
            else:
                ids += words
        steps, n = [], len(ids)
        while n:
            steps.append(min(n, rng.choice([1, 1, 2, 3])))
            n -= steps[-1]
        got = _streamed(spm, ids, steps)
        if _weight(got) != _weight(spm.decode(ids)):
            bad.append((ids, steps, got, spm.decode(ids)))
    assert not bad, f"{len(bad)} of 300, e.g. {bad[0]}"


def test_daemon_text_cut_inside_an_emoji(stories_target: Path) -> None:
    """End to end: a const forces `"你😀` and max_tokens cuts the emoji after two of its
    four byte tokens. The whole decode of the ids is `"` and five U+FFFD; the answer is
    `"你` and the two bytes' U+FFFD (it was FOUR U+FFFD for two bytes)."""
    import http.client

    from daemon.http.server import BackgroundServer
    from daemon.settings_loading import load_settings

    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "t"),
            "runtime.compile": ("off", "t"),
            "server.port": (0, "t"),
        },
    )
    body = {
        "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"const": "你😀😀"}}},
    }  # fmt: skip
    with BackgroundServer(settings) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=60)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        answer = json.loads(conn.getresponse().read())
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    ckpt = open_checkpoint(stories_target)
    tok = Tokenizer.from_folder(ckpt.path, ckpt.config, ckpt.generation_defaults)
    ids = [tok.backend.token_to_id('"'), *_bytes(tok, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F)]
    prompt = tok.encode("Once upon a time")
    whole = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert whole == '"' + R * 5
    assert choice["text"] == '"你' + R * 2


# --- harmony: a long header reads alike whole and streamed ---------------------------


def test_a_long_harmony_header_reads_alike_whole_and_streamed() -> None:
    """A header is at most MAX_HEADER (512) characters however the text arrives: a header
    of 600 is plain text whole and streamed. It was a message (answer "hi") read whole,
    where `<|message|>` was looked for anywhere, and plain text streamed in pieces, where
    the buffer passed the bound first: by how the engine's rounds happened to batch."""
    text = "<|channel|>" + "y" * 600 + "<|message|>hi<|end|>"
    answer, _, _ = read_turn(text)
    reader = HarmonyReader()
    events = []
    for i in range(0, len(text), 10):
        events += reader.feed(text[i : i + 10])
    events += reader.finish()
    streamed = "".join(e[1] for e in events if e[0] == "content")
    assert streamed == answer == "y" * 600 + "hi"  # (plain text: the markers left out)


# --- log-probabilities at a stop string: none for a token inside it ------------------


def test_no_logprob_for_a_token_inside_the_stop_string(shared_models: Path) -> None:
    """SmolLM2 (byte-level BPE) spells " 😀" as 'ĠðŁĺ' (a space and three of the emoji's
    bytes) then 'Ģ' (its last byte). With stop "😀" the text is "x " and the
    log-probabilities should be those of 'x' and 'ĠðŁĺ' (its text " " begins before the
    cut), never of 'Ģ', whose bytes lie wholly inside the stop string. 'Ģ' was given: its
    start was the characters shown so far, and the space 'ĠðŁĺ' holds back with its
    partial character was not shown yet (`IncrementalDetokenizer.held_chars`)."""
    from modeling.checkpoints.gguf_file import read_gguf
    from modeling.text.gguf_tokenizer import tokenizer_from_gguf

    path = shared_models / "smollm2-135m-instruct" / "smollm2-135m-instruct-q4_1.gguf"
    tok = tokenizer_from_gguf(read_gguf(path).metadata, path.name)
    ids = tok.encode("x 😀 y", add_special_tokens=False)
    assert [tok.backend.id_to_token(i) for i in ids] == ["x", "ĠðŁĺ", "Ģ", "Ġy"]
    params = SamplingParams(temperature=0.0, logprobs=0)
    gen = Generation(
        _Scripted(ids), _Session(), tok, tok.encode("Hello"), params, len(ids), stop=["😀"]
    )
    chunks = list(gen)
    assert gen.text == "x "
    assert [lp.token for c in chunks for lp in c.logprobs] == ids[:2]


# --- completions' text_offset: where each token's text begins, streamed and whole -----


class _Session:
    capacity = 4096

    def reuse_prefix(self, ids: list[int]) -> int:
        return 0


class _Scripted:
    """A strategy whose rounds emit the given tokens, one round each (a model's answer,
    without a model)."""

    name = "scripted"
    target = types.SimpleNamespace(device="cpu")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def steps(self, session, prompt, params, max_new, generator, constraint=None):  # type: ignore[no-untyped-def]
        for t in self.tokens:
            yield Round([t], RoundStats(), None, [TokenLogprob(t, -1.0, [])])


def _chunks(tok: Tokenizer, prompt: list[int], tokens: list[int]) -> list[Chunk]:
    params = SamplingParams(temperature=0.0, logprobs=0)
    gen = Generation(_Scripted(tokens), _Session(), tok, prompt, params, len(tokens))
    return list(gen)


def _serve(tok: Tokenizer, chunks: list[Chunk], previous: int) -> tuple[dict, list[dict]]:
    """The same chunks through the daemon's own code, as a completion cut at its length."""
    shape = ResponseShape(chat=False, model="m", piece=tok.piece, raw_bytes=tok.raw_bytes)
    return serve_choice(chunks, shape, finish="length", previous=previous)


@pytest.mark.parametrize("case", ["emoji-bytes", "first-word-after-bos"])
def test_completions_text_offset_streamed_equals_whole(spm: Tokenizer, case: str) -> None:
    """/v1/completions logprobs' text_offset is where each token's text begins in the
    answer, streamed and whole alike. Both counted the tokens' pieces, which are not the
    text (a byte of 😀 reads U+FFFD, 4 of them for 1 character; the first word after BOS
    reads " Once" where the text reads "Once"), from different starts: the two lists
    differed, and the whole one pointed past the tokens in its own text."""
    if case == "emoji-bytes":
        prompt = spm.encode("Once upon a time")
        tokens = _bytes(spm, 0xF0, 0x9F, 0x98, 0x80) + spm.encode(" a b", add_special_tokens=False)
    else:
        prompt = [spm.bos_id]
        tokens = spm.encode("Once upon a time", add_special_tokens=False)
    chunks = _chunks(spm, prompt, tokens)
    whole, events = _serve(spm, chunks, prompt[-1])
    text = whole["choices"][0]["text"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == text
    whole_lp = whole["choices"][0]["logprobs"]
    streamed_offsets = [
        o
        for e in events
        for c in e["choices"]
        if c.get("logprobs")
        for o in c["logprobs"]["text_offset"]
    ]
    assert streamed_offsets == whole_lp["text_offset"]
    want = [0, 0, 0, 0, 1, 3] if case == "emoji-bytes" else [0, 4, 9, 11]
    assert whole_lp["text_offset"] == want, text


def test_a_stop_string_found_in_the_held_text_at_the_end_is_a_stop(shared_models: Path) -> None:
    """An answer under `tool_choice: auto` holds its text while it may begin a call; cut by
    max_tokens there, the held `<tool_` is let out at the end and a stop of `_` cuts it:
    the finish is "stop" and the stop string's token has no log-probability (the finish
    stayed "length" and every held token's log-probability was given)."""
    from modeling.checkpoints.gguf_file import read_gguf
    from modeling.text.gguf_tokenizer import tokenizer_from_gguf
    from speculative.tool_calls import HERMES

    path = shared_models / "smollm2-135m-instruct" / "smollm2-135m-instruct-q4_1.gguf"
    tok = tokenizer_from_gguf(read_gguf(path).metadata, path.name)
    ids = tok.encode("<tool_", add_special_tokens=False)
    assert "".join(tok.decode([i]) for i in ids) == "<tool_" and len(ids) >= 2
    params = SamplingParams(temperature=0.0, logprobs=0)
    gen = Generation(
        _Scripted(ids), _Session(), tok, tok.encode("Hello"), params, len(ids), stop=["_"],
        call_lead=HERMES.lead,
    )  # fmt: skip
    chunks = list(gen)
    assert gen.text == "<tool" and gen.finish_reason == "stop"
    given = [lp.token for c in chunks for lp in c.logprobs]
    assert given == [i for i in ids if "_" not in tok.decode([i])]


@pytest.mark.parametrize(
    ("values", "shown"),
    [
        ((0xC3, 0xC3, 0xA9), R + "é"),  # a lead byte cut short, then é
        ((0xE2, 0x82, 0xC3, 0xA9), R + R + "é"),  # (one U+FFFD a byte, as byte fallback's)
        ((0xF0, 0x9F, 0xC3, 0xA9, 0xE4, 0xBD, 0xA0), R + R + "é你"),
    ],
)
def test_a_character_after_a_cut_one_is_shown(spm: Tokenizer, values: tuple, shown: str) -> None:
    """A character begun and cut short before another, all in byte tokens: the run decodes
    all or nothing, so the cut one made the next one's lead byte read U+FFFD for good and
    the character was lost. Held only while UTF-8 may still go on, it is shown."""
    ids = _bytes(spm, *values)
    assert _streamed(spm, ids) == shown
    # Special tokens inside the run (skipped in the text) change nothing.
    eos = spm.eos_token_ids[0]
    assert _streamed(spm, [ids[0], eos, *ids[1:]]) == shown


def _per_byte(err: UnicodeDecodeError) -> tuple[str, int]:
    return "\ufffd" * (err.end - err.start), err.end


def test_bytes_stream_as_utf8_reads_them_one_replacement_a_byte(spm: Tokenizer) -> None:
    """Property: runs of byte tokens (characters, characters cut short, stray bytes, a
    byte-spelled newline), pushed a token or a few at a time, with special tokens inside:
    the streamed text is the bytes read as UTF-8, each byte that is not one U+FFFD (byte
    fallback's count), whatever the split. A character cut short and a newline after it
    read as four U+FFFD when they arrived before either was shown."""
    import codecs

    codecs.register_error("specd-test-per-byte", _per_byte)
    rng = random.Random(5)
    eos = spm.eos_token_ids[0]
    for _ in range(400):
        data = b""
        for _ in range(rng.randint(1, 6)):
            char = rng.choice(["é", "€", "😀", "你", "a", "\n"]).encode()
            data += rng.choice(
                [char, char, char[:-1] or char, bytes([rng.choice([0x80, 0xC3, 0xF0])])]
            )
        ids = _bytes(spm, *data)
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), eos)
        steps, n = [], len(ids)
        while n:
            steps.append(min(n, rng.choice([1, 1, 2, 3])))
            n -= steps[-1]
        want = data.decode("utf-8", "specd-test-per-byte")
        assert _streamed(spm, ids, steps) == want, (data, steps)
