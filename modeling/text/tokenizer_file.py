"""tokenizer.json read as a hostile file: bounded in size before it is parsed, refused when
its normalizer, pre-tokenizer or decoder writes more than it matches, or when it tokenizes
ordinary text too slowly for the prompts specd accepts (a backtracking `Split` regex).
modeling/text/tokenizer.py builds the Tokenizer around what this returns."""

from __future__ import annotations

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

# Characters of the `tokenizers` library's refusal quoted in ours: it quotes the file,
# which may be megabytes on one line.
MAX_MESSAGE = 200


def read_backend(file: Path) -> HFTokenizer:
    """tokenizer.json as the `tokenizers` library reads it, or CheckpointError naming the
    file: past MAX_TOKENIZER_BYTES (checked before it is parsed), refused by the library
    (which bounds its own nesting), writing past MAX_REPLACEMENT, or too slow on ordinary
    text (`check_pace`)."""
    text = read_text(file, MAX_TOKENIZER_BYTES)
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
    check_pace(backend, file, key=(len(text), hash(text)))
    return backend


def library_refusal(exc: Exception) -> str:
    """What the `tokenizers` library said refusing a file, cut to MAX_MESSAGE characters (it
    quotes the file's text, which may be megabytes); any other exception is re-raised (the
    library refuses with a bare Exception: anything else is a bug)."""
    if type(exc) is not Exception:
        raise exc
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return first if len(first) <= MAX_MESSAGE else first[:MAX_MESSAGE] + " …"


# The most characters a normalizer, pre-tokenizer or decoder step may write for what it
# matches (real ones write one: "▁" for " ", " " for "▁").
MAX_REPLACEMENT = 64
_WRITERS = frozenset({"Replace", "Prepend", "Metaspace"})


def check_replacements(backend: HFTokenizer, file: Path) -> None:
    """Refuse a normalizer and pre-tokenizer, or a decoder, whose steps write more than
    MAX_REPLACEMENT characters for one they match (`Replace`'s content, `Prepend`, a
    `Metaspace` replacement; steps in sequence multiply, each writing 1 + its text for
    a character): a Replace of " " by 3,000,000 characters made a 12-space prompt 36M
    tokens (6.9 GB, then the allocator's abort), three Replaces of "a" by 60 made one
    character 216,000, a decoder's made 40 tokens 115 MB."""
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
                    for key in ("content", "prepend", "replacement"):
                        written = value.get(key)
                        if value.get("type") in _WRITERS and isinstance(written, str):
                            growth *= 1 + len(written)
                    stack.extend(value.values())
            if growth > MAX_REPLACEMENT + 1:
                raise CheckpointError(
                    f"{file}: its {part} writes up to {growth - 1:,.0f} characters for one it "
                    f"matches; at most {MAX_REPLACEMENT}: {DAMAGED}"
                )


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
RUNGS = (64, 512, 4_096, 16_384)
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
_RUNS = {
    "spaces": " ", "letters": "a", "digits": "7", "newlines": "\n", "punctuation": "!",
    "mixed whitespace": " \n\t", "short words": "ab ", "CJK": "東",
    "lines of 63 spaces": " " * 63 + "\n", "contractions": "'s", "CRLF line ends": "\r\n",
}  # fmt: skip
_paced: set[object] = set()  # the tokenizer.json texts already paced


def _probes(length: int) -> list[tuple[str, str]]:
    """(what it is, the text) for each probe of `length` characters."""
    units = {"English text": _PROSE, **{f"a run of {kind}": unit for kind, unit in _RUNS.items()}}
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
            if type(err).__name__ != "PanicException":
                raise
            raise CheckpointError(
                f"{file}: its normalizer or pre-tokenizer fails on ordinary text "
                f"({(str(err).splitlines() or ['a panic'])[0][:MAX_MESSAGE]}): {DAMAGED}"
            ) from None
        best = min(best, time.thread_time() - start)
    return best
