"""tokenizer.json read as a hostile file: bounded in size before it is parsed, refused when
its normalizer, pre-tokenizer or decoder writes more than it matches, or when it tokenizes
ordinary text too slowly for the prompts specd accepts (a backtracking `Split` regex).
modeling/text/tokenizer.py builds the Tokenizer around what this returns."""

from __future__ import annotations

import base64
import json
import math
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from modeling.checkpoints.folder_files import (
    DAMAGED,
    MAX_TOKENIZER_BYTES,
    CheckpointError,
    read_text,
)
from modeling.checkpoints.gguf_file import short_repr
from modeling.errors import rust_panic

# Characters of the `tokenizers` library's refusal quoted in ours: it quotes the file,
# which may be megabytes on one line.
MAX_MESSAGE = 200


# The last text read and what it built: a start reads the target's tokenizer.json twice
# (`--draft auto` looks for a draft with its vocabulary, then the target loads), and the
# same text builds the same tokenizer (seconds at Gemma 3's 33 MB). Nothing changes a
# backend built from a tokenizer.json once it is returned.
_last_read: tuple[tuple[int, int], HFTokenizer] | None = None


def read_backend(file: Path) -> HFTokenizer:
    """tokenizer.json as the `tokenizers` library reads it, or CheckpointError naming the
    file: past MAX_TOKENIZER_BYTES (checked before it is parsed), refused by the library
    (which bounds its own nesting), writing past MAX_REPLACEMENT, or too slow on ordinary
    text (`check_pace`)."""
    text = read_text(file, MAX_TOKENIZER_BYTES)
    key = (len(text), hash(text))
    global _last_read
    last = _last_read
    if last is not None and last[0] == key:
        return last[1]
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        spec = None  # (the library says what is wrong with it)
    if isinstance(spec, dict):
        check_vocabulary(spec, file)
    try:
        backend = HFTokenizer.from_str(text)
    except Exception as exc:
        said = library_refusal(exc)
        raise CheckpointError(f"{file}: not a tokenizer ({said}): {DAMAGED}") from None
    # A file's padding and truncation are a training pipeline's: padding to a fixed length
    # of 20,000,000 cost every prompt 16 s and 2.4 GB, truncation cut prompts silently.
    backend.no_padding()
    backend.no_truncation()
    check_replacements(backend, file)
    check_pace(backend, file, key=key)
    _last_read = (key, backend)
    return backend


# Bounds on what a tokenizer's vocabulary may make us build, a GGUF file's or a
# tokenizer.json's (docs/models.md, "Hostile model files"). Real vocabularies: at most
# 262,144 tokens (Gemma 3) and a few million characters, 280,147 merges (Llama 3), tokens of
# a few hundred characters (SmolLM2's longest: 81), added tokens of some 100 KB in all.
MAX_VOCABULARY = 2**22  # tokens
MAX_PIECE_LENGTH = 1024  # characters in one token
MAX_VOCABULARY_TEXT = 2**23  # characters in all the tokens together
MAX_MERGES = 2**21
MAX_MERGES_TEXT = 2**24  # characters in all the merges together, both sides
# UTF-8 bytes of the added tokens (special, control, user-defined) together: the library
# builds one matching automaton over them, 1.3 µs and 75 bytes a byte (1,000-character
# tokens of CJK: 20,000 took 81 s and 4.5 GB).
MAX_ADDED_BYTES = 2**20


def check_vocabulary(spec: dict[str, Any], file: Path) -> None:
    """Refuse a tokenizer.json whose vocabulary, merges or added tokens pass the bounds
    above, before the library builds them (a Unigram of 20,000 pieces of 1,000 characters
    took it 21 s and 7 GB). Values of the wrong type are left for the library to refuse."""
    model = spec.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    merges = model.get("merges") if isinstance(model, dict) else None
    added = spec.get("added_tokens")
    pieces: list[str] = []
    if isinstance(vocab, dict):
        pieces = list(vocab)
    elif isinstance(vocab, list):  # (Unigram: [piece, score] pairs)
        pieces = [p[0] for p in vocab if isinstance(p, list) and p and isinstance(p[0], str)]
    tokens: list[Any] = added if isinstance(added, list) else []
    contents: list[str] = [
        t["content"] for t in tokens if isinstance(t, dict) and isinstance(t.get("content"), str)
    ]
    for key, texts in (("model.vocab", pieces), ("added_tokens", contents)):
        if (problem := token_problem(texts, key)) is not None:
            raise CheckpointError(f"{file}: {problem}: {DAMAGED}")
    added_bytes = sum(len(c.encode()) for c in contents)
    if added_bytes > MAX_ADDED_BYTES:
        raise CheckpointError(
            f"{file}: added_tokens hold {len(contents):,} tokens of {added_bytes:,} bytes; specd "
            f"reads at most {MAX_ADDED_BYTES:,} bytes of them (real ones: some 100 KB): {DAMAGED}"
        )
    if isinstance(merges, list):
        merged = sum(_merge_length(m) for m in merges)
        if len(merges) > MAX_MERGES or merged > MAX_MERGES_TEXT:
            raise CheckpointError(
                f"{file}: model.merges holds {len(merges):,} merges of {merged:,} characters; "
                f"specd reads at most {MAX_MERGES:,} of {MAX_MERGES_TEXT:,} (Llama 3 has "
                f"280,147): {DAMAGED}"
            )


