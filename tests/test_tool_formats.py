"""Each model family's own tool-call format (speculative/tool_calls.py): Hermes (Qwen),
Llama 3's bare object with `parameters`, Mistral's [TOOL_CALLS] list. The stream reader on
every format in pieces of every size, the template detection, and through the daemon a
model whose chat template writes Llama 3's or Mistral's format: calls generated in it,
read back as OpenAI's, and a conversation with results rendered by the model's template.
The Hermes format through the daemon is tests/test_structured.py's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from daemon.http.server import BackgroundServer
from daemon.settings_loading import load_settings
from speculative.tool_calls import (
    HERMES,
    LLAMA3,
    MISTRAL,
    CallFormat,
    CallStream,
    native_format,
    read_answer,
)

# Brackets and braces inside strings, nested objects and lists: the arguments end where
# their object closes, whatever the characters around.
ARGUMENTS = ['{"q":"a}]\\"{","n":[{"b":[1,2]},{}],"o":{"p":{}}}', "{}"]


def written(fmt: CallFormat, calls: list[tuple[str, str]]) -> str:
    """`calls` as a model writes them in `fmt` (its special token decoded away)."""
    blocks = [
        f'{fmt.open}{{"name":{json.dumps(name)},"{fmt.arguments}":{args}}}{fmt.close}'
        for name, args in calls
    ]
    return fmt.begin + fmt.separator.join(blocks) + fmt.end


def streamed(fmt: CallFormat, text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    stream, events = CallStream(fmt), []
    for i in range(0, len(text), size):
        events += stream.feed(text[i : i + size])
    events += stream.finish()
    calls: dict[int, list[str]] = {}
    for event in events:
        if event[0] == "call":
            assert event[1] not in calls
            calls[event[1]] = [event[3], ""]
        elif event[0] == "arguments":
            calls[event[1]][1] += event[2]
    content = "".join(e[1] for e in events if e[0] == "content")
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.name)
def test_every_format_streams_its_calls_in_pieces_of_every_size(fmt: CallFormat) -> None:
    calls = [("search", ARGUMENTS[0]), ("clock", ARGUMENTS[1])][: 2 if fmt.parallel else 1]
    text = written(fmt, calls)
    for size in (1, 2, 3, 7, len(text)):
        assert streamed(fmt, text, size) == ("", calls)
    content, whole = read_answer(text, fmt)
    assert content == "" and [(c.name, c.arguments) for c in whole] == calls
    assert all(c.id.startswith("call_") for c in whole) or fmt.id_length
    if fmt.id_length:  # Mistral's templates take ids of 9 letters and digits only
        assert all(len(c.id) == 9 and c.id.isalnum() for c in whole)
    # A cut call passes on what was written of its arguments, streamed or whole.
    cut = text[: text.index('"q":') + 6]  # ... {"q":"a
    for size in (1, 4, len(cut)):
        assert streamed(fmt, cut, size) == ("", [("search", '{"q":"a')])
    # Text that only begins like a call is text.
    near = fmt.lead[:-1] + "x and more"
    for size in (1, len(near)):
        assert streamed(fmt, near, size) == (near, [])


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if tools %}Functions: {{ tools | tojson }}\n"
    'Answer with {"name": function name, "parameters": its arguments}.\n{% endif %}'
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}ipython: {{ m['content'] }}\n"
    "{% elif m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}\n'
    "{% endfor %}"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]"
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ m['content'] }}[/INST]"
    "{% elif m.get('tool_calls') %}[TOOL_CALLS][{% for c in m['tool_calls'] %}"
    "{% if c.id | length != 9 %}{{ raise_exception('tool call ids must be 9 characters') }}"
    '{% endif %}{"name": "{{ c.function.name }}", "arguments": '
    '{{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}{% if not loop.last %}, '
    "{% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def test_the_format_is_read_from_the_template() -> None:
    vocabulary = {"[TOOL_CALLS]": 3}
    assert native_format(LLAMA3_TEMPLATE, vocabulary) is LLAMA3
    assert native_format(MISTRAL_TEMPLATE, vocabulary) is MISTRAL
    assert native_format(MISTRAL_TEMPLATE, {}) is None  # no such token: the fallback
    assert native_format("{{ tools }}<tool_call>", {}) is HERMES
    assert native_format("{% for m in messages %}{{ m['content'] }}{% endfor %}", {}) is None
    assert native_format(None, vocabulary) is None


def model_with(tmp_path: Path, source: Path, template: str, special: str | None) -> Path:
    """A copy of `source` whose chat template is `template`; `special`: a special token
    put in the place of the byte token <0x00> (id 3), as Mistral's [TOOL_CALLS] is one."""
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    if special is not None:
        tokenizer_path = folder / "tokenizer.json"
        tokenizer = json.loads(tokenizer_path.read_text())
        vocab = tokenizer["model"]["vocab"]
        vocab[special] = vocab.pop("<0x00>")
        tokenizer["added_tokens"].append(
            {"id": vocab[special], "content": special, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )  # fmt: skip
        tokenizer_path.write_text(json.dumps(tokenizer))
    return folder


WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK: ChatCompletionToolParam = {"type": "function", "function": {"name": "get_time"}}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Lily"}]


@pytest.fixture(scope="module", params=["llama3", "mistral"])
def served(
    request: pytest.FixtureRequest, stories_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, openai.OpenAI]]:
    template, special = {
        "llama3": (LLAMA3_TEMPLATE, None),
        "mistral": (MISTRAL_TEMPLATE, "[TOOL_CALLS]"),
    }[request.param]
    folder = model_with(tmp_path_factory.mktemp(request.param), stories_target, template, special)
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(folder), "test"),
            "models.draft": (str(folder), "test"),  # itself: its tokenizer is the same
            "runtime.compile": ("off", "test"),
            "speculation.strategy": ("tree", "test"),
            "server.port": (0, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        yield (
            request.param,
            openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0),
        )


