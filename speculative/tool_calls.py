"""Tool calls: the grammar a request's `tools` and `tool_choice` allow, the conversation's
tools and calls rendered for the model, and the model's text read back as OpenAI's
`tool_calls`, whole or as stream deltas.

Each model family writes calls in the format it was trained on (`CallFormat`), and the
grammar allows exactly that format:

- Hermes (Qwen2.5/3): `<tool_call>\n{"name":"f","arguments":{...}}\n</tool_call>`, one
  block per call, blocks separated by a newline;
- Llama 3.1/3.2/3.3: the call as a bare object, `{"name":"f","parameters":{...}}`, one
  call per answer (their templates refuse a turn with several);
- Mistral: the `[TOOL_CALLS]` special token, then a JSON list of
  `{"name":"f","arguments":{...}}` objects (call ids of 9 letters and digits, which
  Mistral's templates require).

A template that renders `tools` and one of these formats gets the request's tools and
history as transformers would pass them; for any other model specd puts the tools and
the Hermes format in a system message of its own and writes earlier calls and tool
results in the same tags (`render_tool_messages`). The arguments are generated under the
function's parameter schema, compact, so they always parse and validate; the parameters
are their own schema's root, so their local `$ref`s mean what they do in a response_format.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modeling.text.thinking import Thinking
from speculative.grammar import Grammar
from speculative.thinking import NOT_A_BLOCK, think_rules

NAME = '{"name":'  # how every format's call object begins (compact JSON)


@dataclass(frozen=True)
class CallFormat:
    """How a model family writes its calls. An answer that calls tools is
    `token` `begin` (`open` call `close`) (`separator` `open` call `close`)* `end`, where a
    call is `{"name":NAME,"<arguments>":{...}}`. `token` is a special token (text the
    tokenizer does not decode: the stream never sees it)."""

    name: str
    open: str = ""
    close: str = ""
    separator: str = ""
    begin: str = ""
    end: str = ""
    arguments: str = "arguments"
    token: str | None = None
    parallel: bool = True  # whether one answer may hold several calls
    id_length: int = 0  # ids of exactly this many letters and digits; 0: "call_" + hex

    @property
    def lead(self) -> str:
        """The text an answer that calls begins with (and a text answer may not)."""
        return self.begin + self.open + NAME

    def new_id(self) -> str:
        if not self.id_length:
            return "call_" + secrets.token_hex(12)
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(self.id_length))


HERMES = CallFormat("hermes", open="<tool_call>\n", close="\n</tool_call>", separator="\n")
LLAMA3 = CallFormat("llama3", arguments="parameters", parallel=False)
MISTRAL = CallFormat(
    "mistral", begin="[", end="]", separator=",", token="[TOOL_CALLS]", id_length=9
)


def native_format(template: str | None, vocabulary: dict[str, int]) -> CallFormat | None:
    """The call format a chat template renders `tools` in itself, or None (specd's
    fallback, Hermes in a system message). Read from what the template writes: Qwen's
    the <tool_call> tags, Llama 3's the `ipython` role and `parameters`, Mistral's the
    [TOOL_CALLS] token (which must then be a token of the vocabulary)."""
    if template is None or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template and MISTRAL.token in vocabulary:
        return MISTRAL
    if "ipython" in template and "parameters" in template:
        return LLAMA3
    return None


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema for the arguments object

    def as_openai(self) -> dict[str, Any]:
        """What a chat template's `tools` holds (transformers passes the request's)."""
        function = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
        }
        return {"type": "function", "function": function}


def _call_head(tool: Tool, fmt: CallFormat) -> str:
    """A call's object up to its arguments: `{"name":"f","arguments":` (compact JSON)."""
    return f'{NAME}{json.dumps(tool.name)},"{fmt.arguments}":'


def _sequence(*parts: str) -> str:
    """Lark items for the non-empty parts (literal strings, or rules as given)."""
    return " ".join(p for p in parts if p)


