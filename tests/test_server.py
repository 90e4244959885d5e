"""A live daemon on 127.0.0.1 driven by the official `openai` client: answers must equal
the same generation run in-process, token for token, with the usage counted right."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from daemon.http.server import BackgroundServer
from daemon.options import RuntimeOptions
from daemon.runtime import STRATEGY_BUILDERS, Runtime
from daemon.settings_loading import load_settings
from speculative.generation import Generation
from speculative.sampling import SamplingParams

MODEL = "stories260k"


@pytest.fixture(scope="module")
def server(stories_target: Path, stories_draft: Path) -> Iterator[BackgroundServer]:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "test"),
            "runtime.compile": ("off", "test"),
            "models.draft": (str(stories_draft), "test"),
            "speculation.strategy": ("autoregressive", "test"),  # others via the request field
            "server.port": (0, "test"),
            "server.keepalive_seconds": (0.05, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(stories_target: Path) -> Runtime:
    return Runtime(RuntimeOptions(model=str(stories_target), device="cpu"))


def in_process(runtime: Runtime, prompt_ids: list[int], max_tokens: int) -> Generation:
    greedy = SamplingParams(temperature=0.0)
    return runtime.generation(prompt_ids, greedy, max_tokens, strategy="autoregressive").run()


MESSAGES = [
    {"role": "system", "content": "You tell short stories."},
    {"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]},
]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_health_is_ready(server: BackgroundServer) -> None:
    with urllib.request.urlopen(server.url + "/health") as resp:
        body = json.loads(resp.read())
    assert resp.status == 200 and body["status"] == "ready" and body["model"] == MODEL


def test_chat_greedy_equals_in_process(client: openai.OpenAI, reference: Runtime) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0
    )
    prompt_ids = reference.tokenizer.encode_chat(
        [{"role": "system", "content": "You tell short stories."},
         {"role": "user", "content": "Once upon a time"}]
    )  # fmt: skip
    expected = in_process(reference, prompt_ids, 40)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert resp.object == "chat.completion"
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == expected.completion_tokens
    assert resp.usage.total_tokens == len(prompt_ids) + expected.completion_tokens
    stats = resp.model_extra["specd"]
    assert stats["strategy"] == "autoregressive" and stats["tokens_per_target_pass"] == 1.0


def test_chat_stream_matches_and_follows_the_wire_format(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens == 30
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert "tokens_per_target_pass" in usage_chunk.model_extra["specd"]


def test_completion_greedy_equals_in_process(client: openai.OpenAI, reference: Runtime) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="The little dog", max_tokens=32, temperature=0
    )
    prompt_ids = reference.tokenizer.encode("The little dog")
    expected = in_process(reference, prompt_ids, 32)
    assert resp.choices[0].text == expected.text
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == expected.completion_tokens
    streamed = client.completions.create(
        model=MODEL, prompt="The little dog", max_tokens=32, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_stop_string_and_seeded_sampling(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=60, temperature=0, stop=["Lily"]
    )
    assert resp.choices[0].finish_reason == "stop" and "Lily" not in resp.choices[0].text
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=1.0, seed=7)
    a = client.completions.create(**kwargs, extra_body={"top_k": 40, "min_p": 0.05})
    b = client.completions.create(**kwargs, extra_body={"top_k": 40, "min_p": 0.05})
    assert a.choices[0].text == b.choices[0].text


SPECULATIVE = [name for name in STRATEGY_BUILDERS if name != "autoregressive"]


@pytest.mark.parametrize("strategy", SPECULATIVE)
def test_speculative_strategy_field_is_lossless(
    client: openai.OpenAI, reference: Runtime, strategy: str
) -> None:
    resp = client.completions.create(
        model=MODEL,
        prompt="Lily and Tom",
        max_tokens=24,
        temperature=0,
        extra_body={"strategy": strategy, "budget": 8},
    )
    expected = in_process(reference, reference.tokenizer.encode("Lily and Tom"), 24)
    assert resp.choices[0].text == expected.text
    assert resp.model_extra["specd"]["strategy"] == strategy


def test_second_turn_prefills_only_the_new_tokens(
    client: openai.OpenAI, reference: Runtime
) -> None:
    first_prompt = reference.tokenizer.encode("One day, a big")
    first = client.completions.create(
        model=MODEL, prompt=first_prompt, max_tokens=12, temperature=0
    )
    generated = reference.tokenizer.encode(first.choices[0].text, add_special_tokens=False)
    expected = in_process(reference, first_prompt, 12)
    assert expected.text == first.choices[0].text
    # The next turn continues exactly what the session holds: the prompt and the answer.
    follow_up = [*first_prompt, *expected.token_ids, *reference.tokenizer.encode(
        " The end.", add_special_tokens=False)]  # fmt: skip
    second = client.completions.create(model=MODEL, prompt=follow_up, max_tokens=4, temperature=0)
    # The cache held prompt + answer except the last answer token (never fed: it was the
    # root of the round that would have come next).
    cached = len(first_prompt) + len(expected.token_ids) - 1
    assert second.usage.prompt_tokens_details.cached_tokens == cached
    assert second.model_extra["specd"]["cached_prompt_tokens"] == cached
    assert len(generated) > 0


def test_metrics_count_requests_and_tokens(server: BackgroundServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Lily", max_tokens=5, temperature=0)
    with urllib.request.urlopen(server.url + "/metrics") as resp:
        text = resp.read().decode()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values['specd_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values["specd_completion_tokens_total"] >= 5
    assert values["specd_target_passes_total"] >= 5
    assert values["specd_time_to_first_token_seconds_count"] >= 1
    for name in ("specd_queue_depth", "specd_draft_tokens_proposed_total",
                 "specd_draft_tokens_accepted_total", "specd_tokens_per_target_pass",
                 "specd_stream_bandwidth_bytes_per_second"):  # fmt: skip
        assert name in values
