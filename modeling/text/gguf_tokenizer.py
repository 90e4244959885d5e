"""The tokenizer a GGUF file describes in its metadata (`tokenizer.ggml.*`), as our `Tokenizer`.

A GGUF has no tokenizer.json: the vocabulary, its scores or merges, the token types, the
special ids and the chat template are metadata keys. From them we build the `tokenizers`
pipeline that transformers builds when it opens a GGUF (`integrations/gguf/
gguf_tokenizer_mapping.py`, transformers 5.24), the one in ../shared/models/stories260k's
tokenizer.json too:

- `llama` (SentencePiece): BPE over the pieces, byte fallback and spaces as `▁`, in the shape
  the file's architecture needs (Gemma's and Phi-3's differ from the rest; how, and where
  llama.cpp tokenizes differently: modeling/text/gguf_spm.py).
- `gpt2`: byte-level BPE with the file's merges, the text first split by the regexes that
  `tokenizer.ggml.pre` names (llama.cpp's names and splits: modeling/text/gguf_pretokenizers.py).

Where transformers' GGUF path departs from both llama.cpp and the model's tokenizer.json we
follow those two: a `pre` name llama.cpp flags so takes a word found whole in the vocabulary
whole (`ignore_merges`: `llama-bpe`, `tekken`, ...) or adds BOS unless the file says otherwise
(`llama-bpe`, ...); names whose split transformers does not know (`smollm`, `deepseek-v3`,
...) are split as llama.cpp splits them, not by GPT-2's regex; control and user-defined
tokens keep the spelling the file gives them (byte-level respelling is for normal tokens),
so `<｜end▁of▁sentence｜>` is matched whole; `add_space_prefix` false is honoured; and a
generation ends at EOS, EOT, EOM or the end-of-turn tokens llama.cpp knows by name.

The metadata is a hostile file's: every key is checked for its type, length and range, and
the vocabulary against the bounds below, before anything is built from it
(`check_tokenizer_metadata`, which `specd plan` runs too). Deriving a `llama` file's merges
costs a piece's length squared (each cut of it is looked up; modeling/text/gguf_merges.py),
so one piece of 300k characters alone would take hours: pieces are bounded, and the
vocabulary's text in all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from modeling.checkpoints.gguf_file import CORRUPT_FILE, short_repr
from modeling.errors import rust_quiet
from modeling.text.gguf_merges import TooManyMergesError
from modeling.text.gguf_pretokenizers import NOT_BYTE_LEVEL, PRE_TOKENIZERS
from modeling.text.gguf_spm import sentencepiece, spelled_pieces
from modeling.text.tokenizer import Tokenizer
from modeling.text.tokenizer_file import (
    MAX_ADDED_BYTES,
    MAX_MERGES,
    MAX_MERGES_TEXT,
    MAX_PIECE_LENGTH,
    library_refusal,
    token_problem,
)

# tokenizer.ggml.token_type values
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4


# Tokens llama.cpp ends a generation at by their text alone (llama-vocab.cpp, "EOG").
END_OF_TURN_TOKENS = frozenset(
    {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"}
    | {"<EOT>", "<|end_of_text|>"}
)


class GGUFTokenizerError(ValueError):
    """The file's tokenizer metadata is missing, malformed or of a kind we cannot build."""


class UnsupportedTokenizerError(GGUFTokenizerError):
    """Well-formed tokenizer metadata that specd cannot build: a key missing, or a kind of
    tokenizer (or pre-tokenizer) it does not know."""


@dataclass(frozen=True)
class _Fields:
    """The tokenizer keys of a file, checked."""

    model: str  # "llama" | "gpt2"
    architecture: str | None  # general.architecture: which SentencePiece shape
    tokens: list[str]
    types: list[int]
    ids: dict[str, int | None]  # bos, eos, unknown, padding, eot, eom
    scores: list[float] | None  # `llama`
    merges: list[tuple[str, str]] | None  # `gpt2`
    pre: str  # `gpt2`: the split's name
    flags: dict[str, bool | None]  # add_bos_token, add_eos_token, add_space_prefix
    chat_template: str | None