def tool_grammar(
    fmt: CallFormat,
    tools: Sequence[Tool],
    choice: str | None,
    parallel: bool,
    field: str,
    vocabulary: dict[str, int] | None = None,
    thinking: Thinking | None = None,
) -> Grammar:
    """What the answer may be, in `fmt`, after a think block where the model writes one
    (`thinking`: speculative/thinking.py). `choice`: "auto" (text, or calls), "required"
    (calls), or a function's name (one call to it). Text may be anything that does not
    begin as a call does; calls are one or more (one unless `parallel` and the format has
    room for several). `vocabulary` gives the id of the format's special token.

    A call is its opening and head as a literal, then the arguments under the function's
    parameters as a schema of their own (`Grammar.lark`): pydantic's nested models refer
    to `#/$defs/...`, which must mean the parameters' `$defs`, not those of a call object
    around them. An error in the parameters names `tools[i].function.parameters`."""
    chosen = [
        (i, t)
        for i, t in enumerate(tools)
        if choice in (None, "auto", "required") or t.name == choice
    ]
    literal = lambda text: json.dumps(text) if text else ""  # noqa: E731
    # The opening and the head are one literal: the engine's lexer takes the longest match
    # and never goes back, so with `auto` TEXT (alive up to the head's `:`) must end inside
    # a call's literal, not after a shorter one (`<tool_call>\n`) has ended, or no call
    # could follow.
    calls = [
        f"call_{k}: {literal(fmt.open + _call_head(t, fmt))} arguments_{k} "
        f"{literal('}' + fmt.close)}"
        for k, (_, t) in enumerate(chosen)
    ]
    schemas = [
        (f"arguments_{k}", t.parameters, f"{field}[{i}].function.parameters")
        for k, (i, t) in enumerate(chosen)
    ]
    alternatives = " | ".join(f"call_{k}" for k in range(len(chosen)))
    several = parallel and fmt.parallel and choice in ("auto", "required", None)
    token = ""
    if fmt.token is not None:
        assert vocabulary is not None and fmt.token in vocabulary
        token = f"<[{vocabulary[fmt.token]}]>"
    repeat = f"({_sequence(literal(fmt.separator), 'call')})*" if several else ""
    answer = "(TEXT | calls)" if choice in ("auto", None) else "calls"
    # (text that opens a think block is the block, where one may open)
    block = f" & {NOT_A_BLOCK}" if thinking is not None and not thinking.started else ""
    rules = [
        *think_rules(thinking, answer),
        f"calls: {_sequence(token, literal(fmt.begin), 'call', repeat, literal(fmt.end))}",
        f"call: {alternatives}",
        rf"TEXT: /(.|\n)*/ & ~/{_regex(fmt.lead)}(.|\n)*/{block}",
        *calls,
    ]
    # Compiled (and so checked) when the request's Constraint is made, by the engine on a
    # thread of speculative/grammar_compiler.py: each tool's schema was measured against
    # the limits before it got here.
    return Grammar.lark(rules, schemas, field, "tools")


