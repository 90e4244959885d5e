"""The OpenAI wire format's responses, shaped: whole answers, streamed chunks (SSE), usage
and specd's own statistics in the `specd` extension field. daemon/http/streaming.py writes
them to the client; requests are parsed in daemon/http/openai_wire.py."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from speculative.sampling import TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


SPECD_STAT_KEYS = (
    "strategy",
    "draft_kind",  # model | substitute | ngram (None: no draft)
    "substitute_bits",  # the substitute draft's bits (None: another draft)
    "substitute_layers",  # its layers copied at those bits (the rest: the target's own)
    "draft_reason",  # why `--draft auto` chose the draft (None: it was given)
    "max_tokens",  # the effective limit (cut to the room left when clamping)
    "tokens_per_target_pass",
    "acceptance_rate",
    "target_passes",
    "prefill_passes",
    "drafted",
    "accepted",
    "tree_nodes",
    "budget",
    "budget_reason",
    "tree_verification",  # walk | rejection: how the last tree was verified
    "acceptance_estimate",  # the tokens per round its learned acceptance predicted
    "verification_rounds",  # rounds verified by each
    "draft_seconds",
    "verify_seconds",
    "prefill_seconds",
    "total_seconds",
    "first_token_seconds",
    "tokens_per_second",
    "cached_prompt_tokens",
    "prefix_cache_hits",
    "prefix_cache_misses",
    "forced_tokens",  # emitted without a pass: the response_format's grammar allowed them alone
    "batch_size",  # mean generations per target pass this request rode in
    "shared_passes",  # its target passes that also carried another request's work
)


def specd_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """specd's own figures, sent in an extension field ("specd") that clients ignore."""
    return {k: stats[k] for k in SPECD_STAT_KEYS if k in stats}


