"""The pace check on a tokenizer.json (modeling/text/tokenizer_file.py reads the file): its
tokenizer timed on ordinary text at growing lengths, in CPU time, and refused where it is
too slow or grows too fast for the prompts specd accepts."""

from __future__ import annotations

import json
import math
import re
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
# And a run of each unit the file's regexes name (`regex_units`), at the rungs up to
# UNIT_RUNGS: a regex slow only on text the probes above never hold passed them (`[<|]+[^<|]`
# is quadratic only on runs of `<` and `|`, the marks of control tokens: 3.4 s for 32,768).
# A unit costs a real tokenizer's load about 3 ms. Their growth is projected from
# UNIT_PROJECT_FROM: a real tokenizer takes about 2 ms for 4,096 characters and projects
# under 10 s unless its time grew 30-fold for 4 times the text; `[<|]+[^<|]` takes 48 ms and
# projects to 40 s. This is a net, not a proof: `(?:<\|)+>`, 13 s for 131,072 characters of
# `<|`, takes 15 ms for 4,096 and projects to 7 s, and passes (README, Known limits).
UNIT_RUNGS = 4_096
UNIT_PROJECT_FROM = 0.003


def _probes(length: int, units: Iterable[str] = ()) -> list[tuple[str, str, float]]:
    """(what it is, the text, the seconds from which its growth is projected) for each
    probe of `length` characters: the units' last."""
    kinds = {
        "English text": _PROSE,
        "plain English paragraphs": _PLAIN,
        **{f"a run of {kind}": unit for kind, unit in _RUNS.items()},
    }
    probes = [(what, _run(unit, length), PROJECT_FROM) for what, unit in kinds.items()]
    if length <= UNIT_RUNGS:
        probes += [(f"a run of {u!r}", _run(u, length), UNIT_PROJECT_FROM) for u in sorted(units)]
    return probes