def token_problem(tokens: list[str], key: str) -> str | None:
    """What is past the bounds in a vocabulary's `tokens` (a GGUF file's or a
    tokenizer.json's, read from `key`), or None."""
    if len(tokens) > MAX_VOCABULARY:
        return (
            f"{key} has {len(tokens):,} tokens; specd reads vocabularies of at most "
            f"{MAX_VOCABULARY:,} (the largest real one has 262,144)"
        )
    longest = max(tokens, key=len, default="")
    if len(longest) > MAX_PIECE_LENGTH:
        return (
            f"{key}[{tokens.index(longest)}] is {len(longest):,} characters long "
            f"({short_repr(longest[:40])}…); specd reads tokens of at most "
            f"{MAX_PIECE_LENGTH:,} (a real vocabulary's longest are a few hundred)"
        )
    total = sum(map(len, tokens))
    if total > MAX_VOCABULARY_TEXT:
        return (
            f"{key} holds {total:,} characters in all; specd reads vocabularies of at most "
            f"{MAX_VOCABULARY_TEXT:,} (a real one has a few million)"
        )
    return None


def _merge_length(merge: Any) -> int:
    """A merge's characters: "a b", or ["a", "b"] as newer files write it."""
    if isinstance(merge, str):
        return len(merge)
    return sum(len(x) for x in merge if isinstance(x, str)) if isinstance(merge, list) else 0


def library_refusal(exc: Exception) -> str:
    """What the `tokenizers` library said refusing a file, cut to MAX_MESSAGE characters (it
    quotes the file's text, which may be megabytes); any other exception is re-raised (the
    library refuses with a bare Exception: anything else is a bug)."""
    if type(exc) is not Exception:
        raise exc
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return first if len(first) <= MAX_MESSAGE else first[:MAX_MESSAGE] + " …"


# The most characters a normalizer, pre-tokenizer or decoder step may write for what it
# matches, its steps in sequence multiplied (real ones: 36 at most, T5's: a Precompiled
# charsmap's 18 for U+FDFA, times Metaspace's "▁" before a one-character piece).
MAX_REPLACEMENT = 64
MAX_STEPS = 64  # steps in all (real ones: a dozen at most; 900 Lowercase took 10 s to load)
# What a regex needs to match an empty string (a quantifier that allows none, alternation,
# an anchor or lookaround): a pattern without any of these takes a character at least.
_EMPTY_MATCHERS = ("*", "?", "{0", "{,", "|", "(?", "()", "\\b", "\\B", "^", "$", "\\A", "\\z",
    "\\Z", "\\G", "\\K")  # fmt: skip


def check_replacements(backend: HFTokenizer, file: Path) -> None:
    """Refuse a normalizer and pre-tokenizer, or a decoder, whose steps write more than
    MAX_REPLACEMENT characters for one they match (`_growth`; steps in sequence multiply),
    or that have more than MAX_STEPS steps: a Replace of " " by 3,000,000 characters made
    a 12-space prompt 36M tokens (6.9 GB, then the allocator's abort), three Replaces of
    "a" by 60 made one character 216,000, a decoder's made 40 tokens 115 MB, a Precompiled
    charsmap writing a million characters for "A" 1M tokens a letter, 22 ByteLevel
    normalizers 11.8 GB for a 64-character text."""
    steps = 0
    for parts in (("normalizer", "pre_tokenizer"), ("decoder",)):
        # (a float: a million steps of one character each make no integer of a million
        # bits, they make inf)
        growth = 1.0
        for part in parts:
            component = getattr(backend, part)
            if component is None:
                continue
            stack: list[Any] = [json.loads(component.__getstate__())]  # (nesting: the library's)
            while stack:
                value = stack.pop()
                if isinstance(value, list):
                    stack.extend(value)
                elif isinstance(value, dict):
                    if isinstance(value.get("type"), str):
                        steps += 1
                        growth *= _growth(value, decoding=part == "decoder")
                    stack.extend(value.values())
            if growth > MAX_REPLACEMENT:
                raise CheckpointError(
                    f"{file}: its {part} writes up to {growth:,.0f} characters for one it "
                    f"matches; at most {MAX_REPLACEMENT}: {DAMAGED}"
                )
    if steps > MAX_STEPS:
        raise CheckpointError(
            f"{file}: its normalizer, pre-tokenizer and decoder have {steps:,} steps; at most "
            f"{MAX_STEPS} (real ones have a dozen): {DAMAGED}"
        )


