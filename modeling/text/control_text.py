"""A model's control tokens written as text in a request, kept as text.

A chat template writes its turns with control tokens (`<|im_start|>`, `<start_of_turn>`,
`<|eot_id|>`) and the rendered conversation is tokenized with them read as tokens. Text a
request sends (a message, a tool's result, an earlier call's arguments, a tool's schema)
may spell one of them out: pasted from a web page, or on purpose, to open a system turn of
its own. OpenAI's API reads a message as text, and so does specd: before rendering, each
control token spelled in a request's strings is swapped for a placeholder no template
touches; the rendered text is cut at the placeholders and each spelled token is tokenized
as the plain text it is (`Tokenizer.encode_chat`). A conversation without one (nearly all)
is rendered and tokenized exactly as before, whole.

Control tokens are the tokenizer's special added tokens (GGUF's control and unknown
types); a reasoning model's think tags are read as tags wherever they are written (an
earlier answer sent back holds its reasoning between them).
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    from modeling.text.tokenizer import Tokenizer


class ControlText:
    """Where a tokenizer's control tokens are spelled out in a text."""

    def __init__(self, literals: Iterable[str]) -> None:
        self.literals = frozenset(t for t in literals if t)
        # One regular expression, the literals as a tree of their shared starts (Gemma 3's
        # six thousand `<unused…>` share theirs): each position of a text costs the few
        # characters it shares with one, in C. An alternation of the literals tried each
        # in turn took 46 s on a megabyte of `<`. A tree branching more than
        # TRIE_DEPTH times along one literal (no real tokenizer's) is searched from the
        # literals' first characters instead.
        tree = _tree(self.literals)
        self._pattern = re.compile(_pattern(tree)) if 0 < _branches(tree) <= TRIE_DEPTH else None
        lengths: dict[str, set[int]] = {}
        for t in self.literals:
            lengths.setdefault(t[0], set()).add(len(t))
        self._lengths = {c: sorted(n, reverse=True) for c, n in lengths.items()}
        first = "".join(map(re.escape, sorted(lengths)))
        self._starts = re.compile(f"[{first}]") if first else None

    def spans(self, text: str) -> list[tuple[int, int]]:
        """The spelled control tokens in `text`, leftmost first, the longest where one
        begins another (`<|im_start|>` and `<|im_start|>x`: as the tokenizer reads them),
        not overlapping."""
        if self._pattern is not None:
            return [m.span() for m in self._pattern.finditer(text)]
        if self._starts is None:
            return []
        found: list[tuple[int, int]] = []
        at = 0
        while (m := self._starts.search(text, at)) is not None:
            i = m.start()
            at = i + 1
            for n in self._lengths[text[i]]:
                if i + n <= len(text) and text[i : i + n] in self.literals:
                    found.append((i, i + n))
                    at = i + n
                    break
        return found

    def guard(self, values: Any) -> Guarded | None:
        """`values` (a request's messages, tools and template variables: JSON-shaped) with
        every spelled control token swapped for a placeholder, or None where none has one."""
        if not self.literals or not any(self.spans(s) for s in _strings(values)):
            return None
        nonce = secrets.token_hex(8)
        spelled: dict[str, int] = {}

        def swap(text: str) -> str:
            spans = self.spans(text)
            if not spans:
                return text
            out: list[str] = []
            at = 0
            for i, j in spans:
                k = spelled.setdefault(text[i:j], len(spelled))
                out += [text[at:i], f"{PLACEHOLDER}{nonce}n{k}z"]
                at = j
            out.append(text[at:])
            return "".join(out)

        return Guarded(_swapped(values, swap), nonce, list(spelled))