def _run(unit: str, length: int) -> str:
    return (unit * (length // len(unit) + 1))[:length]


def regex_units(backend: HFTokenizer) -> set[str]:
    """What the regexes of a tokenizer's normalizer and pre-tokenizer (a `Split`'s or a
    `Replace`'s pattern) name, each to be probed as a run: every mark (a character not a
    letter, digit or space) written as a literal, escaped (`\\<`, `\x3c`, `\074`), in a
    class or as a range's end; every run of two to eight literal characters (`<|`, `'re`);
    and every ASCII mark where a class of symbols or punctuation is named (`\\p{Sm}`,
    `[[:punct:]]`). A regex's own syntax outside a class is not read as a mark (a few of its
    marks are all the same: `:` of `(?i:`). Read from the steps the library built (after
    their number is bounded), not from the file, whose other keys the library ignores.
    UnitsTooMany where a regex is longer than MAX_PATTERN_CHARS or they name more than
    MAX_UNITS units (real ones: at most 33), which would not all be probed."""
    units: dict[str, None] = {}
    stack: list[Any] = [
        json.loads(part.__getstate__())
        for part in (backend.normalizer, backend.pre_tokenizer)
        if part is not None
    ]
    while stack:
        step = stack.pop()
        if isinstance(step, list):
            stack.extend(step)
        elif isinstance(step, dict):
            pattern = step.get("pattern")
            regex = pattern.get("Regex") if isinstance(pattern, dict) else None
            if isinstance(regex, str):
                if len(regex) > MAX_PATTERN_CHARS:
                    raise UnitsTooMany(
                        f"a regex of its normalizer or pre-tokenizer is {len(regex):,} "
                        f"characters long; specd reads at most {MAX_PATTERN_CHARS:,} (real "
                        "ones: under 200)"
                    )
                units.update(dict.fromkeys(_units(regex)))
            stack.extend(v for k, v in step.items() if k != "pattern")
    if len(units) > MAX_UNITS:
        raise UnitsTooMany(
            f"the regexes of its normalizer and pre-tokenizer name {len(units):,} marks and "
            f"runs of literals to time; specd times at most {MAX_UNITS} (real ones: 33)"
        )
    return set(units)


class UnitsTooMany(ValueError):
    """Regexes that name more than can be timed (`regex_units`)."""


MAX_PATTERN_CHARS = 65_536
MAX_UNITS = 128
_SYNTAX = set("\\^$.|?*+()[]{}")
_GROUP = re.compile(r"\(\?(?:[a-zA-Z-]*[:)]|<?[=!]|P?<[A-Za-z_][A-Za-z0-9_]*>|>)")
_OCTAL = re.compile("[0-7]{1,3}")
_COUNT = re.compile(r"\{[0-9]*,?[0-9]*\}")
_CLASSES = ("\\p{S", "\\p{P", "\\P{L", "\\P{N", "[:punct:]")


def _units(regex: str) -> list[str]:
    found: list[str] = []
    if any(name in regex for name in _CLASSES):
        found += list(string.punctuation)
    items: list[tuple[str, bool]] = []  # (a character, whether it is written as a literal)
    i = 0
    while i < len(regex):
        if regex[i] == "\\" and i + 1 < len(regex):
            escaped, i = _escape(regex, i)
            items.append((escaped, len(escaped) == 1))
            continue
        # A group's opening (`(?i:`, `(?<name>`, `(?<=`) and a counted repetition (`{1,3}`)
        # are syntax, whatever their characters.
        syntax = _GROUP.match(regex, i) or _COUNT.match(regex, i)
        if syntax is not None and syntax.end() > i + 1:
            items += [(c, False) for c in syntax.group(0)]
            i = syntax.end()
            continue
        items.append((regex[i], regex[i] not in _SYNTAX))
        i += 1
    in_class = False
    run: list[str] = []
    for j, (c, literal) in enumerate(items):
        if in_class:
            if c == "]" and not literal and items[j - 1][0] != "[":
                in_class = False
            elif not (c == "^" and items[j - 1] == ("[", False)) and len(c) == 1:
                found.append(c)  # (a range's ends; `-` itself, a mark)
            continue
        if c == "[" and not literal:
            in_class = True
        if literal and len(c) == 1:
            found.append(c)
            run.append(c)
            continue
        if 2 <= len(run) <= 8:
            found.append("".join(run))
        run = []
    if 2 <= len(run) <= 8:
        found.append("".join(run))
    return [
        u
        for u in found
        if (len(u) > 1 or not (u.isalnum() or u.isspace()))
        and not any(0xD800 <= ord(c) <= 0xDFFF for c in u)
    ]


def _escape(regex: str, i: int) -> tuple[str, int]:
    """The character an escape at `regex[i]` stands for (the escape's letter, as more
    than one character, where it stands for a class: `\\p`), and where the regex goes on."""
    kind = regex[i + 1]
    if kind in "xuo":
        width = {"x": 2, "u": 4, "o": 3}[kind]
        base = 8 if kind == "o" else 16
        if regex[i + 2 : i + 3] == "{":
            end = regex.find("}", i + 3)
            digits, after = (regex[i + 3 : end], end + 1) if end > 0 else ("", i + 2)
        else:
            digits, after = regex[i + 2 : i + 2 + width], i + 2 + width
        try:
            char = chr(int(digits, base))
        except (ValueError, OverflowError):
            return "\\" + kind, i + 2
        # (a surrogate is no character a text can hold: no run of it can be timed)
        return (char, after) if not 0xD800 <= ord(char) <= 0xDFFF else ("\\" + kind, after)
    if kind.isdigit() and kind in "01234567":  # octal (\074) or a back-reference
        octal = _OCTAL.match(regex, i + 1)
        assert octal is not None
        value = int(octal.group(0), 8)
        if kind == "0" or value >= 0o40:
            return chr(value), octal.end()
        return "\\" + kind, i + 2
    if kind in "pPk" and regex[i + 2 : i + 3] in ("{", "<"):
        end = regex.find("}" if regex[i + 2] == "{" else ">", i + 3)
        return "\\" + kind, (end + 1 if end > 0 else i + 2)
    if kind.isalnum():
        return "\\" + kind, i + 2  # (a class, an anchor, a control character)
    return kind, i + 2


def check_pace(
    backend: HFTokenizer, file: Path, key: object = None, units: Iterable[str] = ()
) -> None:
    """Refuse a tokenizer too slow on ordinary text (see RUNGS), or on runs of `units`
    (`regex_units`). `key`: the file's text (its length and hash); a text paced before in
    this process is not paced again."""
    if key is not None and key in _paced:
        return
    before: list[tuple[str, float]] = []
    for rung, length in enumerate(RUNGS):
        limit = max(RUNG_FLOOR, RUNG_SECONDS * length / RUNGS[-1])
        took: list[tuple[str, float]] = []
        for i, (what, probe, project_from) in enumerate(_probes(length, units)):
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
            if not before or now < project_from:
                continue
            shorter, then = before[i]
            projected = _projected(then, now, length / RUNGS[rung - 1], length)
            for _ in range(2):  # (timed again, the best of three, twice, to be sure: a
                # busy machine once made a real one project to 10 s)
                if projected > PACE_SECONDS:
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
