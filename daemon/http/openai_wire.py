"""The OpenAI wire format's requests: validation into typed records (`CompletionRequest`),
and its error shape (`ApiError`). Answers and SSE chunks are written by
daemon/http/openai_responses.py.

Named `openai_wire` so that it never shadows the `openai` client package in tests. Nothing
here touches HTTP or the models: the API layer parses requests with these functions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from daemon.admission import Ask
from daemon.settings import STRATEGY_CHOICES, TREE_VERIFICATION_CHOICES
from speculative.grammar import Grammar
from speculative.sampling import MAX_TOP_LOGPROBS, SamplingParams
from speculative.tool_calls import HERMES, Tool, tool_grammar

CHAT_ROLES = {
    "system": "system", "developer": "system", "user": "user", "assistant": "assistant",
    "tool": "tool",
}  # fmt: skip
MAX_TOOLS = 128
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
MAX_STOP_STRINGS = 16
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # response_format.json_schema.name, as OpenAI


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status == 400:
            # The OpenAI client retries some statuses; a bad request will not get better.
            self.headers.setdefault("x-should-retry", "false")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class WireLimits:
    default_max_tokens: int
    max_tokens: int
    # A max_tokens the context cannot hold after the prompt: a 400 (false, the default, as
    # OpenAI and vLLM answer) or cut to what fits, the response saying so (true).
    clamp_max_tokens: bool = False


@dataclass
class CompletionRequest(Ask):
    """A validated chat or text completion request: the generation it asks for (an `Ask`,
    checked against the models by `admit`, daemon/admission.py) and what only the wire
    has."""

    model: str | None = None
    stream: bool = False
    include_usage: bool = False


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
            body = json.loads(raw)
        except ValueError as exc:
            if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
                raise
            body = json.loads(raw, parse_int=_parse_int)  # an integer past int()'s limit
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
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


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, open_lo=False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = _is_number(value) and (lo < value if open_lo else lo <= value) and value <= hi
    if not ok:
        bracket = "(" if open_lo else "["
        raise bad_request(f"{name} must be a number in {bracket}{lo}, {hi}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not lo <= value <= hi:
        raise bad_request(f"{name} must be an integer from {lo} to {hi}, got {value!r}", name)
    return value


# More entries than any client sends (OpenAI allows 300), fewer than would make each
# pass's bias step costly.
MAX_LOGIT_BIAS = 1024
TOKEN_ID = re.compile(r"[0-9]{1,9}")


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}, as (id, bias) pairs (the
    ids are checked against the model's vocabulary when the request is prepared)."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(
            f'logit_bias must be an object of up to {MAX_LOGIT_BIAS} "token id": bias entries',
            "logit_bias",
        )
    pairs: dict[int, float] = {}
    for key, value in raw.items():
        # ASCII digits only: str.isdigit also takes "²", which int() refuses.
        if not (isinstance(key, str) and TOKEN_ID.fullmatch(key)):
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias")
        if int(key) in pairs:  # "05" and "5": one token biased twice
            raise bad_request(f"logit_bias names token {int(key)} twice", "logit_bias")
        if not _is_number(value) or not -100 <= value <= 100:
            raise bad_request(
                f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}", "logit_bias"
            )
        pairs[int(key)] = float(value)
    return tuple(sorted(pairs.items()))


def _refuse_unsupported(body: dict) -> None:
    """Fields whose meaning specd cannot honour are refused rather than silently ignored."""
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request("n > 1 is not supported: specd returns one choice per request", "n")
    if body.get("functions"):
        raise bad_request("functions is not supported by specd (use tools)", "functions")
    if body.get("function_call") not in (None, "none"):
        raise bad_request("function_call is not supported by specd", "function_call")


def _response_format(body: dict) -> Grammar | None:
    """OpenAI's `response_format`: text (no grammar), `json_object` (any JSON object) or
    `json_schema` ({"name", "schema", "strict"}: output valid against the schema). The
    schema is compiled here, so one the engine cannot honour is refused before anything
    is queued; against the model's vocabulary it is checked when the prompt is made."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(
            'response_format must be an object, e.g. {"type": "json_object"}', "response_format"
        )
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object("response_format")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be text, json_object or json_schema; got {kind!r}",
            "response_format.type",
        )
    spec = fmt.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object with name and schema", where)
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise bad_request(
            f"{where}.name must be 1-64 letters, digits, underscores or dashes", f"{where}.name"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be true or false", f"{where}.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.schema must be a JSON Schema object", f"{where}.schema")
    grammar = Grammar.json_schema(schema, f"{where}.schema", name)
    grammar.validate()
    return grammar


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise bad_request(
            f"stop must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them",
            "stop",
        )
    return [_text(s, "stop") for s in stop]


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the request wants with its tokens' log-probabilities
    (None: none asked for). Chat: `logprobs` true, and `top_logprobs` 0..20; completions:
    `logprobs` 0..20 (OpenAI's legacy limit is 5; specd allows as many as chat)."""
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise bad_request("logprobs must be true or false", "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not wanted:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if wanted else None
    return _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def _common(body: dict, limits: WireLimits, chat: bool) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    max_tokens = _integer(body, "max_completion_tokens", 1, limits.max_tokens)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, limits.max_tokens)
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise bad_request(f"top_k must be a non-negative integer (0 = off), got {top_k!r}", "top_k")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and -(2**63) <= seed < 2**64):
        raise bad_request(f"seed must be a 64-bit integer, got {seed!r}", "seed")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    strategy = body.get("strategy")
    if strategy is not None and strategy not in STRATEGY_CHOICES:
        raise bad_request(f"strategy must be one of {', '.join(STRATEGY_CHOICES)}", "strategy")
    verification = body.get("tree_verification")
    if verification is not None and verification not in TREE_VERIFICATION_CHOICES:
        raise bad_request(
            f"tree_verification must be one of {', '.join(TREE_VERIFICATION_CHOICES)}",
            "tree_verification",
        )
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("ignore_eos must be true or false", "ignore_eos")
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        top_k=top_k or 0,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 10.0, open_lo=True),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=seed,
        logprobs=_logprobs(body, chat),
        logit_bias=_logit_bias(body),
    )
    return dict(
        model=model,
        params=params,
        max_tokens=max_tokens if max_tokens is not None else limits.default_max_tokens,
        max_tokens_given=max_tokens is not None,
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        strategy=strategy,
        budget=_integer(body, "budget", 1, 65536),
        tree_verification=verification,
        ignore_eos=ignore_eos,
        trace=_specd_options(body),
        grammar=_response_format(body),
    )


