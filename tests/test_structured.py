"""Structured output: `response_format` json_object / json_schema through the official
`openai` client (its `parse()` included), greedy parity of constrained decoding across
strategies, forced tokens, compact JSON, the refusals, and masks at a real vocabulary's
width. Exact sampling under a grammar is tests/test_lossless.py's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pydantic
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONObject, ResponseFormatJSONSchema

from daemon.cli import main
from daemon.http.server import BackgroundServer
from daemon.runtime import Runtime, RuntimeOptions
from daemon.settings_loading import load_settings
from speculative.generation import Generation
from speculative.grammar import Constraint, Grammar, GrammarError, expand, mask_rows_
from speculative.sampling import SamplingParams

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