def check_tokenizer_metadata(fields: Mapping[str, Any], source: str) -> None:
    """GGUFTokenizerError, naming `source` and the key, for a tokenizer key that is
    malformed (of the wrong type or length, out of range, past a bound), and
    UnsupportedTokenizerError for one specd cannot build (an unknown pre-tokenizer or
    kind): opening a file refuses what loading it would, so `specd plan` and `specd models`
    say so before any weight is read. Nothing is built (Llama 3 sized: ~0.15 s)."""
    _read(fields, source)


def tokenizer_from_gguf(fields: Mapping[str, Any], source: str) -> Tokenizer:
    """Our `Tokenizer` for the metadata `fields` (as `gguf_file.read_gguf` reads them) of the GGUF
    file `source` (named in errors)."""
    read = _read(fields, source)
    types, ids = read.types, read.ids
    # Gemma's runs of spaces are spelled as its pieces are (gguf_spm.spelled_pieces); a
    # user-defined token respelled so is found by the BPE, not matched whole.
    tokens = (
        spelled_pieces(read.tokens, read.architecture) if read.model == "llama" else read.tokens
    )
    # Matched whole in any text: control and unknown tokens, and the ids the file names.
    special = {i for i, kind in enumerate(types) if kind in (UNKNOWN, CONTROL)}
    special |= {i for i in ids.values() if i is not None}
    # (a named id typed user-defined stays special: added again as not special, it was no
    # longer a control token, and a request could spell the EOS)
    user_defined = [
        i
        for i, kind in enumerate(types)
        if kind == USER_DEFINED and tokens[i] == read.tokens[i] and i not in special
    ]
    try:
        if read.model == "llama":
            backend = _sentencepiece(read, tokens, source)
            add_bos_default = True
        else:
            backend = _byte_level(read, special | set(user_defined))
            add_bos_default = PRE_TOKENIZERS[read.pre].add_bos
    except BaseException as exc:  # (a Rust panic is no Exception: one line below)
        said = library_refusal(exc)
        raise GGUFTokenizerError(
            f"{source}: the tokenizer.ggml.* keys do not make a tokenizer ({said}): {CORRUPT_FILE}"
        ) from None
    backend.add_special_tokens(
        [AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special)]
    )
    if user_defined:  # (adding none builds the automaton again)
        backend.add_tokens(
            [AddedToken(tokens[i], normalized=False, special=False) for i in user_defined]
        )

    bos = tokens[ids["bos"]] if ids["bos"] is not None else None
    eos = tokens[ids["eos"]] if ids["eos"] is not None else None
    add_bos_flag = read.flags["add_bos_token"]
    add_bos = (add_bos_default if add_bos_flag is None else add_bos_flag) and bos is not None
    if read.flags["add_eos_token"] and eos is not None:
        # Only the post-processor can append EOS; Tokenizer then leaves BOS to it too.
        single = f"{bos}:0 $A:0 {eos}:0" if add_bos else f"$A:0 {eos}:0"
        named = {t: backend.token_to_id(t) for t in (bos, eos) if t is not None}
        backend.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=list(named.items())
        )
        add_bos_policy: bool | None = None
    else:
        add_bos_policy = add_bos
    eos_ids = [i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None]
    eos_ids += [i for i, token in enumerate(tokens) if token in END_OF_TURN_TOKENS]
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        add_bos=add_bos_policy,
        eos_token_ids=eos_ids,
        chat_template=read.chat_template,
        template_source=f"{source}: tokenizer.chat_template",
    )


def _sentencepiece(read: _Fields, pieces: list[str], source: str) -> HFTokenizer:
    try:
        return sentencepiece(
            pieces,
            read.scores or [],
            read.ids["unknown"],
            read.flags["add_space_prefix"] is not False,
            read.architecture,
            max_merges=MAX_MERGES,
            max_text=MAX_MERGES_TEXT,
        )
    except TooManyMergesError:
        raise GGUFTokenizerError(
            f"{source}: tokenizer.ggml.tokens give over {MAX_MERGES:,} merges or "
            f"{MAX_MERGES_TEXT:,} characters of them, specd's bounds (a real vocabulary "
            f"gives about two short ones per token): {CORRUPT_FILE}"
        ) from None


