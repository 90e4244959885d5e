"""The pace check on a tokenizer.json (modeling/text/tokenizer_file.py reads the file): its
tokenizer timed on ordinary text at growing lengths, in CPU time, and refused where it is
too slow or grows too fast for the prompts specd accepts."""

from __future__ import annotations

import math
import string
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
# And a run of each ASCII mark the file's regexes name (`regex_marks`), at the rungs up to
# MARK_RUNGS: a regex slow only on runs of marks the probes above never hold (`[<|]+[^<|]`,
# quadratic on `<` and `|`: 3.4 s for 32,768 of them) passed them. A mark costs a real
# tokenizer's load about 2 ms.
MARK_RUNGS = 4_096


def _probes(length: int, marks: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(what it is, the text) for each probe of `length` characters: the marks' last."""
    units = {
        "English text": _PROSE,
        "plain English paragraphs": _PLAIN,
        **{f"a run of {kind}": unit for kind, unit in _RUNS.items()},
    }
    if length <= MARK_RUNGS:
        units.update({f"a run of {mark!r}": mark for mark in sorted(marks)})
    return [(what, (unit * (length // len(unit) + 1))[:length]) for what, unit in units.items()]


def regex_marks(spec: dict[str, Any]) -> set[str]:
    """The ASCII marks the regexes of a tokenizer.json's normalizer and pre-tokenizer name
    (a `Split`'s or a `Replace`'s pattern): as literals, escaped, in a character class or
    its ranges, or as hexadecimal escapes; a regex's own syntax outside a class is not
    one (a few of its marks, `:` of `(?i:`, are taken all the same)."""
    marks: set[str] = set()
    stack: list[Any] = [spec.get("normalizer"), spec.get("pre_tokenizer")]
    while stack and len(marks) < len(string.punctuation):
        step = stack.pop()
        if isinstance(step, list):
            stack.extend(step)
        elif isinstance(step, dict):
            pattern = step.get("pattern")
            regex = pattern.get("Regex") if isinstance(pattern, dict) else None
            if isinstance(regex, str):
                marks |= _marks(regex[:MAX_PATTERN_CHARS])
            stack.extend(v for k, v in step.items() if k != "pattern")
    return marks


MAX_PATTERN_CHARS = 4_096  # of one regex read for its marks (real ones: under 200)
_SYNTAX = set("\\^$.|?*+()[]{}")


def _marks(regex: str) -> set[str]:
    found: set[str] = set()
    chars: list[str] = []  # the regex, each escape of a character as that character
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            escaped, i = _escape(regex, i)
            if escaped in string.punctuation:
                found.add(escaped)
            chars.append("\0")  # (an escape is no syntax, nor a range's end here)
            continue
        chars.append(c)
        i += 1
    in_class = False
    for j, c in enumerate(chars):
        if in_class:
            if c == "]" and chars[j - 1] != "[":
                in_class = False
            elif c == "-" and 0 < j < len(chars) - 1 and chars[j - 1] != "[":
                low, high = chars[j - 1], chars[j + 1]
                if low.isascii() and high.isascii() and low <= high:
                    found |= {chr(k) for k in range(ord(low), ord(high) + 1)}
            elif c != "^" or chars[j - 1] != "[":
                found.add(c)
        elif c == "[":
            in_class = True
        elif c not in _SYNTAX:
            found.add(c)
    return found & set(string.punctuation)


def _escape(regex: str, i: int) -> tuple[str, int]:
    """The character an escape at `regex[i]` stands for (a class's letter where it stands
    for a class), and where the regex goes on."""
    kind = regex[i + 1]
    if kind in "xu":
        width = 2 if kind == "x" else 4
        if regex[i + 2 : i + 3] == "{":
            end = regex.find("}", i + 3)
            digits, after = (regex[i + 3 : end], end + 1) if end > 0 else ("", i + 2)
        else:
            digits, after = regex[i + 2 : i + 2 + width], i + 2 + width
        try:
            return chr(int(digits, 16)), after
        except (ValueError, OverflowError):
            return kind, i + 2
    if kind in "pPk" and regex[i + 2 : i + 3] in ("{", "<"):
        end = regex.find("}" if regex[i + 2] == "{" else ">", i + 3)
        return kind, (end + 1 if end > 0 else i + 2)
    return kind, i + 2


def check_pace(
    backend: HFTokenizer, file: Path, key: object = None, marks: Iterable[str] = ()
) -> None:
    """Refuse a tokenizer too slow on ordinary text (see RUNGS), or on runs of `marks`
    (`regex_marks`). `key`: the file's text (its length and hash); a text paced before in
    this process is not paced again."""
    if key is not None and key in _paced:
        return
    before: list[tuple[str, float]] = []
    for rung, length in enumerate(RUNGS):
        limit = max(RUNG_FLOOR, RUNG_SECONDS * length / RUNGS[-1])
        took: list[tuple[str, float]] = []
        for i, (what, probe) in enumerate(_probes(length, marks)):
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
