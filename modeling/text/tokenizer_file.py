"""tokenizer.json read as a hostile file: bounded in size before it is parsed, refused when
its normalizer, pre-tokenizer or decoder writes more than it matches, or when it tokenizes
ordinary text too slowly for the prompts specd accepts (a backtracking `Split` regex).
modeling/text/tokenizer.py builds the Tokenizer around what this returns."""

from __future__ import annotations

import base64
import json
import threading
import unicodedata
from collections import OrderedDict
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
from modeling.errors import panic_said, rust_panic, rust_quiet
from modeling.text.gguf_pretokenizers import LINEAR_FORMS, ZERO_WIDTH
from modeling.text.tokenizer_pace import UnitsTooMany, check_pace, regex_units

# Characters of the `tokenizers` library's refusal quoted in ours: it quotes the file,
# which may be megabytes on one line.
MAX_MESSAGE = 200


# The last texts read and what they built: a start reads the target's tokenizer.json twice
# (`--draft auto` looks for a draft with its vocabulary, reading a few candidates', then
# the target loads), and the same text builds the same tokenizer (seconds at Gemma 3's
# 33 MB). Nothing changes a backend built from a tokenizer.json once it is returned.
_READ: OrderedDict[tuple[int, int], HFTokenizer] = OrderedDict()
KEEP_READ = 4
_READ_LOCK = threading.Lock()
# Values a tokenizer.json may hold, counted by its commas and brackets before it is parsed:
# Python's parser takes some 60 bytes a value (64 MB of "[]," took 2 GB). Gemma 3's file
# (262,144 tokens, 514,906 merges as pairs) holds about 2 million.
MAX_JSON_VALUES = 2**23


def read_backend(file: Path) -> HFTokenizer:
    """tokenizer.json as the `tokenizers` library reads it, or CheckpointError naming the
    file: past MAX_TOKENIZER_BYTES (checked before it is parsed) or MAX_JSON_VALUES, past
    the vocabulary's bounds (`check_vocabulary`), refused by the library (which bounds its
    own nesting), writing past MAX_REPLACEMENT, or too slow on ordinary text
    (`check_pace`). A digit-grouping `Split` that llama.cpp's table holds runs in its
    linear form (gguf_pretokenizers.LINEAR_FORMS)."""
    text = read_text(file, MAX_TOKENIZER_BYTES)
    key = (len(text), hash(text))
    with _READ_LOCK:
        if (known := _READ.pop(key, None)) is not None:
            _READ[key] = known  # (the most recent last)
            return known
    values = text.count(",") + text.count("[") + text.count("{")
    if values > MAX_JSON_VALUES:
        raise CheckpointError(
            f"{file}: holds about {values:,} values; specd reads at most {MAX_JSON_VALUES:,} "
            f"(Gemma 3's has about 2 million): {DAMAGED}"
        )
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        spec = None  # (the library says what is wrong with it)
    if isinstance(spec, dict):
        check_vocabulary(spec, file)
        if linear_splits(spec):
            text = json.dumps(spec)
    del spec  # (hundreds of MB for a large vocabulary: not kept through the build)
    try:
        with rust_quiet():  # (a panic is said in one line below)
            backend = HFTokenizer.from_str(text)
    except BaseException as exc:  # (a Rust panic is no Exception)
        said = library_refusal(exc)
        raise CheckpointError(f"{file}: not a tokenizer ({said}): {DAMAGED}") from None
    # A file's padding and truncation are a training pipeline's: padding to a fixed length
    # of 20,000,000 cost every prompt 16 s and 2.4 GB, truncation cut prompts silently.
    backend.no_padding()
    backend.no_truncation()
    check_replacements(backend, file)
    try:
        units = regex_units(backend)
    except UnitsTooMany as exc:
        raise CheckpointError(f"{file}: {exc}: {DAMAGED}") from None
    check_pace(backend, file, key=key, units=units)
    with _READ_LOCK:
        _READ[key] = backend
        while len(_READ) > KEEP_READ:
            _READ.popitem(last=False)
    return backend


def linear_splits(spec: dict[str, Any]) -> bool:
    """Replace, in `spec`'s pre-tokenizer, each isolating `Split` whose regex is one of
    llama.cpp's quadratic digit groupings (afmoe's, superbpe's, tiny_aya's: 131,072 digits
    cost 18-120 s) by its linear form, the same pieces; whether any was."""
    replaced = False
    stack: list[Any] = [spec.get("pre_tokenizer")]
    while stack:
        step = stack.pop()
        if isinstance(step, list):
            stack.extend(step)
        if not isinstance(step, dict):
            continue
        stack.extend(step.values())
        pattern = step.get("pattern")
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        form = LINEAR_FORMS.get(regex) if isinstance(regex, str) else None
        if step.get("type") != "Split" or form is None or step.get("invert") is not False:
            continue
        if step.get("behavior") != "Isolated" and regex not in ZERO_WIDTH:
            continue  # (a zero-width regex cuts the same pieces whatever the behavior)
        splits = [
            {"type": "Split", "pattern": {"Regex": r}, "behavior": _BEHAVIORS[b], "invert": False}
            for r, b in form
        ]
        step.clear()
        step.update({"type": "Sequence", "pretokenizers": splits})
        replaced = True
    return replaced


_BEHAVIORS = {"isolated": "Isolated", "merged_with_next": "MergedWithNext"}


