"""The OpenAI wire format's tool fields: `tools`, `tool_choice` and
`parallel_tool_calls` of a chat request, and the `tool_calls` of the assistant's earlier
messages. The tools' grammar, in the model's own call format, is made when the request is
admitted (daemon/admission.py); speculative/tool_calls.py holds the formats.
"""

from __future__ import annotations

import json
from typing import Any

from daemon.http.openai_errors import bad_request
from daemon.http.openai_fields import SCHEMA_NAME, checked_schema_text, checked_text
from speculative.schema_limits import SchemaLimits, check_schema, nesting
from speculative.tool_calls import Tool

MAX_TOOLS = 128
# Arguments of earlier calls nest at most this deep (real ones: a few levels).
MAX_ARGUMENT_DEPTH = 64
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def parse_tools(body: dict, limits: SchemaLimits) -> tuple[list[Tool] | None, str | None, bool]:
    """`tools`, `tool_choice` and `parallel_tool_calls`: the tools offered, the choice
    ("none", "auto", "required" or a function's name) and whether calls may be several."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None, None, parallel
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"tools must be a list of up to {MAX_TOOLS} functions", "tools")
    parsed: list[Tool] = []
    for i, entry in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        fn = entry.get("function")
        if not isinstance(fn, dict):
            raise bad_request(
                f"{where}.function must be an object with a name", f"{where}.function"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
            raise bad_request(
                f"{where}.function.name must be 1-64 letters, digits, underscores or dashes",
                f"{where}.function.name",
            )
        if name in {t.name for t in parsed}:
            raise bad_request(
                f"{where}.function.name {name!r} is offered twice", f"{where}.function.name"
            )
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise bad_request(
                f"{where}.function.description must be a string", f"{where}.function.description"
            )
        checked_text(description, f"{where}.function.description")
        # No parameters: a function of no arguments (OpenAI's reading), {} as its arguments.
        parameters = fn.get("parameters", NO_ARGUMENTS)
        if not isinstance(parameters, dict):
            raise bad_request(
                f"{where}.function.parameters must be a JSON Schema object",
                f"{where}.function.parameters",
            )
        check_schema(parameters, f"{where}.function.parameters", limits)
        checked_schema_text(parameters, f"{where}.function.parameters")
        parsed.append(Tool(name, description, parameters))
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        offered = {t.name for t in parsed}
        if choice.get("type") != "function" or not isinstance(named, str) or named not in offered:
            raise bad_request(
                "tool_choice must be none, auto, required or "
                '{"type": "function", "function": {"name": NAME}} naming one of the tools',
                "tool_choice",
            )
        choice = named
    elif choice is None:
        choice = "auto"
    elif choice not in ("none", "auto", "required"):
        raise bad_request(
            "tool_choice must be none, auto, required or a named function", "tool_choice"
        )
    return parsed, choice, parallel


def parse_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier `tool_calls`, arguments as objects (what chat
    templates write with `tojson`). Arguments that are not JSON (a call cut short by
    max_tokens, as specd itself returns it) stay text: templates write a string as it is,
    or as a JSON string, and OpenAI takes such a message back too."""
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list of calls", where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{at} must hold a function with a name", at)
        if not isinstance(call.get("id"), str):
            raise bad_request(f"{at}.id must be a string", f"{at}.id")
        checked_text(call["id"], f"{at}.id")
        checked_text(fn["name"], f"{at}.function.name")
        arguments = fn.get("arguments", "{}")
        param = f"{at}.function.arguments"
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = arguments  # (checked below as any text is)
        except RecursionError:  # json's decoder recurses once per level
            raise bad_request(
                f"{param} nests more than {MAX_ARGUMENT_DEPTH} levels deep", param
            ) from None
        if nesting(parsed, MAX_ARGUMENT_DEPTH) > MAX_ARGUMENT_DEPTH:
            # The chat template writes them back with `tojson`, which recurses too.
            raise bad_request(f"{param} nests more than {MAX_ARGUMENT_DEPTH} levels deep", param)
        try:  # the template writes them back as JSON: an integer past 4,300 digits cannot be
            written = json.dumps(parsed, ensure_ascii=False)
        except (TypeError, ValueError):
            raise bad_request(f"{param} holds a number too long to read", param) from None
        checked_text(written, param)  # (a lone surrogate in a key or a value)
        out.append(
            {"id": call["id"], "type": "function",
             "function": {"name": fn["name"], "arguments": parsed}}
        )  # fmt: skip
    return out
