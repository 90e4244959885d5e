"""A request's own chat-template variables: `chat_template_kwargs` (vLLM's and llama.cpp's
field; Qwen3's `enable_thinking`) and `reasoning_effort` (OpenAI's; gpt-oss's template
writes it into its system message) reach the template; what they may name and hold is
checked at the wire, each refusal a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from daemon.http.openai_errors import ApiError
from daemon.http.openai_fields import WireLimits
from daemon.http.openai_wire import parse_chat, parse_completion
from daemon.http.server import BackgroundServer
from daemon.settings_loading import load_settings
from modeling.text.model_template import TEMPLATE_NAMES
from tests.templated import templated_copy

# The parts of Qwen3's and gpt-oss's templates that read these variables, as they read them.
TEMPLATE = (
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and enable_thinking is false %} once there was"
    "{% endif %}{% endif %}"
)
LIMITS = WireLimits(16, 64)
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def chat(**fields: Any) -> dict[str, Any]:
    return parse_chat({"messages": MESSAGES, **fields}, LIMITS).template_vars


def test_the_variables_reach_the_request() -> None:
    assert chat() == {}
    assert chat(chat_template_kwargs={"enable_thinking": False}) == {"enable_thinking": False}
    assert chat(reasoning_effort="low") == {"reasoning_effort": "low"}
    both = chat(chat_template_kwargs={"reasoning_effort": "high", "x": [1, {"y": "z"}]},
                reasoning_effort="high")  # fmt: skip
    assert both == {"reasoning_effort": "high", "x": [1, {"y": "z"}]}
    assert chat(chat_template_kwargs=None, reasoning_effort=None) == {}


def deep(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
        ({"chat_template_kwargs": {f"v{i}": 1 for i in range(65)}}, "chat_template_kwargs",
         "at most 64"),
        ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs", "identifiers"),
        ({"chat_template_kwargs": {"x" * 65: 1}}, "chat_template_kwargs", "identifiers"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages",
         "specd gives the chat template itself"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs.add_generation_prompt", "itself"),
        ({"chat_template_kwargs": {"raise_exception": 1}},
         "chat_template_kwargs.raise_exception", "itself"),
        ({"chat_template_kwargs": {"d": deep(65)}}, "chat_template_kwargs.d", "64 levels"),
        ({"chat_template_kwargs": {"s": "\ud800"}}, "chat_template_kwargs.s", ""),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "must be one of"),
        ({"reasoning_effort": ["low"]}, "reasoning_effort", "must be one of"),
        ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
         "reasoning_effort", "differ"),
        # (the same variable given the template: held to the field's values)
        ({"chat_template_kwargs": {"reasoning_effort": "extreme"}},
         "chat_template_kwargs.reasoning_effort", "must be one of"),
        ({"chat_template_kwargs": {"reasoning_effort": ["none"]}},
         "chat_template_kwargs.reasoning_effort", "must be one of"),
    ],
)  # fmt: skip
def test_what_the_variables_may_not_be(fields: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(ApiError) as err:
        chat(**fields)
    assert err.value.status == 400 and err.value.param == param
    assert says in err.value.message


@pytest.mark.parametrize("name", ["chat_template_kwargs", "reasoning_effort"])
def test_a_text_completion_has_no_template_to_give_them_to(name: str) -> None:
    value = {"enable_thinking": False} if name == "chat_template_kwargs" else "low"
    with pytest.raises(ApiError) as err:
        parse_completion({"prompt": "Once", name: value}, LIMITS)
    assert err.value.status == 400 and err.value.param == name


def test_every_name_the_template_environment_gives_is_reserved() -> None:
    """A request's variable would shadow a global of the sandbox's (`range`, `namespace`):
    TEMPLATE_NAMES holds each one the environment has."""
    from modeling.text.chat_template import compile_template

    template = compile_template("{{ 1 }}")
    assert set(template.environment.globals) <= TEMPLATE_NAMES


@pytest.fixture(scope="module")
def templated(stories_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stories model with TEMPLATE as its chat template."""
    return templated_copy(stories_target, tmp_path_factory.mktemp("templated") / "stories260k",
                          TEMPLATE)  # fmt: skip


@pytest.fixture(scope="module")
def client(templated: Path) -> Iterator[openai.OpenAI]:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(templated), "test"),
            "runtime.compile": ("off", "test"),
            "speculation.strategy": ("autoregressive", "test"),
            "server.port": (0, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def prompt_tokens(client: openai.OpenAI, **fields: Any) -> int:
    done = client.chat.completions.create(
        model="stories260k", messages=MESSAGES, max_tokens=2, temperature=0, **fields
    )
    assert done.usage is not None
    return done.usage.prompt_tokens


def test_the_template_renders_them_over_http(client: openai.OpenAI, templated: Path) -> None:
    """The official client's `reasoning_effort` and `extra_body` reach the template: each
    variable changes the prompt as the template writes it (counted in its tokens), against
    the tokenizer's own render."""
    from daemon.admission import _encode_conversation
    from modeling.checkpoints import checkpoint

    tokenizer = checkpoint.load_tokenizer(checkpoint.open_checkpoint(templated))
    for variables in ({}, {"enable_thinking": False}, {"reasoning_effort": "low"}):
        ids = _encode_conversation(tokenizer, MESSAGES, None, None, variables)
        text = tokenizer.render_chat(MESSAGES, variables=variables)
        assert ("once there was" in text) == ("enable_thinking" in variables)
        assert ("Reasoning: low" in text) == ("reasoning_effort" in variables)
        if "reasoning_effort" in variables:
            assert prompt_tokens(client, reasoning_effort="low") == len(ids)
        else:
            extra = {"chat_template_kwargs": variables} if variables else {}
            assert prompt_tokens(client, extra_body=extra) == len(ids)
    plain = prompt_tokens(client)
    assert (
        prompt_tokens(client, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        == plain
    )
    with pytest.raises(openai.BadRequestError) as err:
        prompt_tokens(client, extra_body={"chat_template_kwargs": {"tools": []}})
    assert err.value.body["param"] == "chat_template_kwargs.tools"  # type: ignore[index]