def _regex(text: str) -> str:
    """`text` as a Lark regular expression matching it literally."""
    return re.sub(r"([\\/.*+?()\[\]{}|^$])", r"\\\1", text).replace("\n", r"\n")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class CallStream:
    """Reads an answer in `fmt` as it streams and says what OpenAI's deltas carry: content
    text, a call's start (index, id, name) and fragments of its arguments. Text is held
    back only while it could still be the start of a call; arguments are passed on as
    they come, their end found by counting the JSON object's brackets (outside strings),
    so no text after them needs to be waited for."""

    def __init__(self, fmt: CallFormat = HERMES, calls_only: bool = False) -> None:
        self.fmt = fmt
        self.calls_only = calls_only  # tool_choice required or named: no text can come
        self.buffer = ""
        self.state = "undecided"  # undecided | text | head | arguments | after | between | done
        self.index = -1
        self._depth = 0  # the arguments object's open brackets
        self._in_string = self._escaped = False

    def feed(self, text: str) -> list[tuple[Any, ...]]:
        self.buffer += text
        out: list[tuple[Any, ...]] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[tuple[Any, ...]]) -> bool:
        """One move of the state machine; False when it needs more text."""
        b, fmt = self.buffer, self.fmt
        if self.state == "undecided":
            if b.startswith(fmt.lead):
                self.buffer, self.state = b[len(fmt.begin) :], "head"
                return True
            if fmt.lead.startswith(b):
                return False  # may still become a call
            self.state = "text"
            return True
        if self.state == "text":
            if b:
                out.append(("content", b))
            self.buffer = ""
            return False
        if self.state == "head":
            key = f',"{fmt.arguments}":'
            end = b.find(key)
            if end < 0:
                return False
            self.index += 1
            name = json.loads(b[len(fmt.open + NAME) : end])
            out.append(("call", self.index, fmt.new_id(), name))
            self.buffer, self.state = b[end + len(key) :], "arguments"
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        if self.state == "arguments":
            end = self._scan(b)
            if end:
                out.append(("arguments", self.index, b[:end]))
            self.buffer = b[end:]
            if self._depth == 0 and end:  # the object is closed
                self.state = "after"
                return True
            return False
        if self.state == "after":
            tail = "}" + fmt.close
            if not b.startswith(tail):
                return False
            self.buffer, self.state = b[len(tail) :], "between"
            return True
        if self.state == "between":
            if fmt.separator and b.startswith(fmt.separator + fmt.open + NAME):
                self.buffer, self.state = b[len(fmt.separator) :], "head"
                return True
            if fmt.end and b.startswith(fmt.end):
                self.buffer, self.state = "", "done"
            return False
        self.buffer = ""  # done: the grammar allows nothing more but the end
        return False

    def _scan(self, text: str) -> int:
        """How much of `text` belongs to the arguments object: all of it, or up to and
        including the bracket that closes it."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return len(text)

    def finish(self) -> list[tuple[Any, ...]]:
        """What is left when the answer ends: a text answer's held-back start (a call cut
        by max_tokens or a stop string has passed on what was written of its arguments;
        one whose name was not complete was never announced, and is not now)."""
        out: list[tuple[Any, ...]] = []
        # A call cut inside its opening (`<tool_call>\n{"n`) is text only where text may
        # be the answer; where only calls may, it is a call never begun.
        if self.state in ("undecided", "text") and self.buffer and not self.calls_only:
            out.append(("content", self.buffer))
        self.buffer = ""
        return out


def read_answer(
    text: str, fmt: CallFormat = HERMES, calls_only: bool = False
) -> tuple[str, list[ToolCall]]:
    """A whole answer read exactly as a stream of it is: its content text and its calls
    (a cut call keeps what was written of its arguments, as OpenAI returns it)."""
    stream = CallStream(fmt, calls_only)
    events = stream.feed(text) + stream.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    calls: list[ToolCall] = []
    for event in events:
        if event[0] == "call":
            calls.append(ToolCall(event[2], event[3], ""))
        elif event[0] == "arguments":
            calls[event[1]].arguments += event[2]
    return content, calls


# -- rendering for models whose template has no tool format ----------------------------

OPEN, CLOSE = HERMES.open, HERMES.close

FALLBACK_INSTRUCTIONS = (
    "To call a function, answer with one block per call:\n"
    '<tool_call>\n{"name":NAME,"arguments":{...}}\n</tool_call>\n'
    "Results come in <tool_response> tags. Functions:\n"
)


def render_tool_messages(
    messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` for a template without a tool format: the tools (OpenAI's shape,
    `Tool.as_openai`) and the call format in a system message (joined to the first system
    message if there is one), earlier calls as the assistant's tagged text, tool results as
    user messages in <tool_response> tags."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            blocks = [
                OPEN
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    separators=(",", ":"),
                )
                + CLOSE
                for c in msg["tool_calls"]
            ]
            text = (msg.get("content") or "") + "\n".join(blocks)
            out.append({"role": "assistant", "content": text})
        elif msg["role"] == "tool":
            text = f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"
            out.append({"role": "user", "content": text})
        else:
            out.append({"role": msg["role"], "content": msg.get("content") or ""})
    if tools:
        listing = "\n".join(json.dumps(t["function"], separators=(",", ":")) for t in tools)
        system = FALLBACK_INSTRUCTIONS + listing
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
