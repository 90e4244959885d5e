"""A reasoning model's turn read apart (modeling/text/thinking.py): the reasoning of its
think block as the response's `reasoning_content`, the rest as its answer (text, or the
tool calls speculative/tool_calls.py reads from it), however the text streams; and the
grammar pieces that let a constrained answer (tool calls, a response_format) come after a
think block, as the model writes it unconstrained.

What the reasoning and the answer hold is what the model's own template reads back from an
earlier turn (Qwen3's): the reasoning without the newlines around it, the answer without
the newlines after `</think>`."""

from __future__ import annotations

from modeling.text.thinking import CLOSE, LEAD_SPACE, OPEN, Thinking
from speculative.grammar import Grammar

Event = tuple[str, str]


def _held(text: str, marker: str) -> int:
    """Characters at the end of `text` that may begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ThinkReader:
    """`feed` the decoded text of an assistant's turn as it comes; each call returns events
    `("reasoning", text)` and `("content", text)`; `finish` returns what was held back.
    Text is held only while it may be a tag's beginning (or newlines the reading drops);
    however the text is split, the events add up alike."""

    calls = 0  # (as HarmonyReader's: a think block makes no calls)

    def __init__(self, thinking: Thinking) -> None:
        self.state = "reasoning" if thinking.started else "lead"
        self.buffer = ""
        self.fresh = True  # nothing of the reasoning shown yet: its leading newlines go
        self.fed = 0  # characters fed so far
        # Where the answer begins among the characters fed (None: not yet): the tokens
        # before it are the think block's (their log-probabilities stay when it calls).
        self.answer_at: int | None = None

    def feed(self, text: str) -> list[Event]:
        self.fed += len(text)
        self.buffer += text
        out: list[Event] = []
        while self._step(out):
            pass
        return [e for e in out if e[1]]

    def _step(self, out: list[Event]) -> bool:
        """One move; False when more text is needed."""
        b = self.buffer
        if self.state == "lead":
            start = b.lstrip(LEAD_SPACE)
            if start.startswith(OPEN):
                self.buffer, self.state = start[len(OPEN) :], "reasoning"
                return True
            if OPEN.startswith(start):
                return False  # (whitespace, or the tag's first characters)
            self.state, self.answer_at = "content", self.fed - len(b)
            return True
        if self.state == "reasoning":
            at = b.find(CLOSE)
            if at >= 0:
                self._reason(out, b[:at].rstrip("\n"))
                self.buffer, self.state = b[at + len(CLOSE) :], "after"
                return True
            shown = b[: len(b) - _held(b, CLOSE)].rstrip("\n")  # (newlines before the tag)
            self._reason(out, shown)
            self.buffer = b[len(shown) :]
            return False
        if self.state == "after":
            rest = b.lstrip("\n")
            if not rest:
                self.buffer = ""
                return False
            self.buffer, self.state = rest, "content"
            self.answer_at = self.fed - len(rest)
            return True
        out.append(("content", b))
        self.buffer = ""
        return False

    def _reason(self, out: list[Event], text: str) -> None:
        if self.fresh:
            text = text.lstrip("\n")
            self.fresh = not text
        out.append(("reasoning", text))

    def finish(self) -> list[Event]:
        """What is left: a turn that ended inside its think block (max_tokens) leaves its
        reasoning; one that ended where it might still have opened one, its answer."""
        out: list[Event] = []
        if self.state == "reasoning":
            self._reason(out, self.buffer.rstrip("\n"))
        elif self.state in ("lead", "content"):
            if self.answer_at is None:
                self.answer_at = self.fed - len(self.buffer)
            out.append(("content", self.buffer))
        self.buffer = ""
        return [e for e in out if e[1]]


def read_thinking(text: str, thinking: Thinking) -> tuple[str, str]:
    """A whole turn's (answer, reasoning)."""
    reader = ThinkReader(thinking)
    events = reader.feed(text) + reader.finish()
    answer = "".join(t for kind, t in events if kind == "content")
    return answer, "".join(t for kind, t in events if kind == "reasoning")


# A think block as one lexeme of the engine's: the tag, text without the closing tag, the
# closing tag and the newlines after it. (One lexeme, since the engine's lexer takes the
# longest match and never goes back: a text lexeme that ran on into `</think>` could not be
# cut there.)
THOUGHT = r"/(.|\n)*/ & ~/(.|\n)*<\/think>(.|\n)*/"
# (whitespace may come before the tag, the readers' LEAD_SPACE: a block after a newline was
# text under `auto`, and a call after it was read back unchecked, a reviewer found)
_LEAD = "[" + LEAD_SPACE.encode("unicode_escape").decode() + "]*"
THINK_BLOCK = rf'/{_LEAD}/ "{OPEN}" THOUGHT "{CLOSE}" /\n*/'
THINK_END = rf'THOUGHT "{CLOSE}" /\n*/'
# What an answer's free text may not begin with where a block may open before it.
NOT_A_BLOCK = rf"~/{_LEAD}{OPEN}(.|\n)*/"


def think_rules(thinking: Thinking | None, answer: str) -> list[str]:
    """The start of a grammar whose `answer` rule a think block may come before: optional
    as the turn begins, or the rest of the block where the prompt opened it (its reasoning
    must end before the answer). No lines where `thinking` is None."""
    if thinking is None:
        return [f"start: {answer}"]
    if thinking.started:
        return [f"start: THINK_END {answer}", f"THOUGHT: {THOUGHT}", f"THINK_END: {THINK_END}"]
    return [f"start: THINK? {answer}", f"THOUGHT: {THOUGHT}", f"THINK: {THINK_BLOCK}"]


def thinking_first(grammar: Grammar, thinking: Thinking | None) -> Grammar:
    """A response_format's grammar (made from a schema) with a think block allowed before
    its JSON; as it is where the model does not think or the grammar holds no schema."""
    if thinking is None or grammar.schema is None:
        return grammar
    rules = think_rules(thinking, "answer")
    schemas = [("answer", grammar.schema, grammar.field)]
    return Grammar.lark(rules, schemas, grammar.field, grammar.description)
