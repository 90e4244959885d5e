"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-fallback and byte-level tokenizers: a multi-byte
character may span tokens, and SentencePiece-style decoders strip the leading space of the
first token they see. So each step decodes a small window that starts a few tokens back
(the context makes the decoder treat the first new token as mid-text) and emits only what
is new, holding back while the window ends in a character later bytes may still complete.
A window that ends in U+FFFD is decoded again with a few lone continuation bytes after it
(`_stable`): what they change may still change, what they leave is shown (a real U+FFFD,
bytes no character can continue); a tokenizer without lone byte tokens is not probed, and
its text is held while it ends in U+FFFD. The deltas are the full decode's text wherever
the model's bytes are UTF-8. Byte fallback decodes a run of `<0xNN>` pieces all or nothing:
one stray byte makes the whole run U+FFFD, the characters in it included. So bytes already
shown are never the context of new ones (`_window` leaves them out, putting the
tokenizer's `anchor` in front where nothing else is left), and a run of bytes is held only
while Python's UTF-8 decoder would hold it (`_incomplete_bytes`: a lead byte cut short is
final at once, not taken with the character after it), and bytes that are not UTF-8
among those not shown yet are shown apart from the text on each side (`_not_utf8`): the
stream reads the bytes as UTF-8 with one U+FFFD for each byte that is not, whatever the
split, where a decode of the whole reads U+FFFD for every byte of such a run (the newline
in `<0xF0><0x9F><0x98><0x0A>` too). A streamed text cannot take back what it showed.
"""

from __future__ import annotations

import codecs
from array import array
from collections.abc import Sequence
from typing import Protocol

from modeling.text.byte_level import PROBE_BYTES


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed generated ids, get text deltas. The deltas concatenate to exactly
    `decode(context + generated)[len(decode(context)):]` (with no context: `decode(generated)`)
    where the bytes are UTF-8 (see the module)."""

    def __init__(self, tokenizer: Decoder, context_ids: Sequence[int] = (), context: int = 6):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context_ids[-context:]) if context_ids else []
        # ids[prefix:read] were already emitted; they are the decoder's context for the rest.
        self.prefix = 0
        self.read = len(self.ids)
        self._context = 0  # how many of the last window's ids were its context
        self._silence: dict[int, bool] = {}  # token → it decodes to no text
        byte_tokens = getattr(tokenizer, "byte_tokens", None)
        # The lone continuation bytes a held character is probed with (None: no probing).
        self.probes = (
            [byte_tokens[b] for b in PROBE_BYTES] if isinstance(byte_tokens, dict) else None
        )
        self.fallback_bytes: frozenset[int] = getattr(tokenizer, "fallback_bytes", frozenset())
        self.anchor: int | None = getattr(tokenizer, "anchor", None)

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is emitted as U+FFFD, as a
        full decode would)."""
        return self._delta(final=True)

    def held_chars(self) -> int:
        """The whole characters of the tokens pushed but not shown yet (before a character
        they leave incomplete): where the next token's text begins, past what was shown. A
        space held with the first bytes of an emoji is before the emoji's last byte."""
        if self.read == len(self.ids):
            return 0
        window = self._window()
        done = self.tokenizer.decode(window[: self._context])
        return max(0, len(self.tokenizer.decode(window).rstrip(REPLACEMENT)) - len(done))

    def _window(self) -> list[int]:
        """The ids decoded this step: the context (the shown tokens ids[prefix:read], less
        byte fallback's bytes, with the anchor where only bytes were shown) and the tokens
        not shown yet. A shown character's bytes never join new ones: their run would decode
        all or nothing (a stray byte after "é" read both as U+FFFD, and "é" was lost)."""
        context = self.ids[self.prefix : self.read]
        if self.fallback_bytes and any(t in self.fallback_bytes for t in context):
            kept = [t for t in context if t not in self.fallback_bytes]
            if self.anchor is not None and not self.tokenizer.decode(kept):
                kept = [self.anchor, *kept]
            context = kept
        self._context = len(context)
        return [*context, *self.ids[self.read :]]

    def _delta(self, final: bool) -> str:
        out = ""
        if self.fallback_bytes:
            # Bytes that are not UTF-8 among those not shown: shown apart from the text on
            # each side, which byte fallback's all-or-nothing run would turn to U+FFFD too.
            while (cut := self._not_utf8()) is not None:
                out += self._through(cut)
        return out + self._delta_once(final)

    def _not_utf8(self) -> int | None:
        """How many of the tokens not shown yet to show as one piece where bytes among them
        are not UTF-8 (Python's decoder's first error): those before the error, or the
        error's own bytes where it comes first; None where every run may still be UTF-8."""
        unshown = self.ids[self.read :]
        run: list[tuple[int, int]] = []  # (token index in `unshown`, byte)
        for at, token in enumerate([*unshown, None]):
            if token is not None and token in self.fallback_bytes:
                raw = self.tokenizer.raw_bytes(token)  # type: ignore[attr-defined]
                run.append((at, raw[0]))
                continue
            if run and token is not None and self._silent(token):
                continue  # (a skipped special token: the run goes on through it)
            if run:
                try:
                    bytes(b for _, b in run).decode("utf-8")
                except UnicodeDecodeError as err:
                    cut_short = err.reason == "unexpected end of data"
                    if not (cut_short and token is None):  # (held: later bytes may end it)
                        first = run[err.start][0]
                        return first if first > 0 else run[err.end - 1][0] + 1
                run = []
        return None

    def _through(self, count: int) -> str:
        """The text of the next `count` tokens not shown yet, shown (on their own)."""
        window = self._window()
        done = self.tokenizer.decode(window[: self._context])
        part = self.tokenizer.decode(window[: self._context + count])
        self.prefix, self.read = self.read, self.read + count
        return part[len(done) :]

    def _delta_once(self, final: bool) -> str:
        window = self._window()
        done = self.tokenizer.decode(window[: self._context])
        full = self.tokenizer.decode(window)
        if len(full) <= len(done):
            return ""
        if full.endswith(REPLACEMENT) and not final:
            tail = self._incomplete_bytes(window)
            if tail is not None:  # byte fallback's run: held only where UTF-8 may go on
                if tail:
                    return self._all_but(window, done, tail)
            else:
                stable = self._stable(window, full)
                if stable < len(full):
                    return self._all_but_last(window, done, full, stable)
        # The window's context decodes to `done` as before, so what follows it is new.
        new = full[len(done) :]
        self.prefix, self.read = self.read, len(self.ids)
        return new

    def _incomplete_bytes(self, window: list[int]) -> int | None:
        """Of a window that ends in byte fallback's `<0xNN>` pieces (None: it does not), how
        many of its last ones are a character begun and not yet invalid, which later bytes
        may complete (Python's UTF-8 decoder holds exactly those). What comes before them is
        final: probing could not tell, since the run decodes all or nothing, and a byte
        that could never complete made the lead byte of a valid character after it read
        as U+FFFD for good (`<0xC3><0xC3><0xA9>` showed three, é lost)."""
        run: list[int] = []
        for token in reversed(window[self._context :]):
            if token not in self.fallback_bytes:
                if self._silent(token):  # (a special token the text leaves out: the run
                    continue  # goes on through it, as the decode's does)
                break
            raw = self.tokenizer.raw_bytes(token)  # type: ignore[attr-defined]
            if raw is None:
                return None
            run.append(raw[0])
        if not run:
            return None
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(bytes(reversed(run)))
        held = len(decoder.getstate()[0])
        # (as tokens: the held bytes' own, and the silent ones among and after them)
        tokens = 0
        for token in reversed(window):
            if not held:
                break
            tokens += 1
            held -= token in self.fallback_bytes
        return tokens

    def _silent(self, token: int) -> bool:
        """Whether `token` decodes to no text (a special token that is skipped)."""
        silent = self._silence.get(token)
        if silent is None:
            silent = self._silence[token] = not self.tokenizer.decode([token])
        return silent

    def _all_but(self, window: list[int], done: str, held: int) -> str:
        """The window's text but its last `held` tokens', shown; they are held alone."""
        part = self.tokenizer.decode(window[:-held])
        if len(part) <= len(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids) - held
        return part[len(done) :]

    def _stable(self, window: list[int], full: str) -> int:
        """How much of `full` (the window's text, ending in U+FFFD) no later token can change:
        the window is decoded again with one to three of each probe byte after it, and the
        text they leave alone is stable. Every incomplete character is completed by one of
        them (or, decoded all or nothing as byte fallback does, its whole run of bytes);
        a U+FFFD they leave alone is final: a real U+FFFD in the text, or bytes no UTF-8
        can continue (a stray byte token). Without probe tokens nothing is stable."""
        if self.probes is None:
            return 0
        stable = len(full)
        for probe in self.probes:
            for n in (1, 2, 3):
                probed = self.tokenizer.decode([*window, *[probe] * n])
                same = 0
                for a, b in zip(full, probed, strict=False):
                    if a != b:
                        break
                    same += 1
                stable = min(stable, same)
        return stable

    def _all_but_last(self, window: list[int], done: str, full: str, stable: int) -> str:
        """The window's text but its last token's, where all of it is stable: emitted, the
        last token held alone (a run of lead bytes no character completes held a growing
        window, decoded again at every step: quadratic). Else nothing."""
        if len(self.ids) - self.read < 2:
            return ""
        part = self.tokenizer.decode(window[:-1])
        if not (len(done) < len(part) <= stable and full.startswith(part)):
            return ""
        self.prefix, self.read = self.read, len(self.ids) - 1
        return part[len(done) :]