def _growth(step: dict[str, Any], decoding: bool) -> float:
    """The most characters `step` writes for one character it reads (1 for the steps that
    write none of their own). `Replace` writes its content for a match of one character at
    least, or also between characters where its pattern may match nothing; `Prepend` and
    `Metaspace` write theirs before a piece (of one character, at worst); `ByteLevel`
    spells a character's UTF-8 bytes (4 at most) as characters; `Precompiled` writes the
    longest string of its charsmap."""
    kind = step.get("type")
    if kind == "Replace" and isinstance(content := step.get("content"), str):
        pattern = step.get("pattern")
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        string = pattern.get("String") if isinstance(pattern, dict) else None
        takes_one = (
            bool(string)
            if regex is None
            else bool(regex) and not any(marker in regex for marker in _EMPTY_MATCHERS)
        )
        return max(1, len(content)) if takes_one else 1 + len(content)
    if kind in ("Prepend", "Metaspace"):
        written = step.get("prepend" if kind == "Prepend" else "replacement")
        return 1 + len(written) if isinstance(written, str) else 1
    if kind == "ByteLevel" and not decoding:
        return 4
    if kind == "Precompiled" and isinstance(charsmap := step.get("precompiled_charsmap"), str):
        return _longest_normalized(charsmap)
    return 1


def _longest_normalized(charsmap: str) -> int:
    """The longest string (in characters) a SentencePiece charsmap writes: the blob (base64)
    is a 4-byte little-endian trie size, the trie, then NUL-terminated UTF-8 strings."""
    try:
        blob = base64.b64decode(charsmap)
    except ValueError:
        return 1  # (not one the library read: it refused the file before this)
    strings = blob[4 + int.from_bytes(blob[:4], "little") :].split(b"\0")
    return max(1, max(len(text.decode("utf-8", "replace")) for text in strings))


# The pace check. A regex engine backtracks: `Split` patterns that are quadratic or cubic
# in a run of one kind of character cost seconds for a prompt that real ones tokenize in
# milliseconds (a cubic one: 49 s for 2,000 characters), while staying under the engine's
# own retry limit. The file's tokenizer runs on probes of ordinary text and of long runs
# of one kind, at RUNGS characters each; a probe over its rung's share of RUNG_SECONDS
# refuses the file at once, and each probe's time is projected to PACE_TEXT characters
# from how it grew since the rung before (at least linearly): over PACE_SECONDS, refused.
# Real ones (GPT-2's, Llama 3's, Qwen's, GPT-4o's, Tekken's, DeepSeek's, BLOOM's regexes)
# tokenize a 16,384-character probe in 3-15 ms of CPU on this 2-core machine, projected
# under 0.6 s; a quadratic regex whose 16,384 characters take 100 ms projects to 6.4 s.
RUNGS = (64, 256, 1_024, 4_096, 16_384)
RUNG_SECONDS = 0.5  # at the last rung; earlier rungs in proportion, at least RUNG_FLOOR
RUNG_FLOOR = 0.002
# Seconds a probe takes before its growth is projected: below, a call's own cost and a busy
# machine's effects on a thread's CPU time (its caches) are much of it.
PROJECT_FROM = 0.010
PACE_TEXT = 131_072  # characters: a 32k-token prompt of English
PACE_SECONDS = 10.0
_PROSE = (
    "The quick brown fox, aged 42, jumped over 3 lazy dogs!\n\tIt's naïve to say: "
    '"x = y*2 + 1;" (or 0.5e-3 %) — 東京は大きい。 Ünïcödé, ĳ, ﬁ, 한국어 ok? '
)
# Letters, spaces and a little punctuation only: a regex may be slow on text that holds
# none of the rarer characters of _PROSE (a tab, "=", "*", "%" ended its slow runs).
_PLAIN = (
    "This program is free software, and you can redistribute it or modify it under the "
    "terms of the license as published by the foundation; either version three of the "
    "license, or any later version. It is distributed in the hope that it will be useful.\n\n"
)
_RUNS = {
    "spaces": " ", "letters": "a", "digits": "7", "newlines": "\n", "punctuation": "!",
    "mixed whitespace": " \n\t", "short words": "ab ", "CJK": "東",
    "lines of 63 spaces": " " * 63 + "\n", "contractions": "'s", "CRLF line ends": "\r\n",
}  # fmt: skip
_paced: set[object] = set()  # the tokenizer.json texts already paced


