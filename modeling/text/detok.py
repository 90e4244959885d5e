"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-fallback and byte-level tokenizers: a multi-byte
character may span tokens, and SentencePiece-style decoders strip the leading space of the
first token they see. So each step decodes a small window that starts a few tokens back
(the context makes the decoder treat the first new token as mid-text) and emits only what
is new, holding back while the window ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed generated ids, get text deltas. The deltas concatenate to exactly
    `decode(context + generated)[len(decode(context)):]` (with no context: `decode(generated)`)."""

    def __init__(self, tokenizer: Decoder, context_ids: Sequence[int] = (), context: int = 6):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context_ids[-context:]) if context_ids else []
        # ids[prefix:read] were already emitted; they are the decoder's context for the rest.
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is emitted as U+FFFD, as a
        full decode would)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        full = self.tokenizer.decode(self.ids[self.prefix :])
        if len(full) <= len(done) or (full.endswith(REPLACEMENT) and not final):
            return ""
        # The window's context decodes to `done` as before, so what follows it is new.
        new = full[len(done) :]
        self.prefix, self.read = self.read, len(self.ids)
        return new


class StopMatcher:
    """Stop strings that may span tokens. `push` returns the text that is safe to show:
    anything that could still be the start of a stop string is held back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            cut = min(i for i, _ in hits)
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = self._partial_suffix()
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:n]):
                    best = n
                    break
        return best