def _text(value: str, where: str) -> str:
    """`value` if it is text. JSON may spell a lone UTF-16 surrogate (`"\\ud800"`), which
    Python decodes to a string that no tokenizer can encode: refused, naming the field."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"{where} holds a lone surrogate ({value[exc.start]!r} at character {exc.start}), "
            "which is not text: characters outside the Basic Multilingual Plane are sent as "
            "a surrogate pair (\\ud83d\\ude00) or as UTF-8",
            where,
            code="invalid_unicode",
        ) from None
    return value


def _specd_options(body: dict) -> bool:
    """specd's own request options, in an extension object `specd`: {"trace": bool}."""
    options = body.get("specd")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request('specd must be an object, e.g. {"trace": true}', "specd")
    trace = options.get("trace", False)
    if not isinstance(trace, bool):
        raise bad_request("specd.trace must be true or false", "specd.trace")
    return trace


def _message_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return _text(content, where)
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(f"{where}: only text content parts are supported", where)
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: a text part needs a string 'text'", where)
            parts.append(_text(part["text"], f"{where}[{i}].text"))
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


def _tools(body: dict) -> tuple[list[Tool] | None, str | None, bool]:
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
        # No parameters: a function of no arguments (OpenAI's reading), {} as its arguments.
        parameters = fn.get("parameters", NO_ARGUMENTS)
        if not isinstance(parameters, dict):
            raise bad_request(
                f"{where}.function.parameters must be a JSON Schema object",
                f"{where}.function.parameters",
            )
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


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier `tool_calls`, arguments as objects (what chat
    templates write with `tojson`)."""
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
        arguments = fn.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise bad_request(
                f"{at}.function.arguments must be JSON text", f"{at}.function.arguments"
            ) from None
        out.append(
            {"id": call["id"], "type": "function",
             "function": {"name": fn["name"], "arguments": parsed}}
        )  # fmt: skip
    return out


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
        if role not in CHAT_ROLES:
            raise bad_request(
                f"{where}.role must be one of system, developer, user, assistant, tool; "
                f"got {role!r}",
                f"{where}.role",
            )
        content = _message_text(msg.get("content"), f"{where}.content")
        entry: dict[str, Any] = {"role": CHAT_ROLES[role], "content": content}
        if role == "assistant" and msg.get("tool_calls"):
            entry["tool_calls"] = _tool_calls(msg["tool_calls"], f"{where}.tool_calls")
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
    common = _common(body, limits, True)
    tools, choice, parallel = _tools(body)
    if tools is not None and choice != "none":
        if common["grammar"] is not None:
            raise bad_request(
                "response_format json_object/json_schema and tools cannot be combined (the "
                "answer is either a call or JSON); use tool_choice none",
                "response_format",
            )
        # Checked here in the fallback format (a schema the engine cannot compile is a 400
        # before the model is asked); the model's own format is made with its tokenizer.
        tool_grammar(HERMES, tools, choice, parallel, "tools")
    calls = tools is not None and choice != "none"
    return CompletionRequest(
        messages=normalised,
        prompt=None,
        tools=tools if calls else None,
        tool_choice=choice if calls else None,
        parallel_tool_calls=parallel,
        **common,
    )


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
    if best_of is not None and not (_is_int(best_of) and best_of == 1):
        raise bad_request("best_of other than 1 is not supported by specd", "best_of")


def parse_completion(body: dict[str, Any], limits: WireLimits) -> CompletionRequest:
    _refuse_unsupported(body)
    _refuse_unsupported_completion(body)
    for name in ("tools", "tool_choice"):
        if body.get(name) not in (None, [], "none"):
            raise bad_request(f"{name} is for chat completions (/v1/chat/completions)", name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        pass  # token ids, fed exactly
    elif isinstance(prompt, str):
        _text(prompt, "prompt")
    else:
        raise bad_request(
            "prompt must be a string or a list of token ids (one prompt per request)", "prompt"
        )
    return CompletionRequest(messages=None, prompt=prompt, **_common(body, limits, False))