class StopMatcher:
    """Stop strings that may span tokens. `push` returns the text that is safe to show:
    anything that could still be the start of a stop string is held back.

    Each stop string is followed by a Knuth-Morris-Pratt automaton over the characters as
    they come (its state: the longest prefix of the stop that ends the text so far), so a
    character costs the same whatever is held back. Looking for each stop's every prefix
    at the end of what is held back cost a copy per prefix per token: sixteen stops of
    59,000 characters made each token cost 0.89 s of the engine's time."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # per stop: how much of it ends the text
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        base = len(self.pending) - len(text)  # where `text` begins in `pending`
        cut: int | None = None  # the earliest start of a stop found in this text
        for k, (stop, fail) in enumerate(zip(self.stops, self._fail, strict=True)):
            state, size = self._state[k], len(stop)
            for at, char in enumerate(text):
                while state and stop[state] != char:
                    state = fail[state - 1]
                if stop[state] == char:
                    state += 1
                if state == size:  # its first whole occurrence ends here
                    start = base + at + 1 - size
                    cut = start if cut is None else min(cut, start)
                    break
            self._state[k] = state
        if cut is not None:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = max(self._state)  # the longest tail that may begin a stop (a proper prefix)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class StopsOutsideCalls:
    """Stop strings for an answer that may be tool calls: a call's markup and arguments are
    generated under the request's grammar and are never cut (a stop of "}" or "\n" cut the
    arguments mid-object, or the whole required call, the Hermes format's newline); the
    stops apply once the answer is text. An answer is a call when it begins with `lead`
    (speculative/tool_calls.py `CallFormat.lead`; it can only begin there), so while it is
    still a prefix of `lead` its text is held."""

    def __init__(self, stops: Sequence[str], lead: str) -> None:
        self.matcher = StopMatcher(stops)
        self.lead = lead
        self.head = ""  # the answer's text while it may still become a call
        self.decided = False

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def push(self, text: str) -> str:
        if self.decided:
            return self.matcher.push(text)
        self.head += text
        if self.head.startswith(self.lead):
            self.matcher = StopMatcher(())  # calls: no stop string applies
        elif self.lead.startswith(self.head):
            return ""
        self.decided = True
        head, self.head = self.head, ""
        return self.matcher.push(head)

    def flush(self) -> str:
        head, self.head = self.head, ""
        return self.matcher.push(head) + self.matcher.flush()


def _failure(stop: str) -> array[int]:
    """KMP's table: for each prefix stop[: i + 1], the length of its longest proper prefix
    that is also its suffix (4 bytes a character: a request's stops may be a megabyte)."""
    fail = array("i", bytes(4 * len(stop)))
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail
