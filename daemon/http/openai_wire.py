"""The OpenAI wire format's requests: a body parsed and validated into a typed record,
`CompletionRequest`, by `parse_chat` (/v1/chat/completions: messages and tools) or
`parse_completion` (/v1/completions: a prompt), each refusing what it cannot take with a
400 naming the field (daemon/http/openai_errors.py). The fields both share are read in
daemon/http/openai_fields.py, the tool fields in daemon/http/openai_tools.py; answers and
SSE chunks are shaped by daemon/http/openai_responses.py.

Named `openai_wire` so that it never shadows the `openai` client package in tests. Nothing
here touches HTTP or the models: what depends on the models is admission's
(daemon/admission.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from daemon import strict_json
from daemon.admission import Ask
from daemon.http.openai_errors import bad_request
from daemon.http.openai_fields import WireLimits, checked_text, generation_fields, is_int
from daemon.http.openai_tools import MAX_ARGUMENT_DEPTH, parse_tool_calls, parse_tools
from modeling.text.model_template import TEMPLATE_NAMES
from speculative.schema_limits import nesting

CHAT_ROLES = {
    "system": "system", "developer": "system", "user": "user", "assistant": "assistant",
    "tool": "tool",
}  # fmt: skip


@dataclass
class CompletionRequest(Ask):
    """A validated chat or text completion request: the generation it asks for (an `Ask`,
    checked against the models by `admit`, daemon/admission.py) and what only the wire
    has."""

    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices, each its own generation (seeded ones at seed, seed + 1, ...)


# No field of the API needs an integer longer than this (seeds are 20 digits). A body is
# parsed with json's own int first (a callback per integer costs 4x on a long list of
# prompt ids); only when that raises past Python's limit (4,300 digits), before any field
# is known, is it parsed again keeping longer integers as their size only.
MAX_INT_DIGITS = 100


class OversizedNumber:
    """An integer literal too long to convert, in place of its value: every field check
    refuses it (it is no int or float), so the 400 names the field that carried it."""

    def __init__(self, literal: str) -> None:
        self.digits = len(literal.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(literal: str) -> int | OversizedNumber:
    oversized = len(literal.lstrip("-")) > MAX_INT_DIGITS
    return OversizedNumber(literal) if oversized else int(literal)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        try:
            body = strict_json.loads(raw)
        except ValueError as exc:
            if isinstance(
                exc, json.JSONDecodeError | UnicodeDecodeError | strict_json.NotJsonValue
            ):
                raise
            body = strict_json.loads(raw, parse_int=_parse_int)  # an int past int()'s limit
    except (json.JSONDecodeError, UnicodeDecodeError, strict_json.NotJsonValue) as exc:
        raise bad_request(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    except RecursionError:
        # json's decoder recurses once per level: `[[[[…` twenty thousand deep exhausts
        # the stack. No field of this API nests more than three levels.
        raise bad_request(
            "the request body nests arrays or objects too deeply to parse", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return body


# The most choices one request may ask for (`n`): each is a generation of its own, holding
# a place among limits.max_concurrent + limits.queue_size.
MAX_CHOICES = 16


def _choices(body: dict) -> int:
    """`n`: how many choices to generate, 1 to MAX_CHOICES."""
    n = body.get("n")
    if n is None:
        return 1
    if type(n) is not int:  # (true == 1 in Python)
        raise bad_request(f"n must be an integer, not a {type(n).__name__}", "n")
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be from 1 to {MAX_CHOICES}, got {n}", "n")
    return n


def _refuse_unsupported(body: dict) -> None:
    """Fields whose meaning specd cannot honour are refused rather than silently ignored."""
    if body.get("functions"):
        raise bad_request("functions is not supported by specd (use tools)", "functions")
    if body.get("function_call") not in (None, "none"):
        raise bad_request("function_call is not supported by specd", "function_call")


def _message_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return checked_text(content, where)
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(f"{where}: only text content parts are supported", where)
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: a text part needs a string 'text'", where)
            parts.append(checked_text(part["text"], f"{where}[{i}].text"))
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


def parse_chat(body: dict[str, Any], limits: WireLimits) -> CompletionRequest:
    _refuse_unsupported(body)
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    normalised = []
    called: set[str] = set()  # ids of the assistant's tool calls so far
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = msg.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(
                f"{where}.role must be one of system, developer, user, assistant, tool; "
                f"got {role!r}",
                f"{where}.role",
            )
        content = _message_text(msg.get("content"), f"{where}.content")
        entry: dict[str, Any] = {"role": CHAT_ROLES[role], "content": content}
        reasoning = msg.get("reasoning_content")
        if role == "assistant" and reasoning is not None:
            # An earlier turn's reasoning, as the answer gave it: a reasoning model's
            # template (Qwen3's) reads it back, or leaves it out of the history.
            if not isinstance(reasoning, str):
                raise bad_request(
                    f"{where}.reasoning_content must be a string", f"{where}.reasoning_content"
                )
            entry["reasoning_content"] = checked_text(reasoning, f"{where}.reasoning_content")
        if role == "assistant" and msg.get("tool_calls"):
            entry["tool_calls"] = parse_tool_calls(msg["tool_calls"], f"{where}.tool_calls")
            called.update(c["id"] for c in entry["tool_calls"])
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in called:
                raise bad_request(
                    f"{where}.tool_call_id {call_id!r} answers no earlier assistant tool call",
                    f"{where}.tool_call_id",
                )
            entry["tool_call_id"] = call_id
        normalised.append(entry)
    common = generation_fields(body, limits, True)
    tools, choice, parallel = parse_tools(body, limits.schemas)
    if tools is not None and choice != "none" and common["grammar"] is not None:
        raise bad_request(
            "response_format json_object/json_schema and tools cannot be combined (the "
            "answer is either a call or JSON); use tool_choice none",
            "response_format",
        )
    calls = tools is not None and choice != "none"
    return CompletionRequest(
        messages=normalised,
        prompt=None,
        tools=tools if calls else None,
        tool_choice=choice if calls else None,
        parallel_tool_calls=parallel,
        template_vars=_template_vars(body),
        n=_choices(body),
        **common,
    )


MAX_TEMPLATE_VARS = 64
_TEMPLATE_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# OpenAI's values; gpt-oss's template writes the one given into its system message.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _template_vars(body: dict[str, Any]) -> dict[str, Any]:
    """More variables for the chat template: `chat_template_kwargs` (vLLM's and llama.cpp's
    field: `{"enable_thinking": false}` for Qwen3) and `reasoning_effort` (OpenAI's, which
    gpt-oss's template reads). Names are identifiers other than those specd sets; values are
    JSON nested at most MAX_ARGUMENT_DEPTH deep, whose text counts toward the prompt's."""
    given = body.get("chat_template_kwargs")
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    if len(given) > MAX_TEMPLATE_VARS:
        raise bad_request(
            f"chat_template_kwargs holds {len(given)} names; at most {MAX_TEMPLATE_VARS}",
            "chat_template_kwargs",
        )
    out: dict[str, Any] = {}
    for name, value in given.items():
        if not _TEMPLATE_VAR.fullmatch(name):
            raise bad_request(
                f"chat_template_kwargs names must be identifiers of at most 64 characters "
                f"(letters, digits, _); got {name[:64]!r}",
                "chat_template_kwargs",
            )
        where = f"chat_template_kwargs.{name}"
        if name in TEMPLATE_NAMES:
            raise bad_request(f"{where} is a name specd gives the chat template itself", where)
        if nesting(value, MAX_ARGUMENT_DEPTH) > MAX_ARGUMENT_DEPTH:
            raise bad_request(f"{where} nests more than {MAX_ARGUMENT_DEPTH} levels deep", where)
        try:  # (an integer past 4,300 digits, kept as its size only, is no JSON value)
            written = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            raise bad_request(f"{where} must be a JSON value", where) from None
        checked_text(written, where)  # (a lone surrogate in a key or a value)
        if name == "reasoning_effort" and value not in REASONING_EFFORTS:
            # (the same variable as the field: held to the same values, not a way round them)
            raise bad_request(
                f"{where} must be one of {', '.join(REASONING_EFFORTS)}; got {str(value)[:64]!r}",
                where,
            )
        out[name] = value
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got "
                f"{str(effort)[:64]!r}",
                "reasoning_effort",
            )
        if out.get("reasoning_effort", effort) != effort:
            raise bad_request(
                "reasoning_effort and chat_template_kwargs.reasoning_effort differ",
                "reasoning_effort",
            )
        out["reasoning_effort"] = effort
    return out


def _refuse_unsupported_completion(body: dict) -> None:
    """The legacy completion fields specd does not implement, refused unless they ask for
    the default (`echo: true` used to pass as "1" and was silently dropped)."""
    echo = body.get("echo")
    if echo is not None and echo is not False:
        raise bad_request(
            "echo is not supported by specd (the answer never repeats the prompt)", "echo"
        )
    if body.get("suffix") not in (None, ""):
        raise bad_request("suffix is not supported by specd (no insertion)", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and not (is_int(best_of) and best_of == _choices(body)):
        raise bad_request(
            "best_of other than n is not supported by specd (it returns every choice it generates)",
            "best_of",
        )
    for name in ("chat_template_kwargs", "reasoning_effort"):
        if body.get(name) is not None:  # (a text prompt is rendered by no template)
            raise bad_request(
                f"{name} is for chat completions: a text prompt has no template", name
            )


def parse_completion(body: dict[str, Any], limits: WireLimits) -> CompletionRequest:
    _refuse_unsupported(body)
    _refuse_unsupported_completion(body)
    for name in ("tools", "tool_choice"):
        if body.get(name) not in (None, [], "none"):
            raise bad_request(f"{name} is for chat completions (/v1/chat/completions)", name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        pass  # token ids, fed exactly
    elif isinstance(prompt, str):
        checked_text(prompt, "prompt")
    else:
        raise bad_request(
            "prompt must be a string or a list of token ids (one prompt per request)", "prompt"
        )
    fields = generation_fields(body, limits, False)
    return CompletionRequest(messages=None, prompt=prompt, n=_choices(body), **fields)