def _probes(length: int) -> list[tuple[str, str]]:
    """(what it is, the text) for each probe of `length` characters."""
    units = {
        "English text": _PROSE,
        "plain English paragraphs": _PLAIN,
        **{f"a run of {kind}": unit for kind, unit in _RUNS.items()},
    }
    return [(what, (unit * (length // len(unit) + 1))[:length]) for what, unit in units.items()]


def check_pace(backend: HFTokenizer, file: Path, key: object = None) -> None:
    """Refuse a tokenizer too slow on ordinary text (see RUNGS). `key`: the file's text (its
    length and hash); a text paced before in this process is not paced again."""
    if key is not None and key in _paced:
        return
    before: list[tuple[str, float]] = []
    for rung, length in enumerate(RUNGS):
        limit = max(RUNG_FLOOR, RUNG_SECONDS * length / RUNGS[-1])
        took: list[tuple[str, float]] = []
        for i, (what, probe) in enumerate(_probes(length)):
            now = _timed(backend, probe, file)
            if limit / 10 < now <= 3 * limit:  # (a pause, or slow: timed again to be sure)
                now = min(now, _timed(backend, probe, file))
            took.append((probe, now))
            if now > limit:
                raise CheckpointError(
                    f"{file}: its normalizer or pre-tokenizer took {now * 1e3:,.1f} ms of CPU for "
                    f"{length:,} characters ({what}), where a real one takes under "
                    f"{limit * 1e3:,.1f} ms: a prompt would take minutes (a backtracking "
                    f"`Split` regex?): {DAMAGED}"
                )
            if not before or now < PROJECT_FROM:
                continue
            shorter, then = before[i]
            projected = _projected(then, now, length / RUNGS[rung - 1], length)
            if projected > PACE_SECONDS:  # (timed again, the best of three, to be sure)
                then = min(_timed(backend, shorter, file, tries=3), then)
                now = min(_timed(backend, probe, file, tries=3), now)
                projected = _projected(then, now, length / RUNGS[rung - 1], length)
            if projected > PACE_SECONDS:
                raise CheckpointError(
                    f"{file}: its normalizer or pre-tokenizer slows as text grows ({what}: "
                    f"{then * 1e3:.1f} ms for {RUNGS[rung - 1]:,} characters, "
                    f"{now * 1e3:.1f} ms for {length:,}), so a {PACE_TEXT:,}-character "
                    f"prompt would take about {projected:,.0f} s (a backtracking `Split` "
                    f"regex?): {DAMAGED}"
                )
        before = took
    if key is not None:
        _paced.add(key)


def _projected(then: float, now: float, grown: float, length: int) -> float:
    """Seconds for PACE_TEXT characters from `now` for `length` and `then` for `length /
    grown`: growing as it grew, at least linearly."""
    power = max(1.0, math.log(max(now, 1e-9) / max(then, 1e-9)) / math.log(grown))
    return now * (PACE_TEXT / length) ** power


def _timed(backend: HFTokenizer, probe: str, file: Path, tries: int = 1) -> float:
    """CPU seconds this thread spends tokenizing `probe`, the best of `tries` (`encode`
    works in the calling thread; CPU time, not the clock, so that a machine busy with other
    work does not make a real tokenizer look slow: under three busy processes on 2 cores a
    65,536-character probe took 185 ms by the clock and 31 ms of CPU, as idle)."""
    best = math.inf
    for _ in range(tries):
        start = time.thread_time()
        try:
            backend.encode(probe, add_special_tokens=False)
        except BaseException as err:  # (the regex engine's retry limit: a Rust panic)
            if not rust_panic(err):
                raise
            raise CheckpointError(
                f"{file}: its normalizer or pre-tokenizer fails on ordinary text "
                f"({(str(err).splitlines() or ['a panic'])[0][:MAX_MESSAGE]}): {DAMAGED}"
            ) from None
        best = min(best, time.thread_time() - start)
    return best