class ControlTokens(ControlText):
    """A tokenizer's control tokens: where a text spells them, and a rendering's pieces
    tokenized with the spelled ones read as text."""

    def __init__(self, backend: HFTokenizer, kept: Sequence[str] = ()) -> None:
        """`kept`: control tokens read as tokens wherever they are written."""
        added = backend.get_added_tokens_decoder()
        super().__init__(t.content for t in added.values() if t.special and t.content not in kept)
        self.backend = backend
        # A control token to put before a piece that continues a text: the tokenizer cuts
        # a text at its control tokens and reads each stretch between them on its own,
        # and one after a control token as it follows it (a SentencePiece tokenizer that
        # writes its `▁` only at a text's start does not write it there). One that strips
        # no space beside it.
        self._anchor = next(
            (
                t.content
                for t in added.values()
                if t.special and not (t.lstrip or t.rstrip or t.normalized)
            ),
            None,
        )
        self._anchor_id = backend.token_to_id(self._anchor) if self._anchor else None

    def encode(
        self, tok: Tokenizer, pieces: list[tuple[str, bool]], bos: bool, at_most: int | None
    ) -> list[int]:
        """The ids of a rendering's pieces (`Guarded.pieces`): each read as it follows the
        one before, as if the text were tokenized whole with the spelled control tokens
        written as text; BOS before the first where `bos`."""
        ids: list[int] = tok.encode("") if bos else []
        for n, (piece, spelled) in enumerate(pieces):
            if spelled:
                ids += self._as_text(piece, first=n == 0)
            elif n == 0 or self._anchor is None:
                ids += tok.encode(piece, add_special_tokens=False, at_most=at_most)
            else:
                read = tok.encode(self._anchor + piece, add_special_tokens=False, at_most=at_most)
                ids += read[1:] if read[:1] == [self._anchor_id] else read
        return ids

    @functools.cached_property
    def _plain(self) -> tuple[HFTokenizer, int]:
        """A copy of the tokenizer that reads its control tokens as text (the flag is the
        tokenizer's, and other requests tokenize meanwhile), with an anchor of its own to
        read a text as one that follows a token (a control token is text to it): a
        non-special added token no text holds. Made at the first request that needs it
        (a second tokenizer in memory: 0.15 s and some megabytes for SmolLM2's 49k
        tokens)."""
        plain = HFTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        plain.add_tokens([AddedToken(ANCHOR, special=False, normalized=False)])
        anchor = plain.token_to_id(ANCHOR)
        assert anchor is not None
        return plain, anchor

    def _as_text(self, literal: str, first: bool) -> list[int]:
        from modeling.text.tokenizer import _failure  # (it imports this module)

        plain, anchor = self._plain
        text = literal if first else ANCHOR + literal
        try:
            ids = plain.encode_batch([text], add_special_tokens=False)[0].ids
        except BaseException as err:
            raise _failure(err, "tokenize this text") from None
        return ids[1:] if not first and ids[:1] == [anchor] else ids


# What the plain copy reads as one token before a spelled control token (`ControlTokens`).
ANCHOR = "\ue000specd-anchor\ue000"

# The most branches along one literal's path in `ControlText`'s tree: each is a group
# nested in the expression, which Python compiles recursively (300 compile).
TRIE_DEPTH = 128

# The end of a literal in `_tree`'s nodes.
END = ""


def _tree(literals: Iterable[str]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for t in literals:
        node = root
        for c in t:
            node = node.setdefault(c, {})
        node[END] = {}
    return root


def _branches(root: dict[str, Any]) -> int:
    """The most nodes of more than one way on one path down the tree (0: an empty one)."""
    most = 0
    stack = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        depth += len(node) > 1
        most = max(most, depth)
        stack.extend((child, depth) for c, child in node.items() if c != END)
    return most if root else 0


def _pattern(node: dict[str, Any]) -> str:
    """The expression matching the literals below `node`, longest first: a chain of one
    way is its characters; a branch, a group of the ways (one per next character, so at
    most one matches), optional where a literal ends here (tried after, so a longer one
    wins). Recursion at most TRIE_DEPTH branches deep, plus chains (walked in a loop)."""
    chain: list[str] = []
    while len(node) == 1 and END not in node:
        ((c, node),) = node.items()
        chain.append(re.escape(c))
    ways = [re.escape(c) + _pattern(child) for c, child in sorted(node.items()) if c != END]
    head = "".join(chain)
    if not ways:
        return head
    group = "(?:" + "|".join(ways) + ")"
    return head + (group + "?" if END in node else group)


# A placeholder is ASCII letters and digits only, so that no template filter escapes it
# (tojson, HTML escaping) or trims it, and matched ignoring case (an `upper` filter).
PLACEHOLDER = "specdctl"


@dataclass(frozen=True)
class Guarded:
    values: Any  # the values, placeholders in place of spelled control tokens
    nonce: str  # 16 random hex digits: no text of the request's contains a placeholder
    spelled: list[str]  # the control tokens spelled, by placeholder number

    def pieces(self, rendered: str) -> list[tuple[str, bool]]:
        """The template's rendering as (text, spelled) pieces: template text and request
        text to tokenize as usual, and spelled control tokens to tokenize as plain text."""
        pattern = re.compile(f"{PLACEHOLDER}{self.nonce}n(\\d+)z", re.IGNORECASE)
        parts = pattern.split(rendered)
        out: list[tuple[str, bool]] = []
        for n, part in enumerate(parts):
            if n % 2:
                out.append((self.spelled[int(part)], True))
            elif part:
                out.append((part, False))
        return out


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


def _swapped(root: Any, swap: Any) -> Any:
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