def _byte_level(read: _Fields, keep: set[int]) -> HFTokenizer:
    tokens, merges, pre = read.tokens, read.merges or [], read.pre
    # Normal tokens are spelled in the byte alphabet (a byte per character); a converter
    # that wrote one as UTF-8 text is respelled, as transformers does. Tokens matched whole
    # (`keep`) stay as written: that is how they appear in text.
    alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
    spelling = _byte_spelling()
    vocab = {}
    for i, token in enumerate(tokens):
        if i not in keep and not alphabet.issuperset(token):
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = i
    split = PRE_TOKENIZERS[pre]
    with rust_quiet():  # (the library's own work, where it may panic: a panic is one line)
        backend = HFTokenizer(models.BPE(vocab, merges, ignore_merges=split.ignore_merges))
    backend.pre_tokenizer = split.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character table: printable bytes stand for themselves, the rest are
    shifted past 255 so that no token holds a space or a control character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}


def _read(fields: Mapping[str, Any], source: str) -> _Fields:
    """The tokenizer keys, each checked for what tokenizer_from_gguf does with it: what is
    malformed first, what specd cannot build (UnsupportedTokenizerError) as it comes."""
    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GGUFTokenizerError(
            f"{source}: tokenizer.chat_template is {short_repr(template)}, not text: {CORRUPT_FILE}"
        )
    flags = {
        name: _flag(fields, f"tokenizer.ggml.{name}", source)
        for name in ("add_bos_token", "add_eos_token", "add_space_prefix")
    }
    model, pre = fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre", "default")
    for key, value in (("tokenizer.ggml.model", model), ("tokenizer.ggml.pre", pre)):
        if value is not None and not isinstance(value, str):
            raise GGUFTokenizerError(
                f"{source}: {key} is {short_repr(value)}, not a name: {CORRUPT_FILE}"
            )
    tokens = _tokens(fields, source)
    # Without token types (older converters) all are normal, the named special ids aside.
    types = _numbers(fields, "tokenizer.ggml.token_type", source, len(tokens), "integers")
    ids = {
        name: _token_id(fields, f"tokenizer.ggml.{name}_token_id", source, len(tokens))
        for name in ("bos", "eos", "unknown", "padding", "eot", "eom")
    }
    scores = merges = None
    if model == "llama":
        scores = _numbers(fields, "tokenizer.ggml.scores", source, len(tokens), "numbers")
        if scores is None:
            raise UnsupportedTokenizerError(
                f"{source}: tokenizer.ggml.scores is missing (a 'llama' tokenizer needs it)"
            )
    elif model == "gpt2":
        if pre in NOT_BYTE_LEVEL:
            raise UnsupportedTokenizerError(
                f"{source}: tokenizer.ggml.pre {pre!r} is {NOT_BYTE_LEVEL[pre]}, which specd "
                "does not build; load the model's folder instead"
            )
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedTokenizerError(
                f"{source}: tokenizer.ggml.pre {pre!r} names a pre-tokenizer neither specd nor "
                f"llama.cpp knows (modeling/text/gguf_pretokenizers.py lists the "
                f"{len(PRE_TOKENIZERS)} specd builds)"
            )
        merges = _merges(fields, source)
    else:
        raise UnsupportedTokenizerError(
            f"{source}: tokenizer.ggml.model is {short_repr(model)}; specd builds 'llama' "
            "(SentencePiece) and 'gpt2' (byte-level BPE) tokenizers"
        )
    types = [1] * len(tokens) if types is None else types
    architecture = fields.get("general.architecture")
    architecture = architecture if isinstance(architecture, str) else None
    # Matched whole in any text (the library builds an automaton of them): bounded here, so
    # that `specd plan` says so too.
    whole = {i for i, kind in enumerate(types) if kind in (UNKNOWN, CONTROL, USER_DEFINED)}
    whole |= {i for i in ids.values() if i is not None}
    added = sum(len(tokens[i].encode()) for i in whole)
    if added > MAX_ADDED_BYTES:
        raise GGUFTokenizerError(
            f"{source}: tokenizer.ggml.token_type makes {len(whole):,} tokens control or "
            f"user-defined, {added:,} bytes of them; specd reads at most {MAX_ADDED_BYTES:,} "
            f"(real ones: up to about 1 MB): {CORRUPT_FILE}"
        )
    return _Fields(model, architecture, tokens, types, ids, scores, merges, pre, flags, template)


