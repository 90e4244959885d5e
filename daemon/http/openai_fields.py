"""The OpenAI wire format's fields that chat and text completions share: sampling
(`temperature`, `top_p`, `top_k`, `min_p`, the penalties, `seed`, `logit_bias`), `max_tokens`,
`stop`, `logprobs`, `stream`, `response_format`, and specd's own (`strategy`, `budget`,
`tree_verification`, `ignore_eos`, `specd.trace`), each read and range-checked into what
`generation_fields` returns, or refused with a 400 naming it. Whatever depends on the model
(token ids against the vocabulary, the prompt against the context) is admission's
(daemon/admission.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from daemon.http.openai_errors import bad_request
from daemon.settings import STRATEGY_CHOICES, TREE_VERIFICATION_CHOICES
from speculative.grammar import Grammar
from speculative.sampling import MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY, SamplingParams
from speculative.schema_limits import SchemaLimits, check_schema

MAX_STOP_STRINGS = 16
# A request without `temperature` samples at 1, as OpenAI's API does (the web chat's
# Temperature box, left empty, sends none: GET /v1/specd/status tells it this value).
DEFAULT_TEMPERATURE = 1.0

# response_format.json_schema.name and a tool's function name, as OpenAI spells them.
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class WireLimits:
    default_max_tokens: int
    max_tokens: int
    # A max_tokens the context cannot hold after the prompt: a 400 (false, the default, as
    # OpenAI and vLLM answer) or cut to what fits, the response saying so (true).
    clamp_max_tokens: bool = False
    schemas: SchemaLimits = field(default_factory=SchemaLimits)  # limits.schema_*


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
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
    if not is_int(value) or not lo <= value <= hi:
        raise bad_request(f"{name} must be an integer from {lo} to {hi}, got {value!r}", name)
    return value


def _budget(body: dict) -> int | None:
    """specd's `budget`: a tree's node count. Its upper bound is the daemon's memory plan,
    checked when the request is admitted (`budget_too_large`, naming the largest)."""
    value = body.get("budget")
    if value is not None and (not is_int(value) or value < 1):
        raise bad_request(f"budget must be a positive integer (nodes), got {value!r}", "budget")
    return value


# More entries than any client sends (OpenAI allows 300), fewer than would make each
# pass's bias step costly.
MAX_LOGIT_BIAS = 1024
TOKEN_ID = re.compile(r"[0-9]{1,9}")


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}, as (id, bias) pairs (the
    ids are checked against the model's vocabulary when the request is admitted)."""
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


def _response_format(body: dict, limits: WireLimits) -> Grammar | None:
    """OpenAI's `response_format`: text (no grammar), `json_object` (any JSON object) or
    `json_schema` ({"name", "schema", "strict"}: output valid against the schema). The
    schema is measured against `limits.schemas` here and converted to the engine's
    grammar; it is compiled against the model's vocabulary when the request is admitted."""
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
    # Measured before the engine converts it (its recursion, its time); compiled, on a
    # thread of the grammar compiler's, when the request is admitted.
    check_schema(schema, f"{where}.schema", limits.schemas)
    checked_schema_text(schema, f"{where}.schema")
    return Grammar.json_schema(schema, f"{where}.schema", name)


def checked_schema_text(schema: dict, where: str) -> None:
    """A schema's strings and keys are text (`checked_text`): a lone surrogate in a tool's
    parameters reached the grammar engine, whose refusal named no field ("unexpected end
    of hex escape")."""
    try:
        written = json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError):  # (check_schema refuses what cannot be written)
        return
    checked_text(written, where)


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
    return [checked_text(s, "stop") for s in stop]


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


def generation_fields(body: dict, limits: WireLimits, chat: bool) -> dict[str, Any]:
    """The fields chat and text completions share, as `CompletionRequest`'s keyword
    arguments (`chat`: the chat endpoint's spelling of `logprobs`)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    # OpenAI's new name and its old one: each checked; where both are given they agree.
    max_tokens, field_name = _integer(body, "max_completion_tokens", 1, limits.max_tokens), ""
    old_name = _integer(body, "max_tokens", 1, limits.max_tokens)
    if max_tokens is not None and old_name is not None and old_name != max_tokens:
        raise bad_request(
            f"max_tokens ({old_name}) and max_completion_tokens ({max_tokens}) differ; send one",
            "max_tokens",
        )
    if max_tokens is not None:
        field_name = "max_completion_tokens"
    else:
        max_tokens, field_name = old_name, "max_tokens"
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's spelling of "off"
        top_k = 0
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise bad_request(f"top_k must be a non-negative integer (0 = off), got {top_k!r}", "top_k")
    seed = body.get("seed")
    if seed is not None and not (is_int(seed) and -(2**63) <= seed < 2**64):
        raise bad_request(f"seed must be a 64-bit integer, got {seed!r}", "seed")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    if options is not None and not stream:  # (as OpenAI and vLLM answer)
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):  # ("false" is a true value to bool())
        raise bad_request(
            "stream_options.include_usage must be true or false", "stream_options.include_usage"
        )
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
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        top_k=top_k or 0,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, MIN_REPETITION_PENALTY, 10.0),
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
        max_tokens_field=field_name,
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        strategy=strategy,
        budget=_budget(body),
        tree_verification=verification,
        ignore_eos=ignore_eos,
        trace=_specd_options(body),
        grammar=_response_format(body, limits),
    )


def checked_text(value: str, where: str) -> str:
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
