"""Reasoning models' think blocks: Qwen3, QwQ, DeepSeek-R1's distills, SmolLM3 and
Phi-4-reasoning write their reasoning between `<think>` and `</think>` before the answer,
or after a prompt whose template opened the block for them. A tokenizer has them
(`Tokenizer.thinks`) when both tags are tokens of its vocabulary and its chat template
writes the closing one. speculative/thinking.py reads a turn's text into its reasoning and
its answer; `ThinkingStops` keeps a request's stop strings to the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

OPEN, CLOSE = "<think>", "</think>"
# The whitespace a turn may begin with before its block: the readers strip these and no
# other, as the grammars allow (`str.lstrip()`'s every Unicode space let a form feed before
# the tag skip the call grammar under `auto`, and the call after it came back unchecked).
LEAD_SPACE = " \t\r\n"


@dataclass(frozen=True)
class Thinking:
    """A turn of a model that thinks: `started` when its prompt ends inside an opened block
    (the turn begins with reasoning and ends it with `</think>`), else the turn may open
    one as it begins."""

    started: bool = False


def opened(prompt_tail: str) -> bool:
    """Whether a prompt whose text ends in `prompt_tail` leaves a think block open."""
    return prompt_tail.rstrip().endswith(OPEN)


class Stops(Protocol):
    @property
    def stopped(self) -> bool: ...

    def push(self, text: str) -> str: ...

    def flush(self) -> str: ...


class ThinkingStops:
    """Stop strings (`answer`: a StopMatcher or StopsOutsideCalls of modeling/text/detok.py)
    for a model that thinks: they apply to the answer, never to its reasoning (a stop of
    "\\n\\n" ended a Qwen3 turn at its reasoning's first paragraph). The reasoning passes as
    it comes; the answer's leading newlines after `</think>` too, so that a call's head is
    read where it begins. While the turn's start may still open a block it is held."""

    def __init__(self, answer: Stops, thinking: Thinking) -> None:
        self.answer = answer
        self.state = "reasoning" if thinking.started else "lead"
        self.held = ""  # the lead: text that may still open a block
        self.tail = ""  # the reasoning's last characters: a closing tag split across pushes

    @property
    def stopped(self) -> bool:
        return self.answer.stopped

    def push(self, text: str) -> str:
        out = ""
        if self.state == "lead":
            self.held += text
            start = self.held.lstrip(LEAD_SPACE)
            if OPEN.startswith(start) and len(start) < len(OPEN):
                return ""  # (whitespace, or the tag's first characters)
            text, self.held = self.held, ""
            if not start.startswith(OPEN):
                self.state = "answer"
                return self.answer.push(text)
            self.state = "reasoning"
        if self.state == "reasoning":
            seen = self.tail + text
            at = seen.find(CLOSE)
            if at < 0:
                self.tail = seen[-(len(CLOSE) - 1) :]
                return out + text
            split = at + len(CLOSE) - len(self.tail)
            out, text = out + text[:split], text[split:]
            self.state = "after"
        if self.state == "after":
            rest = text.lstrip("\n")
            out += text[: len(text) - len(rest)]
            if not rest:
                return out
            text, self.state = rest, "answer"
        return out + self.answer.push(text)

    def flush(self) -> str:
        if self.state == "lead":
            held, self.held = self.held, ""
            return self.answer.push(held) + self.answer.flush()
        return self.answer.flush() if self.state == "answer" else ""
