"""Tool calls: the grammar a request's `tools` and `tool_choice` allow, the conversation's
tools and calls rendered for the model, and the model's text read back as OpenAI's
`tool_calls`, whole or as stream deltas.

One call format, the Hermes one that Qwen2.5 and Qwen3 are trained on and their chat
templates write:

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

one block per call, nothing else in an answer that calls tools. A template that takes
`tools` (Qwen's) renders them and the history's calls itself; for any other model specd
puts the tools and this format in a system message of its own and writes earlier calls
and tool results in the same tags (`render_tool_messages`). The arguments are generated
under the function's parameter schema, so they always parse and validate.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from speculative.grammar import JSON_OPTIONS, Grammar, GrammarError

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
HEAD, ARGUMENTS, TAIL = OPEN + '{"name":', ',"arguments":', "}" + CLOSE


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


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_OPTIONS,
    }


def tool_grammar(tools: Sequence[Tool], choice: str | None, parallel: bool, field: str) -> Grammar:
    """What the answer may be. `choice`: "auto" (text, or calls), "required" (calls), or a
    function's name (one call to it). Text may be anything that does not begin with the
    call tag; calls are one or more blocks (one unless `parallel`)."""
    chosen = [t for t in tools if choice in (None, "auto", "required") or t.name == choice]
    rules = [f"call_{i}: %json {json.dumps(_call_schema(t))}" for i, t in enumerate(chosen)]
    alternatives = " | ".join(f"call_{i}" for i in range(len(chosen)))
    calls = 'call ("\\n" call)*' if parallel and choice in ("auto", "required", None) else "call"
    start = "TEXT | calls" if choice in ("auto", None) else "calls"
    lark = "\n".join(
        [
            f"start: {start}",
            f"calls: {calls}",
            f"call: {json.dumps(OPEN)} ({alternatives}) {json.dumps(CLOSE)}",
            r"TEXT: /(.|\n)*/ & ~/<tool_call>(.|\n)*/",
            *rules,
        ]
    )
    grammar = Grammar(llguidance.LLMatcher.grammar_from_lark(lark), field, "tools")
    try:
        grammar.validate()
    except GrammarError as err:
        raise GrammarError(str(err), field, "unsupported_grammar") from None
    return grammar


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


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


@dataclass
class CallStream:
    """Reads an answer as it streams and says what OpenAI's deltas carry: content text, a
    call's start (index, id, name) and fragments of its arguments. Text is held back only
    while it could still be the start of a call tag, arguments only while they could be
    the call's closing brace and tag (compact JSON holds no raw newline, so the first
    `}\n</tool_call>` ends the call)."""

    buffer: str = ""
    state: str = "undecided"  # undecided | text | head | arguments | between
    index: int = -1

    def feed(self, text: str) -> list[tuple[Any, ...]]:
        self.buffer += text
        out: list[tuple[Any, ...]] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[tuple[Any, ...]]) -> bool:
        """One move of the state machine; False when it needs more text."""
        b = self.buffer
        if self.state == "undecided":
            if b.startswith(OPEN):
                self.state = "head"
                return True
            if OPEN.startswith(b):
                return False  # may still become a call
            self.state = "text"
            return True
        if self.state == "text":
            if b:
                out.append(("content", b))
            self.buffer = ""
            return False
        if self.state == "head":
            end = b.find(ARGUMENTS)
            if end < 0:
                return False
            self.index += 1
            out.append(("call", self.index, new_call_id(), json.loads(b[len(HEAD) : end])))
            self.buffer, self.state = b[end + len(ARGUMENTS) :], "arguments"
            return True
        if self.state == "arguments":
            close = b.find(TAIL)
            if close >= 0:
                if close:
                    out.append(("arguments", self.index, b[:close]))
                self.buffer, self.state = b[close + len(TAIL) :], "between"
                return True
            if len(b) > len(TAIL):
                out.append(("arguments", self.index, b[: -len(TAIL)]))
                self.buffer = b[-len(TAIL) :]
            return False
        if b.startswith("\n"):  # between two calls
            self.buffer, self.state = b[1:], "head"
            return True
        return False

    def finish(self) -> list[tuple[Any, ...]]:
        """What is left when the answer ends: a text answer's held-back start, or the
        held-back end of a call's arguments cut by max_tokens or a stop string (a call
        whose name was not complete was never announced, and is not now)."""
        out: list[tuple[Any, ...]] = []
        if self.state in ("undecided", "text") and self.buffer:
            out.append(("content", self.buffer))
        if self.state == "arguments" and self.buffer:
            out.append(("arguments", self.index, self.buffer))
        self.buffer = ""
        return out


def read_answer(text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer read exactly as a stream of it is: its content text and its calls
    (a cut call keeps what was written of its arguments, as OpenAI returns it)."""
    stream = CallStream()
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

FALLBACK_INSTRUCTIONS = (
    "To call a function, answer with one block per call:\n"
    '<tool_call>\n{"name":NAME,"arguments":{...}}\n</tool_call>\n'
    "Results come in <tool_response> tags. Functions:\n"
)


def render_tool_messages(
    messages: list[dict[str, Any]], tools: Sequence[Tool] | None
) -> list[dict[str, Any]]:
    """`messages` for a template without a tool format: the tools and the call format in a
    system message (joined to the first system message if there is one), earlier calls as
    the assistant's tagged text, tool results as user messages in <tool_response> tags."""
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
        listing = "\n".join(
            json.dumps(t.as_openai()["function"], separators=(",", ":")) for t in tools
        )
        system = FALLBACK_INSTRUCTIONS + listing
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def template_has_tools(template: str | None) -> bool:
    """A chat template that renders `tools` and the Hermes call tags itself (Qwen2.5/3)."""
    return template is not None and "tools" in template and "<tool_call>" in template
