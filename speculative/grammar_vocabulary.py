"""The grammar engine's (llguidance's) view of a model's vocabulary: built once per
tokenizer, kept while the tokenizer lives, and, where the engine cannot read it, why not,
kept too (speculative/grammar.py compiles and runs grammars against it)."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import llguidance

from modeling.errors import panic_said, rust_panic
from speculative.grammar_errors import GrammarError

log = logging.getLogger("specd.grammar")

# Per tokenizer: the engine's view of it, or why the engine cannot read it.
_VOCABULARIES: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer | str] = (
    weakref.WeakKeyDictionary()
)
MAX_ENGINE_TOKEN_BYTES = 1023  # the engine's token trie: longer tokens panic it
_VOCABULARY_LOCK = threading.Lock()


def vocabulary(tokenizer: Any, field: str = "response_format") -> llguidance.LLTokenizer:
    """The engine's view of `tokenizer` (modeling/text/tokenizer.py), built once per
    tokenizer (about a second at 128k entries) and kept while the tokenizer lives. Its
    end-of-sequence tokens are the tokenizer's (a finished grammar allows only those). A
    vocabulary the engine cannot read is a GrammarError naming `field` (the request's
    grammar), remembered: the engine panics on a token of over 1,023 bytes, which a GGUF
    or tokenizer.json may hold, and trying again cost each request seconds."""
    with _VOCABULARY_LOCK:
        known = _VOCABULARIES.get(tokenizer)
        if known is None:
            try:
                known = _engine_vocabulary(tokenizer)
            except BaseException as exc:
                if not rust_panic(exc):
                    raise
                known = _unreadable(tokenizer, exc)
            _VOCABULARIES[tokenizer] = known
    if isinstance(known, str):
        raise GrammarError(
            f"{field} cannot be used with this model: {known}", field, "unsupported_grammar"
        )
    return known


def _engine_vocabulary(tokenizer: Any) -> llguidance.LLTokenizer:
    eos = list(tokenizer.eos_token_ids) or None
    try:
        read = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=eos)
    except ValueError:
        # A tokenizer whose decoder the engine does not read (a word-level one joins words
        # with spaces): its pieces as they are spelled in its vocabulary.
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Pieces(tokenizer)), eos_token=eos
        )
    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder()
    misread = [i for i, t in added.items() if not t.special and read.is_special_token(i)]
    if not misread:
        return read
    # The engine reads every added token spelled `<...>` as a special token, which text
    # cannot match, whatever tokenizer.json says: Qwen's `<tool_call>` and `<think>` are
    # text there, and a grammar's "<tool_call>" had to be spelled from the bytes `<`,
    # `tool`, ... with the model's own token masked. Read again with the tokenizer's own
    # special tokens only, each token's bytes as the engine first read them.
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_AsDeclared(tokenizer, read)), eos_token=eos
    )


def _unreadable(tokenizer: Any, panic: BaseException) -> str:
    """Why the engine cannot read `tokenizer`'s vocabulary, said once in the log."""
    longest = max(tokenizer.vocabulary, key=lambda piece: len(piece.encode()), default="")
    size = len(longest.encode())
    why = (
        f"its vocabulary holds a token of {size:,} bytes (id {tokenizer.vocabulary[longest]}); "
        f"the grammar engine reads tokens of at most {MAX_ENGINE_TOKEN_BYTES:,}"
        if size > MAX_ENGINE_TOKEN_BYTES
        else "the grammar engine cannot read its vocabulary (" + panic_said(panic) + ")"
    )
    log.warning("structured output is unavailable with this model: %s", why)
    return why


class _Pieces:
    """What llguidance's TokenizerWrapper reads: each id's piece as bytes, the special ids,
    and the encoder."""

    def __init__(self, tokenizer: Any) -> None:
        backend = tokenizer.backend
        size = backend.get_vocab_size(with_added_tokens=True)
        self.tokens = [(backend.id_to_token(i) or "").encode() for i in range(size)]
        special = {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
        # The unknown, begin and end tokens are markers, not text, even where the tokenizer
        # does not declare them as added special tokens (a word-level vocabulary).
        unk = getattr(backend.model, "unk_token", None)
        markers = [backend.token_to_id(unk) if unk else None, tokenizer.bos_id]
        special |= {i for i in [*markers, *tokenizer.eos_token_ids] if i is not None}
        self.special_token_ids = sorted(special)
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_id
        self._backend = backend

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._backend.encode(text, add_special_tokens=False).ids)


class _AsDeclared:
    """What llguidance's TokenizerWrapper reads: each token's bytes as the engine read them
    from tokenizer.json (`read`), and as special only the tokens the tokenizer declares
    special (and its end and begin markers)."""

    def __init__(self, tokenizer: Any, read: llguidance.LLTokenizer) -> None:
        backend = tokenizer.backend
        size = read.vocab_size
        self.tokens = [read.decode_bytes([i]) for i in range(size)]
        special = {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
        markers = [tokenizer.bos_id, *tokenizer.eos_token_ids]
        special |= {i for i in markers if i is not None and i < size}
        self.special_token_ids = sorted(i for i in special if i < size)
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_id
        self._read = read

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, str):
            text = text.encode()
        return list(self._read.tokenize_bytes(text))
