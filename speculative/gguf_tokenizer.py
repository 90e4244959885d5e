"""The tokenizer a GGUF file describes in its metadata (`tokenizer.ggml.*`), as our `Tokenizer`.

A GGUF has no tokenizer.json: the vocabulary, its scores or merges, the token types, the
special ids and the chat template are metadata keys. From them we build the `tokenizers`
pipeline that transformers builds when it opens a GGUF (`integrations/gguf/
gguf_tokenizer_mapping.py`, transformers 5.24), the one in ../shared/models/stories260k's
tokenizer.json too:

- `llama` (SentencePiece): BPE over the pieces whose merge ranks follow the merged piece's
  score, byte fallback (`<0xNN>`) for characters with no piece, spaces as `▁` with one `▁`
  prepended to the text (Metaspace), and a decoder that undoes all three.
- `gpt2`: byte-level BPE with the file's merges, the text first split by the regex that
  `tokenizer.ggml.pre` names.

Where llama.cpp tokenizes an SPM text differently we follow transformers, which the rest of
specd and its references are checked against. llama.cpp's SPM rule (merge the adjacent pair
whose union is the best-scoring piece, the leftmost on a tie) is this BPE, so most texts
agree, "The little dog" included (▁The ▁little ▁do g from both; tests/test_gguf_tokenizer.py
writes llama.cpp's rule out). They part on the prefix space: llama.cpp prepends one to every
stretch of text that starts the prompt or follows a special token, even a stretch that
starts with a space, where Metaspace prepends only to a text that does not start with one,
and only at its start: " lead" is ▁▁lead there and ▁lead here, "<s>Hi" is <s> ▁Hi there and
<s> Hi here. (Older tokenizer.json files, Llama 2's, prepend always, as llama.cpp does.) On
score ties between different pieces the merge rank decides here, the position there.

Where transformers' GGUF path departs from both llama.cpp and the model's tokenizer.json we
follow those two: `llama-bpe` takes a word found whole in the vocabulary whole
(`ignore_merges`) and adds BOS unless the file says otherwise; control and user-defined
tokens keep the spelling the file gives them (byte-level respelling is for normal tokens),
so `<｜end▁of▁sentence｜>` is matched whole; `add_space_prefix` false is honoured; and a
generation ends at EOS, EOT, EOM or the end-of-turn tokens llama.cpp knows by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from speculative.tokenizer import Tokenizer

# tokenizer.ggml.token_type values
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex; None is GPT-2's own, which ByteLevel applies itself
# (transformers' choice for `default` too; llama.cpp's BPE `default` first cuts punctuation).
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp sets ignore_merges and add_bos for these, as Meta's tokenizer.json does.
_LLAMA3_PRES = frozenset({"llama-bpe", "llama3", "llama-v3"})
# Tokens llama.cpp ends a generation at by their text alone (llama-vocab.cpp, "EOG").
END_OF_TURN_TOKENS = frozenset(
    {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"}
    | {"<EOT>", "<|end_of_text|>"}
)
# Gemma's sentencepiece files rank merges by token position, not score (transformers'
# gemma_tokenizer): built from scores they would tokenize wrong, so we refuse them.
_UNSUPPORTED_SPM_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


class GGUFTokenizerError(ValueError):
    """The file's tokenizer metadata is missing, malformed or of a kind we cannot build."""


def tokenizer_from_gguf(fields: Mapping[str, Any], source: str) -> Tokenizer:
    """Our `Tokenizer` for the metadata `fields` (as `gguf_file.read_gguf` reads them) of the GGUF
    file `source` (named in errors)."""
    model = fields.get("tokenizer.ggml.model")
    tokens = _strings(fields, "tokenizer.ggml.tokens", source)
    types = _token_types(fields, source, len(tokens))
    ids = {
        name: _token_id(fields, f"tokenizer.ggml.{name}_token_id", source, len(tokens))
        for name in ("bos", "eos", "unknown", "padding", "eot", "eom")
    }
    # Matched whole in any text: control and unknown tokens, and the ids the file names.
    special = {i for i, kind in enumerate(types) if kind in (UNKNOWN, CONTROL)}
    special |= {i for i in ids.values() if i is not None}
    user_defined = [i for i, kind in enumerate(types) if kind == USER_DEFINED]
    if model == "llama":
        backend = _sentencepiece(fields, tokens, ids["unknown"], source)
        add_bos_default = True
    elif model == "gpt2":
        pre = fields.get("tokenizer.ggml.pre", "default")
        backend = _byte_level(fields, tokens, special | set(user_defined), pre, source)
        add_bos_default = pre in _LLAMA3_PRES
    else:
        raise GGUFTokenizerError(
            f"{source}: tokenizer.ggml.model is {model!r}; specd builds 'llama' "
            "(SentencePiece) and 'gpt2' (byte-level BPE) tokenizers"
        )
    backend.add_special_tokens(
        [AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special)]
    )
    backend.add_tokens(
        [AddedToken(tokens[i], normalized=False, special=False) for i in user_defined]
    )

    bos = tokens[ids["bos"]] if ids["bos"] is not None else None
    eos = tokens[ids["eos"]] if ids["eos"] is not None else None
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    if fields.get("tokenizer.ggml.add_eos_token") and eos is not None:
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
        chat_template=fields.get("tokenizer.chat_template"),
    )


