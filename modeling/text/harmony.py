"""OpenAI's harmony format (gpt-oss): an assistant turn is one or more messages, each a
header and a body,

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

the header naming the channel (`analysis`: reasoning, not for the user; `final`: the
answer; `commentary`: preambles and tool calls, `to=functions.NAME`) and the markers being
special tokens. The tokenizer keeps these markers in its decoded text for such a model
(`Tokenizer.harmony`), and `HarmonyReader` reads that text, as it streams, into the answer
and its reasoning; `<|return|>` and `<|call|>` end the turn (they are stop tokens).

Text that does not begin as a harmony message (a raw completion, or a model that skips the
format) is passed through as the answer, any marker in it dropped (a stray special token is
not text, as any other model's would not be). A header is bounded: one longer than
`MAX_HEADER` characters without its `<|message|>` is read as the answer's text too.
"""

from __future__ import annotations

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CONSTRAIN, CALL, RETURN)
STOPS = (RETURN, CALL)  # what ends an assistant's turn
MAX_HEADER = 512
_BODY_ENDS = (END, CALL, RETURN, START)


def _held(text: str) -> int:
    """How many characters at the end of `text` could begin a marker (kept back)."""
    for n in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in MARKERS):
            return n
    return 0


class HarmonyReader:
    """`feed` the decoded text of an assistant's turn as it comes; each call returns events
    `("content", text)` (the answer) and `("reasoning", text)` (the analysis channel), and
    `finish` returns what was held back. However the text is split, the events add up to
    the same answer and reasoning."""

    def __init__(self) -> None:
        self.buffer = ""  # text not read yet (a header's so far, or a body's held tail)
        self.state = "header"  # "header", "body", or "plain" (not harmony: passed through)
        self.kind = "content"  # where the current body goes

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        out: list[tuple[str, str]] = []
        while self.buffer:
            if self.state == "plain":  # markers here are stray special tokens: not text
                text = self.buffer
                for marker in MARKERS:
                    text = text.replace(marker, "")
                keep = _held(text)
                out.append(("content", text[: len(text) - keep]))
                self.buffer = text[len(text) - keep :]
                break
            elif self.state == "header":
                if not self._read_header():
                    break
            elif not self._read_body(out):
                break
        return [e for e in out if e[1]]

    def finish(self) -> list[tuple[str, str]]:
        """What is left: a body's held tail, or plain text; an unfinished header (the turn
        cut off inside it) is structure, not text, and is dropped."""
        out = [(self.kind if self.state == "body" else "content", self.buffer)]
        if self.state == "header":
            out = []
        self.buffer = ""
        return [e for e in out if e[1]]

    def _read_header(self) -> bool:
        """Up to the header's `<|message|>`; False while more text is needed."""
        text = self.buffer
        if not text.startswith((START, CHANNEL)):
            if any(m.startswith(text) for m in (START, CHANNEL)):
                return False  # a marker's first characters: wait for the rest
            self.state = "plain"  # not a harmony message
            return True
        at = text.find(MESSAGE)
        if at < 0:
            if len(text) > MAX_HEADER:  # no message is coming: read it as the answer
                self.state = "plain"
                return True
            return False
        self.kind = _kind(text[:at])
        self.buffer = text[at + len(MESSAGE) :]
        self.state = "body"
        return True

    def _read_body(self, out: list[tuple[str, str]]) -> bool:
        """Up to the body's end marker; False (what is safe emitted) while more is needed."""
        ends = [(at, m) for m in _BODY_ENDS if (at := self.buffer.find(m)) >= 0]
        if not ends:
            keep = _held(self.buffer)
            out.append((self.kind, self.buffer[: len(self.buffer) - keep]))
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        at, marker = min(ends)
        out.append((self.kind, self.buffer[:at]))
        # A `<|start|>` opens the next header itself; the others end this message.
        self.buffer = self.buffer[at:] if marker == START else self.buffer[at + len(marker) :]
        self.state = "header"
        return True


def _kind(header: str) -> str:
    """Where a message's body goes, from its header: the analysis channel is reasoning,
    everything else (final, commentary) the answer."""
    channel = header.rsplit(CHANNEL, 1)[-1] if CHANNEL in header else ""
    name = channel.split("<|", 1)[0].split()
    return "reasoning" if name and name[0] == "analysis" else "content"


def read_turn(text: str) -> tuple[str, str]:
    """A whole turn's (answer, reasoning)."""
    reader = HarmonyReader()
    events = reader.feed(text) + reader.finish()
    answer = "".join(t for kind, t in events if kind == "content")
    reasoning = "".join(t for kind, t in events if kind == "reasoning")
    return answer, reasoning
