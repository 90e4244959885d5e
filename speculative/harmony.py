"""OpenAI's harmony format (gpt-oss): an assistant turn is one or more messages, each a
header and a body,

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

the header naming the channel (`analysis`: reasoning, not for the user; `final`: the
answer; `commentary`: preambles and tool calls) and the markers being special tokens. A
tool call is a message whose header names its recipient, its body the arguments:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The tokenizer keeps these markers in its decoded text for such a model
(`Tokenizer.harmony`), and `HarmonyReader` reads that text, as it streams, into the answer,
its reasoning and its calls; `<|return|>` and `<|call|>` end the turn (stop tokens).

Text that does not begin as a harmony message (a raw completion, or a model that skips the
format) is passed through as the answer, any marker in it dropped (a stray special token is
not text, as any other model's would not be). A header is bounded: one longer than
`MAX_HEADER` characters without its `<|message|>` is read as the answer's text too.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

from modeling.errors import RequestError
from modeling.text.harmony import CALL, CHANNEL, CONSTRAIN, END, MARKERS, MESSAGE, RETURN, START
from speculative.grammar import Grammar
from speculative.tool_calls import Tool, ToolCall

MAX_HEADER = 512
_BODY_ENDS = (END, CALL, RETURN, START)
# A header's recipient: `to=functions.NAME` (the function's name as OpenAI allows them)
_RECIPIENT = re.compile(r"\bto=(\S*)")
_FUNCTION = re.compile(r"functions\.([A-Za-z0-9_-]{1,64})")


def _held(text: str) -> int:
    """How many characters at the end of `text` could begin a marker (kept back)."""
    for n in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in MARKERS):
            return n
    return 0


class HarmonyReader:
    """`feed` the decoded text of an assistant's turn as it comes; each call returns events
    `("content", text)` (the answer), `("reasoning", text)` (the analysis channel), and for
    a tool call `("call", index, id, name)` then `("arguments", index, text)` pieces (the
    deltas OpenAI streams, as speculative/tool_calls.py's CallStream gives them); `finish`
    returns what was held back. However the text is split, the events add up alike."""

    def __init__(self, allow_calls: bool = True) -> None:
        self.calls_allowed = allow_calls  # False: a message to a function is no call either
        self.buffer = ""  # text not read yet (a header's so far, or a body's held tail)
        self.state = "header"  # "header", "body", or "plain" (not harmony: passed through)
        self.kind = "content"  # where the current body goes: content, reasoning, arguments
        self.calls = 0  # calls begun

    def feed(self, text: str) -> list[tuple[Any, ...]]:
        self.buffer += text
        out: list[tuple[Any, ...]] = []
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
                if not self._read_header(out):
                    break
            elif not self._read_body(out):
                break
        return [e for e in out if e[-1]]

    def finish(self) -> list[tuple[Any, ...]]:
        """What is left: a body's held tail, or plain text; an unfinished header (the turn
        cut off inside it) is structure, not text, and is dropped."""
        out = [self._piece(self.buffer) if self.state == "body" else ("content", self.buffer)]
        if self.state == "header":
            out = []
        self.buffer = ""
        return [e for e in out if e[-1]]

    def _piece(self, text: str) -> tuple[Any, ...]:
        if self.kind == "arguments":
            return ("arguments", self.calls - 1, text)
        return (self.kind, text)

    def _read_header(self, out: list[tuple[Any, ...]]) -> bool:
        """Up to the header's `<|message|>`; False while more text is needed."""
        text = self.buffer
        if not text.startswith((START, CHANNEL)):
            if any(m.startswith(text) for m in (START, CHANNEL)):
                return False  # a marker's first characters: wait for the rest
            self.state = "plain"  # not a harmony message
            return True
        # A header is at most MAX_HEADER characters, wherever the text was cut into pieces:
        # a `<|message|>` further on is not looked for (a whole turn read it as a message
        # and the same turn streamed as text, by how its rounds happened to batch).
        at = text.find(MESSAGE, 0, MAX_HEADER + len(MESSAGE))
        if at < 0:
            if len(text) >= MAX_HEADER + len(MESSAGE):  # no message is coming: the answer
                self.state = "plain"
                return True
            return False
        self.kind, recipient = _kind(text[:at])
        if recipient is not None and not self.calls_allowed:
            self.kind, recipient = "reasoning", None  # (tool_choice none: no call is made)
        if recipient is not None:  # a tool call: its header names the function
            out.append(("call", self.calls, "call_" + secrets.token_hex(12), recipient))
            self.calls += 1
        self.buffer = text[at + len(MESSAGE) :]
        self.state = "body"
        return True

    def _read_body(self, out: list[tuple[Any, ...]]) -> bool:
        """Up to the body's end marker; False (what is safe emitted) while more is needed."""
        ends = [(at, m) for m in _BODY_ENDS if (at := self.buffer.find(m)) >= 0]
        if not ends:
            keep = _held(self.buffer)
            out.append(self._piece(self.buffer[: len(self.buffer) - keep]))
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        at, marker = min(ends)
        out.append(self._piece(self.buffer[:at]))
        # A `<|start|>` opens the next header itself; the others end this message.
        self.buffer = self.buffer[at:] if marker == START else self.buffer[at + len(marker) :]
        self.state = "header"
        return True


