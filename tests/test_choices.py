"""`n` choices in one request: each its own generation (batched into the same target
passes), seeded one after another, so choice i is exactly the answer a request with n = 1
and seed + i gets; whole and streamed alike, the usage summing the choices' tokens; under a
grammar each choice has its own grammar state; a request whose choices do not all fit the
engine's places is a 503 that leaves none behind."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from daemon.http.server import BackgroundServer
from tests.keyed_server import keyed_server

KEY = "k"


@pytest.fixture(scope="module")
def server(
    stories_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundServer]:
    yield from keyed_server(stories_target, tmp_path_factory, KEY, {"models.draft": "none"})


def post(server: BackgroundServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=120)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if body.get("stream") and resp.status == 200:
        lines = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
        return resp.status, [json.loads(line) for line in lines[:-1]]
    return resp.status, json.loads(data or b"{}")


CHAT = {"model": "stories260k", "messages": [{"role": "user", "content": "Once upon a time"}],
        "max_tokens": 12, "temperature": 1.0, "seed": 7}  # fmt: skip


def text_of(choice: dict[str, Any]) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_each_choice_is_the_answer_of_its_seed(server: BackgroundServer, path: str) -> None:
    body = dict(CHAT) if "chat" in path else {**CHAT, "prompt": "Once upon a time"}
    if "chat" not in path:
        del body["messages"]
    status, many = post(server, path, {**body, "n": 3})
    assert status == 200, many
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    alone = []
    for i in range(3):
        status, one = post(server, path, {**body, "seed": 7 + i})
        assert status == 200
        alone.append(one)
        assert text_of(many["choices"][i]) == text_of(one["choices"][0])
        assert many["choices"][i]["finish_reason"] == one["choices"][0]["finish_reason"]
    assert len({text_of(c) for c in many["choices"]}) > 1  # (three seeds, three texts)
    made = sum(one["usage"]["completion_tokens"] for one in alone)
    assert many["usage"]["completion_tokens"] == made
    assert many["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert many["usage"]["total_tokens"] == many["usage"]["prompt_tokens"] + made


def test_streamed_choices_are_the_whole_answers_choices(server: BackgroundServer) -> None:
    status, whole = post(server, "/v1/chat/completions", {**CHAT, "n": 3})
    assert status == 200
    options = {"include_usage": True}
    status, events = post(
        server, "/v1/chat/completions", {**CHAT, "n": 3, "stream": True, "stream_options": options}
    )
    assert status == 200
    texts, finishes, roles = ["", "", ""], [None, None, None], [0, 0, 0]
    for event in events:
        for choice in event["choices"]:
            i = choice["index"]
            texts[i] += choice["delta"].get("content") or ""
            roles[i] += choice["delta"].get("role") == "assistant"
            finishes[i] = choice["finish_reason"] or finishes[i]
    assert texts == [text_of(c) for c in whole["choices"]]
    assert finishes == [c["finish_reason"] for c in whole["choices"]] and roles == [1, 1, 1]
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (cached ones differ)
    assert [usage[k] for k in counts] == [whole["usage"][k] for k in counts]


def test_greedy_choices_agree(server: BackgroundServer) -> None:
    status, many = post(server, "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 0})
    assert status == 200
    assert text_of(many["choices"][0]) == text_of(many["choices"][1])


def test_each_choice_has_its_own_grammar_state(server: BackgroundServer) -> None:
    """Under a response format every choice is valid JSON and equals its seed's answer:
    the grammar is compiled once and its state copied (`Constraint.twin`)."""
    body = {**CHAT, "max_tokens": 24, "response_format": {"type": "json_object"}}
    status, many = post(server, "/v1/chat/completions", {**body, "n": 2})
    assert status == 200, many
    for i, choice in enumerate(many["choices"]):
        status, one = post(server, "/v1/chat/completions", {**body, "seed": 7 + i})
        assert text_of(choice) == text_of(one["choices"][0])
        if choice["finish_reason"] == "stop":
            json.loads(text_of(choice))


@pytest.fixture(scope="module")
def small(
    stories_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundServer]:
    yield from keyed_server(
        stories_target, tmp_path_factory, KEY,
        {"models.draft": "none", "limits.max_concurrent": 1, "limits.queue_size": 2},
    )  # fmt: skip


def test_choices_past_the_engines_places_are_a_503_that_leaves_none(
    small: BackgroundServer,
) -> None:
    """Choices that do not all find a place (others hold some) are a 503 that leaves none
    running; more choices than the daemon ever holds are a 400 naming `n` (a 503 on an
    idle daemon, which clients retry for good)."""
    engine = small.server.engine
    status, answer = post(small, "/v1/chat/completions", {**CHAT, "n": 4})
    assert status == 400 and answer["error"]["param"] == "n", answer
    assert "at most 3 generations" in answer["error"]["message"]
    held = engine.reserve()  # (another request's place)
    try:
        status, answer = post(small, "/v1/chat/completions", {**CHAT, "n": 3})
        assert status == 503 and answer["error"]["code"] == "queue_full", answer
    finally:
        engine.release(held)
    status, answer = post(small, "/v1/chat/completions", {**CHAT, "n": 3})
    assert status == 200 and len(answer["choices"]) == 3  # (every place given back)


def test_a_trace_chunk_names_its_choice() -> None:
    """With `n` > 1 every choice grows its own trees: each trace chunk says whose (the
    chunks of two choices' first rounds read alike, an attacker saw)."""
    from daemon.http.openai_responses import ResponseShape

    shape = ResponseShape(chat=True, model="m")
    traced = [replace(shape, index=i).trace_chunk({"round": 1}) for i in (0, 2)]
    assert [t["specd"]["trace"] for t in traced] == [
        {"round": 1, "index": 0}, {"round": 1, "index": 2},
    ]  # fmt: skip
    assert all(t["choices"] == [] for t in traced)


def test_a_command_without_the_daemons_key_is_told_how_to_give_it(
    server: BackgroundServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A daemon started with a config's key file, asked by `specd chat` (or `status`)
    without it: the 401 says how to give the key (it said only that one is required)."""
    from daemon.cli import main

    url = f"http://127.0.0.1:{server.server.port}"
    assert main(["chat", "--url", url, "--once", "hi", "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err
    assert "HTTP 401" in err and "--api-key-file FILE" in err and "--config FILE" in err
    key = tmp_path / "key"
    key.write_text(KEY)
    argv = ["chat", "--url", url, "--once", "hi", "--max-tokens", "2", "--api-key-file", str(key)]
    assert main(argv) == 0
