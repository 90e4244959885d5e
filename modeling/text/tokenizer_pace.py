"""The pace check on a tokenizer.json (modeling/text/tokenizer_file.py reads the file): its
tokenizer timed on ordinary text at growing lengths, in CPU time, and refused where it is
too slow or grows too fast for the prompts specd accepts."""

from __future__ import annotations

import math
import time
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from modeling.checkpoints.folder_files import DAMAGED, CheckpointError
from modeling.errors import panic_said, rust_panic

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
            try:
                backend.encode(probe, add_special_tokens=False)
            except Exception:  # (the model refuses a piece: a WordLevel without its unknown
                _piece_by_piece(backend, probe)  # token; the rest is timed all the same)
        except BaseException as err:  # (the regex engine's retry limit: a Rust panic)
            if not rust_panic(err):
                raise
            raise CheckpointError(
                f"{file}: its normalizer or pre-tokenizer fails on ordinary text "
                f"({panic_said(err)}): {DAMAGED}"
            ) from None
        best = min(best, time.thread_time() - start)
    return best


def _piece_by_piece(backend: HFTokenizer, probe: str) -> None:
    """What `encode` does with `probe`, each piece the model refuses skipped, so that a
    model failing fast on one piece does not hide its time on the others."""
    text = backend.normalizer.normalize_str(probe) if backend.normalizer else probe
    pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer else [(text, 0)]
    for piece, _ in pieces:
        try:
            backend.model.tokenize(piece)
        except Exception:
            continue