def _kind(header: str) -> tuple[str, str | None]:
    """Where a message's body goes, from its header, and the function it calls: a header
    naming a function (`to=functions.NAME`, in the role's part or the channel's) makes the
    body a call's arguments, one to a built-in tool reasoning; else the analysis channel is
    reasoning and everything else (final, commentary) the answer."""
    to = _RECIPIENT.search(header)
    if to is not None:
        function = _FUNCTION.fullmatch(to.group(1).split("<|", 1)[0])
        if function is not None:
            return "arguments", function.group(1)
        return "reasoning", None  # to a built-in tool (browser, python): not for the user
    channel = header.rsplit(CHANNEL, 1)[-1] if CHANNEL in header else ""
    name = channel.split("<|", 1)[0].split()
    return ("reasoning" if name and name[0] == "analysis" else "content"), None


def read_turn(text: str, allow_calls: bool = True) -> tuple[str, str, list[ToolCall]]:
    """A whole turn's (answer, reasoning, calls); with `allow_calls` False a call's message
    is read as reasoning."""
    reader = HarmonyReader(allow_calls)
    events = reader.feed(text) + reader.finish()
    answer = "".join(e[1] for e in events if e[0] == "content")
    reasoning = "".join(e[1] for e in events if e[0] == "reasoning")
    calls = [ToolCall(e[2], e[3], "") for e in events if e[0] == "call"]
    for e in events:
        if e[0] == "arguments":
            calls[e[1]].arguments += e[2]
    return answer, reasoning, calls


def harmony_call_grammar(
    tools: Sequence[Tool], choice: str, vocabulary: dict[str, int], field: str
) -> Grammar:
    """What a harmony turn may be when a call is required (`choice` "required", or a
    function's name: a call to it): at most one analysis message (the model's reasoning,
    any text), then one call, `<|channel|>commentary to=functions.NAME <|constrain|>json
    <|message|>ARGUMENTS<|call|>`, its arguments generated under the function's parameter
    schema. The markers are the vocabulary's special tokens; `<|call|>` ends the turn."""
    chosen = [(i, t) for i, t in enumerate(tools) if choice == "required" or t.name == choice]
    needed = (START, CHANNEL, MESSAGE, END, CONSTRAIN, CALL)
    missing = [m for m in needed if m not in vocabulary]
    if missing:
        raise RequestError(
            f"this model's vocabulary lacks harmony's {', '.join(missing)}, which a required "
            "call is written with: tool_choice auto or none",
            "tool_choice",
        )
    token = {m: f"<[{vocabulary[m]}]>" for m in needed}
    rules = [
        "start: analysis? call",
        f'analysis: {token[CHANNEL]} "analysis" {token[MESSAGE]} REASONING {token[END]} '
        f'{token[START]} "assistant"',
        f'call: {token[CHANNEL]} "commentary to=functions." '
        f"({' | '.join(f'call_{k}' for k in range(len(chosen)))})",
        *(
            f'call_{k}: {json.dumps(t.name + " ")} {token[CONSTRAIN]} "json" '
            f"{token[MESSAGE]} arguments_{k} {token[CALL]}"
            for k, (_, t) in enumerate(chosen)
        ),
        r"REASONING: /(.|\n)*/",
    ]
    # Each function's parameters are their own schema's root (their `$ref`s resolve in them).
    schemas = [
        (f"arguments_{k}", t.parameters, f"{field}[{i}].function.parameters")
        for k, (i, t) in enumerate(chosen)
    ]
    return Grammar.lark(rules, schemas, field, "tools")