def _tokens(fields: Mapping[str, Any], source: str) -> list[str]:
    key = "tokenizer.ggml.tokens"
    tokens = _strings(fields, key, source)
    if not any(tokens):  # (a text would then be no tokens at all)
        raise GGUFTokenizerError(
            f"{source}: {key} holds no token but empty strings: {CORRUPT_FILE}"
        )
    if (problem := token_problem(tokens, key)) is not None:
        raise GGUFTokenizerError(f"{source}: {problem}: {CORRUPT_FILE}")
    return tokens


def _merges(fields: Mapping[str, Any], source: str) -> list[tuple[str, str]]:
    key = "tokenizer.ggml.merges"
    texts = _strings(fields, key, source)
    text = sum(map(len, texts))
    if len(texts) > MAX_MERGES or text > MAX_MERGES_TEXT:
        raise GGUFTokenizerError(
            f"{source}: {key} has {len(texts):,} merges of {text:,} characters; specd reads "
            f"at most {MAX_MERGES:,} of {MAX_MERGES_TEXT:,} (Llama 3 has 280,147): {CORRUPT_FILE}"
        )
    merges = []
    for merge in texts:
        left, space, right = merge.partition(" ")
        if not space:
            raise GGUFTokenizerError(f"{source}: {key} has {merge[:80]!r}, no pair")
        if len(left) + len(right) > MAX_PIECE_LENGTH:  # a merge makes one token of the two
            raise GGUFTokenizerError(
                f"{source}: {key} has a merge of {len(left) + len(right):,} characters "
                f"({merge[:40]!r}…); a token is at most {MAX_PIECE_LENGTH:,}: {CORRUPT_FILE}"
            )
        merges.append((left, right))
    return merges


def _strings(fields: Mapping[str, Any], key: str, source: str) -> list[str]:
    value = fields.get(key)
    if value is None:
        raise UnsupportedTokenizerError(f"{source}: {key} is missing: specd needs it")
    if not isinstance(value, list) or not value or not all(type(v) is str for v in value):
        raise GGUFTokenizerError(
            f"{source}: {key} is missing or not a list of strings: {CORRUPT_FILE}"
        )
    return value


_NUMBERS = {"integers": (int,), "numbers": (int, float)}


def _numbers(
    fields: Mapping[str, Any], key: str, source: str, length: int, kind: str
) -> list[Any] | None:
    """The list of `length` numbers of a `kind` (_NUMBERS) at `key`; None if it is absent."""
    value = fields.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != length:
        what = f"has {len(value)} entries" if isinstance(value, list) else f"is {short_repr(value)}"
        raise GGUFTokenizerError(f"{source}: {key} {what} for {length} tokens: {CORRUPT_FILE}")
    if not all(type(v) in _NUMBERS[kind] for v in value):
        raise GGUFTokenizerError(f"{source}: {key} is not a list of {kind}: {CORRUPT_FILE}")
    return value


def _token_id(fields: Mapping[str, Any], key: str, source: str, length: int) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    if type(value) is not int or not 0 <= value < length:
        raise GGUFTokenizerError(
            f"{source}: {key} is {short_repr(value)}, not a token id below {length}"
        )
    return value


def _flag(fields: Mapping[str, Any], key: str, source: str) -> bool | None:
    value = fields.get(key)
    if value is None or isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise GGUFTokenizerError(f"{source}: {key} is {short_repr(value)}, not true or false")
