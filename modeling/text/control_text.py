"""A model's control tokens written as text in a request, kept as text.

A chat template writes its turns with control tokens (`<|im_start|>`, `<start_of_turn>`,
`<|eot_id|>`), and the rendered conversation is tokenized with them read as tokens. Text a
request sends (a message, a tool's result, an earlier call's arguments, a tool's schema, a
template variable) may spell one out: pasted from a web page, or on purpose, to open a
system turn of its own. OpenAI's API reads a message as text, and so does specd (vLLM and
llama.cpp read the token):

1. `guard`: the request's strings are searched by the tokenizer's own matcher (so a token
   it matches after normalizing, NFKC's `＜|im_end|＞`, is found as it would be read), and
   each control token found is swapped for a placeholder no template touches.
2. The template renders the guarded request.
3. `encode`: the rendering is tokenized as usual and cut at its control tokens, now all
   the template's own. A stretch between two of them that holds no placeholder keeps its
   ids; one that does has the spelled tokens put back and is tokenized by a copy of the
   tokenizer that reads control tokens as text, as the tokenizer reads a stretch after a
   control token (SentencePiece's leading `▁` only at the text's start).

A conversation without one (nearly all) is rendered and tokenized whole, as before.
Control tokens are the tokenizer's special added tokens (GGUF's control type, and the ids
it names) and the added tokens the chat template writes as markers (Qwen's `<tool_call>`,
DeepSeek-R1's `<｜User｜>`, not special); a reasoning model's think tags are read as tags
wherever they are written (an earlier answer sent back holds its reasoning between them),
and the unknown token the model writes for text it cannot spell is none, nor is a token
of one character or of word characters and spaces only (`_kept_apart`). Other added
tokens (Gemma's `<table>`) are read as the tokenizer reads them, in any text.

A request's strings are searched by a tokenizer that holds the added tokens alone
(`_finder`): the same matches, without a pre-tokenizer whose regex a hostile file made slow
on some run of characters. The rendering with the spelled tokens put back is bounded as
the template's own output is, and its start is counted before the rest is read.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Encoding
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from modeling.errors import tokenizer_failure


class ControlTokens:
    """A tokenizer's control tokens: found in a request's strings, and a guarded rendering
    tokenized with the spelled ones read as text."""

    def __init__(
        self, backend: HFTokenizer, kept: Sequence[str] = (), template: str | None = None
    ) -> None:
        """`kept`: control tokens read as tokens wherever they are written. `template`: the
        chat template's source, whose added tokens are control tokens too (DeepSeek-R1's
        turn markers `<｜User｜>` are not special)."""
        added = backend.get_added_tokens_decoder()
        self.backend = backend
        # The added tokens as the tokenizer finds them in a text, and nothing else (no
        # pre-tokenizer, no model): a hostile `Split` regex slow on some run of characters
        # never sees a whole string searched, and a template of 128 KiB is searched for
        # 570,000 added tokens at once (each searched for alone took minutes).
        self._finder, self._found = _finder(backend, added)
        # (the unknown token the model writes for text it cannot spell is no control token)
        model_unk = getattr(backend.model, "unk_token", None)
        unk = backend.token_to_id(model_unk) if isinstance(model_unk, str) else None
        written = set(self.find(template)) if template else set()
        self.control = frozenset(  # where a rendering is cut
            i
            for i, t in added.items()
            if i != unk
            and _kept_apart(t.content)
            and (t.special or (i in written and not any(c.isspace() for c in t.content)))
        )
        self.guarded = frozenset(i for i in self.control if added[i].content not in kept)
        # A string can spell one only where it holds the start of one: the others are not
        # tokenized to find out (code, full of `<`, took 2.2 times as long to prepare
        # with a first character as the start). The starts are their first three
        # characters, fewer where there would be more than PREFIXES of them (Gemma 3's
        # 6,000 `<unused…>` share one). A normalizer may make them from other characters
        # (NFKC's `＜`): then every string is searched.
        normalized = backend.normalizer is not None and any(
            added[i].normalized for i in self.guarded
        )
        starts: set[str] = set()
        for n in (3, 2, 1):
            starts = {added[i].content[:n] for i in self.guarded if added[i].content}
            if len(starts) <= PREFIXES:
                break
        self._may_spell = (
            re.compile("|".join(map(re.escape, sorted(starts))))
            if starts and len(starts) <= PREFIXES and not normalized
            else None
        )
        self._plain: tuple[HFTokenizer, str] | None = None
        self._anchor_id: int | None = None
        self._making = threading.Lock()

    def guard(self, values: Any) -> Guarded | None:
        """`values` (a request's messages, tools and template variables: JSON-shaped) with
        each spelled control token swapped for a placeholder; None where none spells one.
        Every string is searched whole, however long: a template may render a part of
        one (`| trim`, `[:n]`, Qwen3's text after `</think>`), so a string too long for
        the context may still put its tokens in a prompt that fits."""
        if not self.guarded:
            return None
        texts = [
            s
            for s in dict.fromkeys(_strings(values))
            if self._may_spell is None or self._may_spell.search(s)
        ]
        found: dict[str, list[tuple[int, int]]] = {}
        for text, read in zip(texts, _encode(self._finder, texts), strict=True):
            # (`offsets` and `ids` are made anew at each access)
            spans = [
                _core(text, a, b)
                for i, (a, b) in zip(read.ids, read.offsets, strict=True)
                if self._found.get(i) in self.guarded
            ]
            if spans:
                found[text] = spans
        if not found:
            return None
        nonce = secrets.token_hex(4)
        spelled: dict[str, int] = {}

        def swap(text: str) -> str:
            out: list[str] = []
            at = 0
            for i, j in found.get(text, ()):
                k = spelled.setdefault(text[i:j], len(spelled))
                out += [text[at:i], f"{PLACEHOLDER}{nonce}n{k}z"]
                at = j
            out.append(text[at:])
            return "".join(out)

        placeholder = re.compile(f"{PLACEHOLDER}{nonce}n([0-9]{{1,9}})z", re.IGNORECASE)
        return Guarded(_swapped(values, swap), placeholder, list(spelled))

    def find(self, text: str) -> list[int]:
        """The ids of the added tokens the tokenizer finds in `text`, in order."""
        (read,) = _encode(self._finder, [text])
        return [t for i in read.ids if (t := self._found.get(i)) is not None]

    def encode(self, rendered: str, guarded: Guarded, chars: int | None = None) -> list[int]:
        """The ids of the template's rendering of `guarded.values` (no BOS): its control
        tokens as tokens, the spelled ones as text. `chars`: only the start of the text
        with the spelled tokens put back, about that many characters (a prompt's start
        counted before the rest is read)."""
        if chars is not None:
            rendered = rendered[:chars]
        (read,) = _encode(self.backend, [rendered])
        ids: list[int] = []
        start = 0  # where the stretch after the last control token starts
        run: list[int] = []  # its ids
        for i, (a, b) in zip(read.ids, read.offsets, strict=True):
            if i in self.control:
                ids += self._stretch(rendered, start, a, run, guarded, chars)
                ids.append(i)
                start, run = b, []
            else:
                run.append(i)
        return ids + self._stretch(rendered, start, len(rendered), run, guarded, chars)

    def _stretch(
        self,
        rendered: str,
        a: int,
        b: int,
        ids: list[int],
        guarded: Guarded,
        chars: int | None = None,
    ) -> list[int]:
        """The ids of the text between two control tokens: `ids` as the tokenizer read it,
        unless it holds a placeholder (`chars`: `encode`'s)."""
        text = rendered[a:b]
        if not guarded.holds(text):
            return ids
        plain, anchor = self._plain_tokenizer()
        text = guarded.restore(text, chars)
        # After a token of its own the copy reads a stretch as one that follows a control
        # token; at the text's start, as the start. (The anchor's id, past the model's
        # vocabulary, never stays.)
        read = _encode(plain, [text if a == 0 else anchor + text])[0].ids
        read = [i for i in read if i != self._anchor_id]
        if self.control.isdisjoint(read):
            return read
        # A vocabulary whose merges build a control token's piece from its text (a
        # SentencePiece GGUF's, merges derived from every piece): its characters, each
        # read alone.
        return [t for i in read for t in (self._spelled(i) if i in self.control else [i])]

    def _spelled(self, token: int) -> list[int]:
        plain, anchor = self._plain_tokenizer()
        literal = self.backend.id_to_token(token) or ""
        reads = _encode(plain, [anchor + c for c in literal])
        drop = self.control | {self._anchor_id}
        return [t for read in reads for t in read.ids if t not in drop]

    def _plain_tokenizer(self) -> tuple[HFTokenizer, str]:
        """A copy of the tokenizer that reads its control tokens as text (the flag is the
        tokenizer's, and other requests tokenize meanwhile; the template's tokens that are
        not special are made so in the copy, and the special ones that are no control
        tokens are not), and an added token of its own to put before
        a stretch (not special, so read as a token): random, so that no request can write
        it. Made at the first request that needs it, once: 0.28 s and 62 MiB for a 262k
        vocabulary."""
        with self._making:
            if self._plain is None:
                spec = json.loads(self.backend.to_str())
                for t in spec.get("added_tokens") or []:
                    # (a special token that is no control token is read as the tokenizer
                    # reads it: as a token, matched though the copy reads specials as text)
                    t["special"] = t.get("id") in self.guarded
                plain = HFTokenizer.from_str(json.dumps(spec))
                plain.encode_special_tokens = True
                anchor = f"\ue000specd-{secrets.token_hex(8)}\ue000"
                plain.add_tokens([AddedToken(anchor, special=False, normalized=False)])
                self._anchor_id = plain.token_to_id(anchor)
                self._plain = plain, anchor
            return self._plain


# The most starts of control tokens `ControlTokens` looks for in a string before tokenizing
# it: each is an alternative of one regular expression, tried at each of the string's
# characters.
PREFIXES = 256

# A placeholder is ASCII letters and digits only, so that no template filter escapes it
# (tojson, HTML escaping) or trims it, and matched ignoring case (an `upper` filter).
PLACEHOLDER = "specdctl"


@dataclass(frozen=True)
class Guarded:
    values: Any  # the values, placeholders in place of spelled control tokens
    # A placeholder, its number captured: its nonce (8 random hex digits) makes a text that
    # looks like one not one.
    placeholder: re.Pattern[str]
    spelled: list[str]  # the spelled control tokens, by placeholder number

    def holds(self, text: str) -> bool:
        return self.placeholder.search(text) is not None

    def _spelling(self, match: re.Match[str]) -> str:
        """A placeholder's control token; a number no placeholder has (a template that
        rewrote one) stays as the template wrote it."""
        k = int(match.group(1))
        return self.spelled[k] if k < len(self.spelled) else match.group(0)

    def restore(self, text: str, chars: int | None = None) -> str:
        """`text` with each placeholder's control token spelled again (`chars`: its first
        that many characters, put back only so far)."""
        if chars is None:
            return self.placeholder.sub(self._spelling, text)
        parts: list[str] = []
        size = at = 0
        for match in self.placeholder.finditer(text):
            if size >= chars:
                break
            spelled = self._spelling(match)
            parts += [text[at : match.start()], spelled]
            size += match.start() - at + len(spelled)
            at = match.end()
        parts.append(text[at : at + max(chars - size, 0)])
        return "".join(parts)[:chars]

    def restored_size(self, text: str) -> int:
        """The characters of `restore(text)`, counted without making it: a control token
        longer than its placeholder grows the text where a template repeats it."""
        return len(text) + sum(
            len(self._spelling(m)) - len(m.group(0)) for m in self.placeholder.finditer(text)
        )


def _kept_apart(token: str) -> bool:
    """Whether a control token can be kept apart from a request's text: one made of word
    characters and spaces only (a tokenizer that makes `e`, `sop` or `\n` special), or a
    single character, is in the template's own text and the request's structure (`role`,
    `content`) alike, and every text spells it; it is read as the tokenizer reads it,
    wherever it is written. Real ones hold a mark (`<|im_end|>`, `[INST]`, `<s>`)."""
    return len(token) > 1 and not all(c.isalnum() or c == "_" or c.isspace() for c in token)


def _finder(
    backend: HFTokenizer, added: dict[int, AddedToken]
) -> tuple[HFTokenizer, dict[int, int]]:
    """A tokenizer that finds `backend`'s added tokens as it does (the same normalizer, each
    token's own matching options) and reads any other text as one unknown piece; and its
    ids' ids in `backend`. A `single_word` token is found inside a word too: the matcher
    passes it there, but the model's merges may still build its piece from the text
    (`x<|a|>` read as `x`, `<|a|>`), which a search that ran the model found."""
    unknown = f"\ue000specd-unk-{secrets.token_hex(8)}"
    finder = HFTokenizer(WordLevel({unknown: 0}, unknown))
    finder.normalizer = backend.normalizer
    finder.add_tokens(
        [
            AddedToken(
                t.content,
                single_word=False,
                lstrip=t.lstrip,
                rstrip=t.rstrip,
                normalized=t.normalized,
                special=t.special,
            )
            for t in added.values()
        ]
    )
    found: dict[int, int] = {}
    for t in added.values():
        own, theirs = finder.token_to_id(t.content), backend.token_to_id(t.content)
        if own is not None and theirs is not None:
            found[own] = theirs
    return finder, found


def _core(text: str, a: int, b: int) -> tuple[int, int]:
    """The span `text[a:b]` of a control token found without the spaces beside it that it
    strips (`lstrip`, `rstrip`): they stay text, for the template's own to strip."""
    core_a, core_b = a, b
    while core_a < core_b and text[core_a].isspace():
        core_a += 1
    while core_b > core_a and text[core_b - 1].isspace():
        core_b -= 1
    return (core_a, core_b) if core_a < core_b else (a, b)  # (a token of spaces: whole)


def _encode(backend: HFTokenizer, texts: list[str]) -> list[Encoding]:
    try:
        # (`encode_batch` releases the GIL while it works: modeling/text/tokenizer.py)
        return backend.encode_batch(texts, add_special_tokens=False)
    except BaseException as err:
        raise tokenizer_failure(err, "tokenize this text") from None


def request_chars(*values: Any) -> int:
    """The characters of every string in JSON-shaped values."""
    return sum(len(s) for s in _strings(values))


def _strings(root: Any) -> Iterable[str]:
    """Every string in a JSON-shaped value, its objects' keys too; a loop, not recursion
    (a request's parser allows more nesting than Python's stack)."""
    stack = [root]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            yield from (k for k in value if isinstance(k, str))
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)


def _swapped(root: Any, swap: Callable[[str], str]) -> Any:
    """A copy of a JSON-shaped value with `swap` applied to each string (keys too); lists
    and tuples become lists."""
    top: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(root, top, 0)]
    while stack:
        value, into, key = stack.pop()
        if isinstance(value, str):
            into[key] = swap(value)
        elif isinstance(value, dict):
            copy: dict[Any, Any] = {}
            into[key] = copy
            for k, v in value.items():
                k = swap(k) if isinstance(k, str) else k
                copy[k] = None
                stack.append((v, copy, k))
        elif isinstance(value, list | tuple):
            items: list[Any] = [None] * len(value)
            into[key] = items
            stack.extend((v, items, i) for i, v in enumerate(value))
        else:
            into[key] = value
    return top[0]
