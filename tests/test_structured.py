"""Structured output: `response_format` json_object / json_schema through the official
`openai` client (its `parse()` included), greedy parity of constrained decoding across
strategies, forced tokens, compact JSON, the refusals, and masks at a real vocabulary's
width. Exact sampling under a grammar is tests/test_lossless.py's."""

from __future__ import annotations

import json
import math
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pydantic
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openai.types.shared_params import ResponseFormatJSONObject, ResponseFormatJSONSchema

from daemon.cli import main
from daemon.http.server import BackgroundServer
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from daemon.settings_loading import load_settings
from speculative.generation import Generation
from speculative.grammar import Constraint, Grammar, GrammarError
from speculative.grammar_masks import expand, mask_rows_
from speculative.sampling import SamplingParams
from speculative.tool_calls import CallStream, read_answer

MODEL = "stories260k"
PROMPT = "Once upon a time there was a girl. Her name was"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["dog", "cat", "bird"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "pet", "friends"],
    "additionalProperties": False,
}


class Story(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    pet: Literal["dog", "cat", "bird"]


def valid(answer: dict) -> bool:
    """`answer` against SCHEMA, checked by hand."""
    return (
        set(answer) == {"name", "age", "pet", "friends"}
        and isinstance(answer["name"], str)
        and len(answer["name"]) <= 12
        and isinstance(answer["age"], int)
        and 0 <= answer["age"] <= 120
        and answer["pet"] in ("dog", "cat", "bird")
        and isinstance(answer["friends"], list)
        and len(answer["friends"]) <= 2
        and all(isinstance(f, str) and len(f) <= 8 for f in answer["friends"])
    )


@pytest.fixture(scope="module")
def runtime(stories_target: Path, stories_draft: Path) -> Runtime:
    return Runtime(
        RuntimeOptions(model=str(stories_target), draft=str(stories_draft), device="cpu", budget=16)
    )


def constrained(runtime: Runtime, strategy: str, params: SamplingParams) -> Generation:
    grammar = Grammar.json_schema(SCHEMA, "response_format")
    grammar.check(runtime.tokenizer)
    built = runtime.strategy(strategy)
    constraint = Constraint(grammar, runtime.tokenizer, runtime.target.vocab_width)
    ids = runtime.tokenizer.encode(PROMPT)
    return Generation(
        built, runtime.new_session(built), runtime.tokenizer, ids, params, 120,
        constraint=constraint,
    ).run()  # fmt: skip


def constrained_text(runtime: Runtime, grammar: Grammar) -> str:
    """Greedy constrained autoregressive decoding of PROMPT: the reference."""
    built = runtime.strategy("autoregressive")
    return Generation(
        built, runtime.new_session(built), runtime.tokenizer, runtime.tokenizer.encode(PROMPT),
        SamplingParams(temperature=0.0), 40,
        constraint=Constraint(grammar, runtime.tokenizer, runtime.target.vocab_width),
    ).run().text  # fmt: skip


def test_greedy_constrained_output_is_the_same_for_every_strategy(runtime: Runtime) -> None:
    greedy = SamplingParams(temperature=0.0)
    outputs = {s: constrained(runtime, s, greedy) for s in ("autoregressive", "linear", "tree")}
    texts = {s: g.text for s, g in outputs.items()}
    assert len(set(texts.values())) == 1, texts
    gen = outputs["tree"]
    assert gen.finish_reason == "stop" and valid(json.loads(gen.text))
    assert "\n" not in gen.text and ": " not in gen.text  # compact JSON
    # Braces, key names and quotes the grammar allows alone are emitted without a pass.
    assert all(g.stats.forced_tokens >= 10 for g in outputs.values())
    auto = outputs["autoregressive"].stats
    assert auto.target_passes + auto.forced_tokens >= auto.generated_tokens


def test_sampled_constrained_output_is_valid_and_seeds_repeat(runtime: Runtime) -> None:
    for strategy in ("autoregressive", "linear", "tree"):
        for seed in range(4):
            params = SamplingParams(temperature=1.0, seed=seed)
            gen = constrained(runtime, strategy, params)
            assert gen.finish_reason == "stop" and valid(json.loads(gen.text)), gen.text
            # A seed walks the tree: the text is autoregressive decoding's for that seed.
            if strategy == "tree":
                twin = constrained(runtime, "autoregressive", params)
                assert twin.token_ids == gen.token_ids


def test_masks_at_a_128k_vocabulary_cover_exactly_the_allowed_ids() -> None:
    """The expansion from mask words to a row of the logits' width: ids past the
    tokenizer (a padded embedding) are never allowed, and masking a (t, V) block works
    row by row in place."""
    width = 128_256
    words = torch.zeros(4_000, dtype=torch.int32)  # a 128,000-token vocabulary
    allowed = [0, 31, 32, 1_000, 127_999]
    for i in allowed:
        words[i // 32] |= torch.tensor(1 << (i % 32), dtype=torch.int64).to(torch.int32)
    row = expand(words, width)
    assert row.shape == (width,) and row.nonzero().flatten().tolist() == allowed
    logits = torch.zeros(3, width)
    mask_rows_(logits, torch.stack([words, words, torch.full_like(words, -1)]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == allowed
    assert int(torch.isfinite(logits[2]).sum()) == 128_000  # the padding rows stay out


def test_what_the_engine_cannot_do_is_refused_naming_the_field(runtime: Runtime) -> None:
    for schema, words in [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "strin"}, "strin"),
        ({"type": "object", "properties": {"a": {"$ref": "http://x.example/a.json"}}}, "x.example"),
    ]:
        with pytest.raises(GrammarError, match=words) as err:
            Grammar.json_schema(schema, "response_format.json_schema.schema").check(
                runtime.tokenizer
            )
        assert err.value.param == "response_format.json_schema.schema"


def test_a_schema_no_text_matches_is_refused_before_generation(runtime: Runtime) -> None:
    """A schema that refers to itself and nothing else matches no text: the engine stops
    at its first mask ("NoExtensionBias"), which once ended the answer at once, empty,
    with finish_reason "stop" and a 200. Now a 400 naming the field, at the constraint's
    making (before any pass) and at `check` alike."""
    field = "response_format.json_schema.schema"
    for schema in (
        {"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    ):
        grammar = Grammar.json_schema(schema, field)
        with pytest.raises(GrammarError, match="no text matches") as err:
            grammar.check(runtime.tokenizer)
        assert (err.value.param, err.value.code) == (field, "unsupported_grammar")
        with pytest.raises(GrammarError, match="no text matches") as err:
            Constraint(grammar, runtime.tokenizer, runtime.target.vocab_width)
        assert (err.value.param, err.value.code) == (field, "unsupported_grammar")


def test_an_engine_limit_reached_while_generating_is_the_requests_error(runtime: Runtime) -> None:
    """500 optional properties pass the schema limits and the first mask, but a later
    token takes the engine past its 2,000 Earley items in a row: a 400 naming the field
    (it was a RuntimeError, a 500, mid-answer)."""
    field = "response_format.json_schema.schema"
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}
    constraint = Constraint(Grammar.json_schema(schema, field), runtime.tokenizer,
                            runtime.target.vocab_width)  # fmt: skip
    with pytest.raises(GrammarError, match="max is 2000") as err:
        for _ in range(12):  # the second token each mask allows: '{', '"', then a name
            allowed = expand(constraint.words(), constraint.width).nonzero().flatten()
            constraint.commit([int(allowed[min(1, len(allowed) - 1)])])
    assert (err.value.param, err.value.code) == (field, "unsupported_grammar")


def test_a_pattern_past_the_lexers_limit_is_the_requests_error(runtime: Runtime) -> None:
    """`^(a{1000}){1000}$` compiles, and its mask allows the opening quote, but taking it
    makes the engine's lexer build too many expressions: a 400 naming the field (it was a
    500 mid-answer, an attacker found; the same pattern in a tool's parameters already
    stopped at the mask)."""
    field = "response_format.json_schema.schema"
    grammar = Grammar.json_schema({"type": "string", "pattern": "^(a{1000}){1000}$"}, field)
    grammar.check(runtime.tokenizer)
    constraint = Constraint(grammar, runtime.tokenizer, runtime.target.vocab_width)
    allowed = expand(constraint.words(), constraint.width).nonzero().flatten().tolist()
    with pytest.raises(GrammarError, match="too many expressions") as err:
        constraint.commit([allowed[0]])
    assert (err.value.param, err.value.code) == (field, "unsupported_grammar")
    assert str(err.value).endswith("too many expressions constructed")  # no engine markup


def test_a_refused_token_whose_text_names_a_limit_is_still_a_bug(runtime: Runtime) -> None:
    """The engine's refusal of a drawn token quotes the token's text: words such as
    "limit" there must not turn the mask/draw disagreement (a bug: a 500) into the
    request's 400; only the engine's own limit messages do."""

    class Refusing:  # the matcher's three calls `commit` makes, refusing with `said`
        def __init__(self, said: str) -> None:
            self.said = said

        def is_stopped(self) -> bool:
            return False

        def consume_token(self, token: int) -> bool:
            return False

        def get_error(self) -> str:
            return self.said

    field = "response_format.json_schema.schema"
    grammar = Grammar.json_schema({"type": "object"}, field)
    for said, error in [
        ('Parser Error: token "max is fuel limit" doesn\'t satisfy the grammar', RuntimeError),
        ("Parser Error: Current row has 2007 items; max is 2000", GrammarError),
        ("lexer error: too many expressions constructed\n<non-verbose/>", GrammarError),
    ]:
        constraint = Constraint(grammar, runtime.tokenizer, runtime.target.vocab_width)
        constraint.matcher = Refusing(said)  # type: ignore[assignment]
        with pytest.raises(error) as raised:
            constraint.commit([5])
        assert type(raised.value) is error


# -- through the daemon ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(stories_target: Path, stories_draft: Path) -> Iterator[BackgroundServer]:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "test"),
            "models.draft": (str(stories_draft), "test"),
            "runtime.compile": ("off", "test"),
            "speculation.strategy": ("tree", "test"),
            "server.port": (0, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
JSON_SCHEMA: ResponseFormatJSONSchema = {
    "type": "json_schema",
    "json_schema": {"name": "story", "schema": SCHEMA},
}
JSON_OBJECT: ResponseFormatJSONObject = {"type": "json_object"}


@pytest.mark.parametrize("strategy", ["autoregressive", "linear", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_the_pydantic_object(
    client: openai.OpenAI, strategy: str, temperature: float
) -> None:
    resp = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Story, max_tokens=100,
        temperature=temperature, extra_body={"strategy": strategy},
    )  # fmt: skip
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Story) and resp.choices[0].finish_reason == "stop"


def test_a_stream_reassembles_to_the_same_valid_json(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=JSON_SCHEMA, max_tokens=100,
        temperature=0,
    )  # fmt: skip
    text = whole.choices[0].message.content or ""
    assert valid(json.loads(text))
    parts = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=JSON_SCHEMA, max_tokens=100,
        temperature=0, stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == text
    assert whole.model_extra is not None and whole.model_extra["specd"]["forced_tokens"] > 0


def test_json_object_mode_and_legacy_completions(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=JSON_OBJECT, max_tokens=80,
        temperature=0,
    )  # fmt: skip
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens mid-object: a prefix of an object
        assert (resp.choices[0].message.content or "").startswith("{")
    done = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=100, temperature=0,
        extra_body={"response_format": JSON_SCHEMA},
    )  # fmt: skip
    assert valid(json.loads(done.choices[0].text))


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"not": {}}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
         "response_format.json_schema.name"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": []}},
         "response_format.json_schema.schema"),
        ("json", "response_format"),
    ],
)  # fmt: skip
def test_a_bad_response_format_is_a_400_naming_the_field(
    client: openai.OpenAI, response_format: object, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10,
            extra_body={"response_format": response_format},
        )  # fmt: skip
    assert err.value.body is not None and err.value.body["param"] == param  # type: ignore[index]