@pytest.mark.parametrize("strategy", ["autoregressive", "tree"])
def test_calls_in_the_models_own_format(served: tuple[str, openai.OpenAI], strategy: str) -> None:
    name, client = served
    ask = dict(
        model="model", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
        max_tokens=60, temperature=1.0, seed=5, extra_body={"strategy": strategy},
        parallel_tool_calls=False,
    )  # fmt: skip
    whole = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1
    for call in calls:
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time")
        assert set(args) == ({"city"} if call.function.name == "get_weather" else set())
        assert len(call.id) == 9 if name == "mistral" else call.id.startswith("call_")
    streamed_calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.id is not None:
                streamed_calls[delta.index] = [delta.function.name, ""]
            streamed_calls[delta.index][1] += delta.function.arguments or ""
    assert [tuple(streamed_calls[i]) for i in sorted(streamed_calls)] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    # The calls and their results go back through the model's own template (Mistral's
    # refuses ids that are not 9 characters: ours pass).
    history: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls],
        {"role": "user", "content": "And then?"},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model="model", messages=history, tools=[WEATHER], tool_choice="auto", max_tokens=12,
        temperature=0,
    )  # fmt: skip
    message = answer.choices[0].message
    assert (message.tool_calls is None) == (message.content is not None)


def test_several_calls_in_the_models_own_format(served: tuple[str, openai.OpenAI]) -> None:
    """Parallel calls where the format has room for them (Mistral's list), one where it
    has not (Llama 3): every announced call complete and valid, or the answer cut."""
    name, client = served
    seen = 0
    for seed in range(6):
        whole = client.chat.completions.create(
            model="model", messages=ASK, tools=[CLOCK], tool_choice="required",
            max_tokens=80, temperature=1.0, seed=seed,
        )  # fmt: skip
        choice = whole.choices[0]
        calls = choice.message.tool_calls or []
        if choice.finish_reason == "tool_calls":
            assert all(json.loads(c.function.arguments) == {} for c in calls)
        seen = max(seen, len(calls))
    assert seen > 1 if name == "mistral" else seen == 1


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=lambda f: f.name)
def test_a_call_cut_in_its_opening_is_text_only_where_text_may_be(fmt: CallFormat) -> None:
    """max_tokens may end an answer inside the call's opening (`<tool_call>\\n{"n`): with
    tool_choice auto that is the answer's text; where only calls may come (required, a
    named function) it is a call never begun, not text."""
    opening = fmt.lead[:-3]
    assert read_answer(opening, fmt) == (opening, [])
    assert read_answer(opening, fmt, calls_only=True) == ("", [])
    stream = CallStream(fmt, calls_only=True)
    assert stream.feed(opening) == [] and stream.finish() == []