@dataclass
class ResponseShape:
    """Constant parts of one response: every streamed chunk repeats the same id/created."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0
    # A token's text after the token before it (`piece(token, previous)`: the tokenizer's
    # `Tokenizer.piece`), when the request asked for log-probabilities (else None).
    piece: Callable[[int, int], str] | None = None
    # A token's own bytes (`Tokenizer.raw_bytes`): chat's `bytes` of a piece that reads
    # U+FFFD (part of a character) are these, as OpenAI gives them.
    raw_bytes: Callable[[int], bytes | None] | None = None
    # Which choice this shape writes (a request's `n` > 1: one shape each, the same id).
    index: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl" if self.chat else "cmpl")
        self.created = self.created or int(time.time())

    def _envelope(self, stream: bool) -> dict[str, Any]:
        if self.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(
        self, entries: list[TokenLogprob], previous: int, offset: int = 0
    ) -> dict[str, Any] | None:
        """OpenAI's shape of the tokens' log-probabilities: chat's `content` list, or the
        completions' parallel lists (`text_offset` counted from `offset`). `previous`: the
        token before the first entry's (the prompt's last, or the last one sent)."""
        if self.piece is None:
            return None
        piece = self.piece
        befores = [previous, *(e.token for e in entries)][: len(entries)]
        if self.chat:

            def item(before: int, token: int, logprob: float) -> dict[str, Any]:
                text = piece(token, before)
                raw = self.raw_bytes(token) if self.raw_bytes is not None else None
                if raw is not None and _whole_characters(raw) and "\ufffd" not in text:
                    # its text's own (a word's space as it reads in context), unless the
                    # text lost it: a byte after bytes that are not UTF-8 reads U+FFFD in
                    # context, where its own byte (a space) is whole
                    raw = None
                # A piece of a character (its text U+FFFD, or nothing where a byte-level
                # decode put one U+FFFD for a run of them): the token's own bytes.
                return {"token": text, "logprob": logprob, "bytes": list(raw or text.encode())}

            return {
                "content": [
                    {
                        **item(b, e.token, e.logprob),
                        "top_logprobs": [item(b, t, lp) for t, lp in e.top],
                    }
                    for b, e in zip(befores, entries, strict=True)
                ]
            }
        tokens = [piece(e.token, b) for b, e in zip(befores, entries, strict=True)]
        offsets = []
        for text, e in zip(tokens, entries, strict=True):
            # Where the token's text begins in the answer (a token's piece is not always
            # its text there: a byte of a character reads U+FFFD, a first word its space).
            offsets.append(e.start if e.start is not None else offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                {piece(t, b): lp for t, lp in e.top} for b, e in zip(befores, entries, strict=True)
            ],
            "text_offset": offsets,
        }

    def full(
        self,
        text: str,
        finish_reason: str,
        usage_: dict[str, Any],
        stats: dict[str, Any],
        logprobs: list[TokenLogprob] | None = None,
        previous: int = 0,
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str = "",
    ) -> dict[str, Any]:
        """The whole answer; with `tool_calls` (the answer read back as calls: empty when
        it was text) a message that made calls has them and no content; `reasoning` (a
        harmony model's analysis channel) as the message's `reasoning_content`."""
        lp = self.logprobs(logprobs or [], previous)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
            if reasoning:
                message["reasoning_content"] = reasoning
            choice = {
                "index": self.index,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": lp,
            }
        else:
            choice = {"index": self.index, "text": text, "finish_reason": finish_reason,
                      "logprobs": lp}  # fmt: skip
        return {
            **self._envelope(stream=False),
            "choices": [choice],
            "usage": usage_,
            "specd": specd_stats(stats),
        }

    def chunk(
        self,
        text: str,
        *,
        first: bool = False,
        finish_reason: str | None = None,
        stats: dict[str, Any] | None = None,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
        previous: int = 0,
        reasoning: str = "",
    ) -> dict[str, Any]:
        lp = self.logprobs(logprobs, previous, offset) if logprobs else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if not first and text:
                delta["content"] = text
            if reasoning:
                delta["reasoning_content"] = reasoning
            choice = {"index": self.index, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": lp}  # fmt: skip
        else:
            choice = {"index": self.index, "text": text, "finish_reason": finish_reason,
                      "logprobs": lp}  # fmt: skip
        out = {**self._envelope(stream=True), "choices": [choice]}
        if stats is not None:
            out["specd"] = specd_stats(stats)
        return out

    def tool_chunk(self, events: list[tuple[Any, ...]]) -> dict[str, Any]:
        """Tool-call deltas as OpenAI streams them: a call's index, id, type and name
        first (arguments ""), then fragments of its arguments under its index."""
        deltas: list[dict[str, Any]] = []
        for event in events:
            if event[0] == "call":
                _, index, call_id, name = event
                deltas.append(
                    {"index": index, "id": call_id, "type": "function",
                     "function": {"name": name, "arguments": ""}}
                )  # fmt: skip
            elif deltas and deltas[-1]["index"] == event[1]:
                deltas[-1]["function"]["arguments"] += event[2]  # one entry per call a chunk
            else:
                _, index, fragment = event
                deltas.append({"index": index, "function": {"arguments": fragment}})
        choice = {
            "index": self.index,
            "delta": {"tool_calls": deltas},
            "finish_reason": None,
            "logprobs": None,
        }
        return {**self._envelope(stream=True), "choices": [choice]}

    def trace_chunk(self, trace: dict[str, Any]) -> dict[str, Any]:
        """One round's draft tree: a chunk with no choices (clients skip it, as they skip
        the usage chunk) and the tree in the `specd` extension field, under its choice's
        index (`n` > 1: every choice grows its own trees)."""
        traced = {**trace, "index": self.index}
        return {**self._envelope(stream=True), "choices": [], "specd": {"trace": traced}}

    def usage_chunk(self, usage_: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
        return {
            **self._envelope(stream=True),
            "choices": [],
            "usage": usage_,
            "specd": specd_stats(stats),
        }


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, default=str)
    return f"data: {data}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"


def _whole_characters(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