def _sentencepiece(
    fields: Mapping[str, Any], tokens: list[str], unknown: int | None, source: str
) -> HFTokenizer:
    architecture = fields.get("general.architecture")
    if architecture in _UNSUPPORTED_SPM_ARCHITECTURES:
        raise GGUFTokenizerError(
            f"{source}: general.architecture {architecture!r} ranks its sentencepiece merges by "
            "token position, which specd does not build; load the model's folder instead"
        )
    scores = _scores(fields, source, len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges_from_scores(tokens, scores),
            unk_token=tokens[unknown] if unknown is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the space Metaspace prepended
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges for a sentencepiece vocabulary: every split of a piece into two pieces,
    ranked by the whole piece's score, best first. Applying them lowest rank first is
    sentencepiece's (and llama.cpp's) rule: merge the adjacent pair whose union scores best.
    Equal scores: longer left part, then longer right part, then vocabulary order, as
    transformers' `generate_merges` orders them."""
    index = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                ranked.append((-score, -len(left), -len(right), left, right))
    ranked.sort(key=lambda merge: merge[:3])  # stable: vocabulary order within a tie
    return [(left, right) for *_, left, right in ranked]


def _byte_level(
    fields: Mapping[str, Any], tokens: list[str], keep: set[int], pre: Any, source: str
) -> HFTokenizer:
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFTokenizerError(
            f"{source}: tokenizer.ggml.pre {pre!r} names a pre-tokenizer specd does not know; "
            f"known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    merges = []
    for merge in _strings(fields, "tokenizer.ggml.merges", source):
        left, space, right = merge.partition(" ")
        if not space:
            raise GGUFTokenizerError(f"{source}: tokenizer.ggml.merges has {merge!r}, no pair")
        merges.append((left, right))
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
    backend = HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre in _LLAMA3_PRES))
    split = PRE_TOKENIZER_SPLITS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    if split is not None:
        split_words = pre_tokenizers.Split(Regex(split), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split_words, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character table: printable bytes stand for themselves, the rest are
    shifted past 255 so that no token holds a space or a control character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(shifted)}


def _strings(fields: Mapping[str, Any], key: str, source: str) -> list[str]:
    value = fields.get(key)
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise GGUFTokenizerError(f"{source}: {key} is missing or not a list of strings")
    return value


def _token_types(fields: Mapping[str, Any], source: str, length: int) -> list[int]:
    value = fields.get("tokenizer.ggml.token_type")
    if value is None:  # older converters: all normal, the named special ids aside
        return [1] * length
    return _sized(value, "tokenizer.ggml.token_type", source, length)


def _scores(fields: Mapping[str, Any], source: str, length: int) -> list[float]:
    key = "tokenizer.ggml.scores"
    if fields.get(key) is None:
        raise GGUFTokenizerError(f"{source}: {key} is missing (a 'llama' tokenizer needs it)")
    return _sized(fields[key], key, source, length)


def _sized(value: Any, key: str, source: str, length: int) -> list[Any]:
    if not isinstance(value, list) or len(value) != length:
        size = len(value) if isinstance(value, list) else type(value).__name__
        raise GGUFTokenizerError(f"{source}: {key} has {size} entries for {length} tokens")
    return value


def _token_id(fields: Mapping[str, Any], key: str, source: str, length: int) -> int | None:
    value = fields.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < length:
        raise GGUFTokenizerError(f"{source}: {key} is {value!r}, not a token id below {length}")
    return value