def test_the_command_line_takes_a_schema_file(
    capsys: pytest.CaptureFixture[str], stories_target: Path, tmp_path: Path
) -> None:
    schema = tmp_path / "pet.json"
    schema.write_text(json.dumps(SCHEMA))
    argv = ["generate", "--model", str(stories_target), "--prompt", PROMPT, "--json"]
    assert main([*argv, "--json-schema", str(schema), "--max-tokens", "100"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert valid(json.loads(record["text"])) and record["stats"]["forced_tokens"] > 0
    assert main([*argv, "--json-object", "--max-tokens", "100"]) == 0
    assert json.loads(capsys.readouterr().out)["text"].startswith("{")
    schema.write_text('{"type": "array", "uniqueItems": true}')
    assert main([*argv, "--json-schema", str(schema)]) == 2
    assert "uniqueItems" in capsys.readouterr().err
    for value, says in (("NaN", "NaN is not a JSON value"), ("1e999", "past a float's range")):
        schema.write_text(f'{{"type": "object", "properties": {{"a": {{"const": {value}}}}}}}')
        assert main([*argv, "--json-schema", str(schema)]) == 2  # (was a const of null)
        assert says in capsys.readouterr().err


# -- tool calls ---------------------------------------------------------------------------

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Lily"}]
CLOCK: ChatCompletionToolParam = {"type": "function", "function": {"name": "get_time"}}


def weather_arguments_valid(arguments: str) -> bool:
    args = json.loads(arguments)
    return (
        set(args) == {"city", "unit"}
        and isinstance(args["city"], str)
        and len(args["city"]) <= 8
        and args["unit"] in ("celsius", "fahrenheit")
    )


@pytest.mark.parametrize("strategy", ["autoregressive", "linear", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_call_validates_and_streams_the_same(
    client: openai.OpenAI, strategy: str, temperature: float
) -> None:
    ask = dict(
        model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
        parallel_tool_calls=False, max_tokens=100, temperature=temperature, seed=3,
        extra_body={"strategy": strategy},
    )  # fmt: skip
    whole = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert (
        calls
        and len(calls) == 1
        and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    )
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            assert weather_arguments_valid(call.function.arguments)
        else:
            assert json.loads(call.function.arguments) == {}
    # Streamed: index, id and name first, then argument fragments; reassembled, the same
    # calls (same seed: the same text).
    streamed: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in client.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
        if not chunk.choices:
            continue
        reason = chunk.choices[0].finish_reason or reason
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index not in streamed and delta.function.name
                streamed[delta.index] = {"name": delta.function.name, "arguments": ""}
            streamed[delta.index]["arguments"] += delta.function.arguments or ""
        assert not chunk.choices[0].delta.content
    assert reason == "tool_calls"
    assert [(s["name"], s["arguments"]) for _, s in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_do_not_cut_a_required_call(client: openai.OpenAI, stream: bool) -> None:
    """A call generated under its grammar is never cut by a stop string: "}" cut its
    arguments mid-object (still reported as tool_calls) and "\n", the Hermes format's own,
    left an empty message with finish_reason stop (an attacker found)."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        ask = dict(
            model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=choice,
            parallel_tool_calls=False, max_tokens=100, temperature=0, stop=["}", "\n", '"'],
        )  # fmt: skip
        if not stream:
            answer = client.chat.completions.create(**ask)  # type: ignore[call-overload]
            calls, reason = answer.choices[0].message.tool_calls, answer.choices[0].finish_reason
            assert calls and weather_arguments_valid(calls[0].function.arguments)
        else:
            arguments, reason = "", None
            for chunk in client.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
                if chunk.choices:
                    reason = chunk.choices[0].finish_reason or reason
                    for delta in chunk.choices[0].delta.tool_calls or []:
                        arguments += delta.function.arguments or ""
            assert weather_arguments_valid(arguments)
        assert reason == "tool_calls"


def _logprob_entries(client: openai.OpenAI, ask: dict) -> tuple[int, int, str, str]:
    """(entries of the whole answer, of the stream; the content of each)."""
    whole = client.chat.completions.create(**ask).choices[0]  # type: ignore[call-overload]
    content = whole.logprobs.content if whole.logprobs is not None else None
    entries, text = 0, ""
    for chunk in client.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs is not None:
                entries += len(chunk.choices[0].logprobs.content or [])
    return len(content or []), entries, whole.message.content or "", text


def test_a_calls_log_probabilities_are_left_out_streamed_or_not(
    client: openai.OpenAI, runtime: Runtime
) -> None:
    """A call's tokens are not content: neither answer gives their log-probabilities (the
    whole answer gave 27 entries spelling the call's markup, the stream none; with two
    tools whose names share a start, a round could end inside the call's head, and the
    stream gave that head's, a reviewer found). An answer under `auto` that ends while it
    could still begin a call is text: both give its entries."""
    ask = dict(
        model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
        max_tokens=100, parallel_tool_calls=False, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    assert _logprob_entries(client, ask)[:2] == (0, 0)
    for cut in (2, 6, 10):  # a call cut in its head: no call, no content, no entries
        assert _logprob_entries(client, {**ask, "max_tokens": cut})[:2] == (0, 0)
    lt = runtime.tokenizer.encode("<")[-1]
    undecided = {**ask, "tool_choice": "auto", "max_tokens": 1, "logit_bias": {str(lt): 100}}
    assert _logprob_entries(client, undecided) == (1, 1, "<", "<")


def test_named_choice_auto_and_a_conversation_with_results(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=100, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    calls = named.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather"
    auto = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=30,
        temperature=0,
    )  # fmt: skip
    message = auto.choices[0].message
    assert (message.tool_calls is None) == (message.content is not None)
    history: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function",
             "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"sky": "clear"}'},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=20,
        temperature=0,
    )  # fmt: skip
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_a_call_cut_by_max_tokens_can_be_sent_back(client: openai.OpenAI) -> None:
    """A call cut short keeps what was written of its arguments, which is no JSON: sent
    back in the conversation (as a client does with any answer) it was a 400 naming them.
    They go to the template as text, as OpenAI takes them."""
    cut = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut: no JSON
    history: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=5,
        temperature=0,
    )  # fmt: skip
    assert answer.choices[0].message.content


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]},
         "tools[0].function.parameters"),
        ({"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
         "messages[0].tool_call_id"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "tool", "tool_call_id": [], "content": "1"}]},
         "messages[0].tool_call_id"),
        ({"tool_choice": {"type": "function", "function": {"name": []}}}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_field(
    server: BackgroundServer, change: dict, param: str
) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    request = urllib.request.Request(
        server.url + "/v1/chat/completions", json.dumps({**body, **change}).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["param"] == param


def test_several_calls_stream_as_they_are_written() -> None:
    """Two calls, fed in pieces of every size: each call's start, then its arguments,
    reassembling to exactly what was written (a brace inside a string included)."""
    text = (
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name":"get_time","arguments":{"zone":"}"}}\n</tool_call>'
    )
    content, whole = read_answer(text)
    assert content == ""
    assert [(c.name, c.arguments) for c in whole] == [
        ("get_weather", '{"city":"Paris","unit":"celsius"}'),
        ("get_time", '{"zone":"}"}'),
    ]
    for size in (1, 2, 5, 13, len(text)):
        stream, events = CallStream(), []
        for i in range(0, len(text), size):
            events += stream.feed(text[i : i + size])
        events += stream.finish()
        calls: dict[int, list[str]] = {}
        for event in events:
            assert event[0] != "content"
            if event[0] == "call":
                calls[event[1]] = [event[3], ""]
            else:
                calls[event[1]][1] += event[2]
        assert [tuple(calls[i]) for i in sorted(calls)] == [(c.name, c.arguments) for c in whole]
    text_answer = CallStream()
    assert text_answer.feed("<to") == [] and text_answer.feed("day") == [("content", "<today")]


def test_each_committed_state_masks_once(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forced-token check, the root's draft row and the first draw all read the
    committed state's mask: computed once per state, not once per use (at a 128k
    vocabulary a mask costs tens to hundreds of microseconds)."""
    computed = 0
    compute = Constraint._compute

    def counting(self: Constraint) -> torch.Tensor:
        nonlocal computed
        computed += 1
        return compute(self)

    monkeypatch.setattr(Constraint, "_compute", counting)
    gen = constrained(runtime, "autoregressive", SamplingParams(temperature=0.0))
    # One per emitted token's state, one at the end (the finished grammar's end of text).
    assert computed <= len(gen.token_ids) + 1


def test_the_schema_features_the_readme_lists_compile(runtime: Runtime) -> None:
    schema = {
        "$defs": {"pet": {"enum": ["dog", "cat"]}},
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
            "pet": {"$ref": "#/$defs/pet"},
            "size": {"anyOf": [{"type": "integer", "minimum": 1}, {"const": "big"}]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        },
        "required": ["code", "pet", "size"],
        "additionalProperties": False,
    }
    Grammar.json_schema(schema, "response_format.json_schema.schema").check(runtime.tokenizer)


def test_what_the_vocabulary_cannot_spell_is_refused_before_generation(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A word-level vocabulary of a..e (no byte fallback): a grammar that needs a z, first
    or after an a, is refused naming the field (the engine looks ahead: a path that leads
    to an unspellable character is never allowed), and one it can spell is not."""
    rt = Runtime(RuntimeOptions(model=str(tiny_checkpoint(vocab_size=8)), device="cpu"))
    for pattern in ("z", "az"):
        with pytest.raises(GrammarError, match="cannot spell") as err:
            Grammar.regex(pattern, "grammar").check(rt.tokenizer)
        assert err.value.param == "grammar"
    Grammar.regex("a(z|b)", "grammar").check(rt.tokenizer)
    constraint = Constraint(Grammar.regex("a(z|b)", "grammar"), rt.tokenizer, 8)
    assert constraint.take_forced(4) == [3, 4, 2]  # a, then b (z cannot be), then the end


def test_completions_refuse_tools(server: BackgroundServer) -> None:
    body = {"model": MODEL, "prompt": "Lily", "tools": [WEATHER], "max_tokens": 5}
    request = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["param"] == "tools"


@pytest.mark.parametrize(
    "cut",
    [
        '<tool_call>\n{"name":"f","arguments":{"a":"hello wor',
        '<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>\n<tool_call>\n{"name":"g","ar',
        '<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>\n<tool_call>\n{"name":"g","arguments":{"b',
        '<tool_call>\n{"na',
    ],
)
def test_a_cut_call_reads_the_same_streamed_and_whole(cut: str) -> None:
    """An answer cut by max_tokens or a stop string mid-call: the whole answer's calls are
    exactly what the stream announced and sent, held-back characters included."""
    content, whole = read_answer(cut)
    for size in (1, 3, len(cut)):
        stream, events = CallStream(), []
        for i in range(0, len(cut), size):
            events += stream.feed(cut[i : i + size])
        events += stream.finish()
        calls: dict[int, list[str]] = {}
        for event in events:
            if event[0] == "call":
                calls[event[1]] = [event[3], ""]
            elif event[0] == "arguments":
                calls[event[1]][1] += event[2]
        assert [tuple(calls[i]) for i in sorted(calls)] == [(c.name, c.arguments) for c in whole]
        assert "".join(e[1] for e in events if e[0] == "content") == content


@pytest.mark.parametrize("strategy", ["autoregressive", "linear", "tree"])
def test_a_grammar_that_may_end_mid_chain(runtime: Runtime, strategy: str) -> None:
    """A top-level string schema: the end of text may come inside a drafted chain or tree;
    nothing past it is committed to the grammar, the output is a valid string, greedy
    output the same for every strategy."""
    grammar = Grammar.json_schema({"type": "string", "maxLength": 6}, "response_format")
    outputs = []
    for params in [SamplingParams(temperature=0.0), *(SamplingParams(seed=s) for s in range(6))]:
        built = runtime.strategy(strategy)
        gen = Generation(
            built, runtime.new_session(built), runtime.tokenizer,
            runtime.tokenizer.encode(PROMPT), params, 40,
            constraint=Constraint(grammar, runtime.tokenizer, runtime.target.vocab_width),
        ).run()  # fmt: skip
        value = json.loads(gen.text)
        assert gen.finish_reason == "stop" and isinstance(value, str) and len(value) <= 6
        outputs.append(gen.text)
    reference = constrained_text(runtime, grammar)
    assert outputs[0] == reference


def test_mask_words_expand_bit_for_bit() -> None:
    """Every bit of random mask words (sign bits included) against a bit-by-bit reading;
    ids past the words' coverage are never allowed."""
    words = torch.randint(-(2**31), 2**31 - 1, (3, 40), dtype=torch.int32)
    reference = torch.tensor(
        [[(int(row[i // 32]) >> (i % 32)) & 1 for i in range(1280)] for row in words],
        dtype=torch.bool,
    )
    assert torch.equal(expand(words, 1280), reference)
    wider = expand(words, 1300)
    assert torch.equal(wider[:, :1280], reference) and not wider[:, 1280:].any()


def test_logprobs_under_a_grammar_are_json(server: BackgroundServer) -> None:
    """Forbidden tokens are no alternatives: a grammar allowing fewer than top_logprobs
    tokens gives fewer, never -Infinity (which is not JSON), whole and streamed."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the body")

    body = {"model": MODEL, "messages": MESSAGES, "response_format": JSON_SCHEMA,
            "max_tokens": 30, "temperature": 0, "logprobs": True, "top_logprobs": 20}  # fmt: skip
    for stream in (False, True):
        request = urllib.request.Request(
            server.url + "/v1/chat/completions", json.dumps({**body, "stream": stream}).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request) as reply:
            raw = reply.read().decode()
        parts = (
            [line[6:] for line in raw.splitlines() if line.startswith("data: {")]
            if stream
            else [raw]
        )
        for part in parts:
            json.loads(part, parse_constant=refuse)
        assert "logprob" in raw


def test_forbidden_tokens_are_no_logprob_alternatives() -> None:
    from speculative.sampling import token_logprob

    logits = torch.full((10,), float("-inf"))
    logits[[2, 5]] = torch.tensor([1.0, 0.5])
    found = token_logprob(logits, 2, top=5)
    assert [t for t, _ in found.top] == [2, 5]
    assert all(math.isfinite(lp) for _, lp in found.top) and math.isfinite(found.logprob)


def _pair(merge: str | list[str]) -> list[str]:
    return merge.split(" ") if isinstance(merge, str) else merge


def test_a_vocabulary_the_engine_cannot_read_is_a_400_and_remembered(
    stories_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token of over 1,023 bytes (342 CJK characters: under the 1,024-character bound
    on a token) panics the grammar engine: every json_object request had its connection
    closed unanswered, each after seconds of rebuilding the engine's vocabulary. Now a 400
    naming the field, the engine tried once, the daemon serving on."""
    from speculative import grammar_vocabulary

    folder = tmp_path / "model"
    shutil.copytree(stories_target, folder)
    tokenizer_file = folder / "tokenizer.json"
    tokenizer_file.chmod(0o644)
    spec = json.loads(tokenizer_file.read_text())
    vocab = spec["model"]["vocab"]
    last = next(piece for piece, i in vocab.items() if i == 511)  # (the last merge's piece)
    vocab["東" * 342] = vocab.pop(last)
    merges = spec["model"]["merges"]
    spec["model"]["merges"] = [m for m in merges if last not in (*_pair(m), "".join(_pair(m)))]
    tokenizer_file.write_text(json.dumps(spec))
    built: list[object] = []
    engine_vocabulary = grammar_vocabulary._engine_vocabulary
    monkeypatch.setattr(
        grammar_vocabulary,
        "_engine_vocabulary",
        lambda tokenizer: built.append(tokenizer) or engine_vocabulary(tokenizer),
    )
    settings = load_settings(
        environ={},
        overrides={"models.target": (str(folder), "test"), "server.port": (0, "test")},
    )
    body = {
        "model": "model", "messages": MESSAGES, "max_tokens": 4, "response_format": JSON_OBJECT,
    }  # fmt: skip
    with BackgroundServer(settings) as srv:
        for _ in range(2):
            request = urllib.request.Request(
                srv.url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(request, timeout=60)
            assert answer.value.code == 400
            error = json.loads(answer.value.read())["error"]
            assert error["param"] == "response_format"
            assert error["message"].startswith(
                "response_format cannot be used with this model: its vocabulary holds a token "
                "of 1,026 bytes (id 511); the grammar engine reads tokens of at most 1,023"
            )
        plain = {**body, "response_format": None}
        del plain["response_format"]
        request = urllib.request.Request(
            srv.url + "/v1/chat/completions",
            data=json.dumps(plain).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert json.loads(answer.read())["choices"][0]["message"]["content"] is not None
    assert len(built) == 1  # tried once, its failure remembered