# Bounds on what a tokenizer's vocabulary may make us build, a GGUF file's or a
# tokenizer.json's (docs/models.md, "Hostile model files"). Real vocabularies: at most
# 262,144 tokens (Gemma 3) and a few million characters, 280,147 merges (Llama 3), tokens of
# a few hundred characters (SmolLM2's longest: 81), added tokens of up to about 1 MB.
MAX_VOCABULARY = 2**22  # tokens
MAX_PIECE_LENGTH = 1024  # characters in one token
MAX_VOCABULARY_TEXT = 2**23  # characters in all the tokens together
MAX_MERGES = 2**21
MAX_MERGES_TEXT = 2**24  # characters in all the merges together, both sides
# UTF-8 bytes of the added tokens (special, control, user-defined) together: the library
# builds one matching automaton over them, 1.3 µs and 75 bytes a byte (1,000-character
# tokens of CJK: 20,000 took 81 s and 4.5 GB). Real ones: up to about 1 MB (NeuTTS's 65,536
# speech tokens); 262,144 short ones (4.3 MB) build in 0.8 s.
MAX_ADDED_BYTES = 2**22
MAX_POST_PROCESSOR_ITEMS = 1024  # see _post_processor_items
MAX_WORDPIECE_WORD = 256  # a word's characters a WordPiece model splits (longer: unknown)


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
            f"reads at most {MAX_ADDED_BYTES:,} bytes of them (real ones: up to about 1 MB): {DAMAGED}"
        )
    longest_word = model.get("max_input_chars_per_word") if isinstance(model, dict) else None
    if isinstance(longest_word, int) and longest_word > MAX_WORDPIECE_WORD:
        raise CheckpointError(
            f"{file}: model.max_input_chars_per_word is {longest_word:,}; specd reads at most "
            f"{MAX_WORDPIECE_WORD} (real ones: 100; WordPiece's greedy match costs a word's "
            f"length cubed: 8,192 characters took 11 s): {DAMAGED}"
        )
    post = _post_processor_items(spec.get("post_processor"))
    if post > MAX_POST_PROCESSOR_ITEMS:
        raise CheckpointError(
            f"{file}: post_processor holds {post:,} ids, tokens and template items; specd "
            f"reads at most {MAX_POST_PROCESSOR_ITEMS:,} (real ones: a few, BOS and EOS): "
            f"{DAMAGED}"
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


def _post_processor_items(processor: Any) -> int:
    """The ids, tokens and template items a post-processor holds (every encode with special
    tokens writes those of its template: 2.5 million ids made each prompt 2.5 million
    tokens)."""
    items, stack = 0, [processor]
    while stack:
        value = stack.pop()
        if isinstance(value, list | dict):
            items += len(value)
            stack.extend(v for v in (value.values() if isinstance(value, dict) else value))
    return items


def _merge_length(merge: Any) -> int:
    """A merge's characters: "a b", or ["a", "b"] as newer files write it."""
    if isinstance(merge, str):
        return len(merge)
    return sum(len(x) for x in merge if isinstance(x, str)) if isinstance(merge, list) else 0


def library_refusal(exc: BaseException) -> str:
    """What the `tokenizers` library said refusing a file, cut to MAX_MESSAGE characters (it
    quotes the file's text, which may be megabytes), or where it panicked on it (a BPE
    `continuing_subword_prefix` longer than a token, a Precompiled charsmap that does not
    parse: a traceback, exit 1); any other exception is re-raised (the library refuses
    with a bare Exception: anything else is a bug)."""
    if rust_panic(exc):
        return f"the tokenizers library failed on it: {panic_said(exc)}"
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
    longest string of its charsmap; `BertNormalizer` puts spaces around a CJK character.
    What a step writes is counted as long as a later NFKC, NFKD or case step may make it
    (`_widest`): a Replace of "ل" by "ﷺ" (one character) then NFKC (18, five of them "ل")
    grew five-fold a round, counted as none."""
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
        return max(1, _widest(content)) if takes_one else 1 + _widest(content)
    if kind in ("Prepend", "Metaspace"):
        written = step.get("prepend" if kind == "Prepend" else "replacement")
        return 1 + _widest(written) if isinstance(written, str) else 1
    if kind == "ByteLevel" and not decoding:
        return 4
    if kind == "Precompiled" and isinstance(charsmap := step.get("precompiled_charsmap"), str):
        return _longest_normalized(charsmap)
    if kind == "BertNormalizer" and step.get("handle_chinese_chars") is not False:
        return 3
    return 1


def _widest(text: str) -> int:
    """`text`'s length at its longest after the normalizations and case mappings a later
    step may apply (NFKD's is 18 characters for one: U+FDFA)."""
    forms = [text, text.lower(), text.upper()]
    forms += [unicodedata.normalize(form, f) for f in forms for form in ("NFKD", "NFKC")]
    forms += [f.lower() for f in forms]
    return max(map(len, forms))


def _longest_normalized(charsmap: str) -> int:
    """The longest string (in characters, `_widest`) a SentencePiece charsmap writes: the
    blob (base64) is a 4-byte little-endian trie size, the trie, then NUL-terminated UTF-8
    strings."""
    try:
        blob = base64.b64decode(charsmap)
    except ValueError:
        return 1  # (not one the library read: it refused the file before this)
    strings = blob[4 + int.from_bytes(blob[:4], "little") :].split(b"\0")
    return max(1, max(_widest(text.decode("utf-8", "replace")) for text in strings))
