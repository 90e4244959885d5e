"""Bad input over raw HTTP: each gets the right status and the OpenAI error shape, and the
server still answers the next request. One server, with an API key, a small body limit and
a short context so that every limit is reachable cheaply."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon import active_jobs as active_jobs_module
from daemon.http import completions as completions_module
from daemon.http.server import BackgroundServer, Server
from daemon.settings_loading import load_settings
from modeling.errors import RequestError
from speculative import batching
from speculative.budget import AUTO_MAX_BUDGET
from speculative.generation import ContextFullError
from tests.keyed_server import keyed_server

KEY = "test-key-123"
MODEL = "stories260k"
CONTEXT = 64
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def server(
    stories_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundServer]:
    yield from keyed_server(
        stories_target,
        tmp_path_factory,
        KEY,
        {
            "models.draft": "none",  # a daemon without a draft (the default drafts: auto)
            "server.cors_origins": ["http://app.localhost:3000"],
            "context.length": CONTEXT,
            "limits.max_body_bytes": BODY_LIMIT,
            "limits.max_tokens": 1000,
        },
    )


def call(
    server: BackgroundServer,
    body: bytes | dict[str, Any] | None,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> tuple[int, dict[str, str], dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    sent = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    sent.update(headers or {})
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=raw, headers=sent)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(data or b"{}")


def call_raw(server: BackgroundServer, body: dict[str, Any]) -> tuple[int, str]:
    """A request whose answer is not one JSON body (a stream): status and text."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    sent = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers=sent)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


def good() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "temperature": 0,
    }


def assert_error(
    response: tuple[int, dict[str, str], dict[str, Any]], status: int, param: str | None = None
) -> dict[str, Any]:
    got, headers, body = response
    assert got == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    if status == 400:
        assert headers["x-should-retry"] == "false"
    return error


@pytest.fixture(autouse=True)
def still_answers(server: BackgroundServer) -> Iterator[None]:
    yield
    status, _, body = call(server, good())
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


def test_malformed_json(server: BackgroundServer) -> None:
    error = assert_error(call(server, b'{"model": "stories260k", "messages": ['), 400)
    assert "JSON" in error["message"]
    assert_error(call(server, b"[1, 2]"), 400)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("messages", "hello"),
        ("max_tokens", "5"),
        ("stream", "yes"),
        ("seed", 1.5),
        ("stop", [1, 2]),
        ("top_k", -3),
        ("model", 7),
    ],
)
def test_wrong_types_name_the_field(server: BackgroundServer, field: str, value: Any) -> None:
    error = assert_error(call(server, {**good(), field: value}), 400, field)
    assert field in error["message"]


def test_missing_messages_and_bad_roles(server: BackgroundServer) -> None:
    body = good()
    del body["messages"]
    assert_error(call(server, body), 400, "messages")
    assert_error(call(server, {**good(), "messages": []}), 400, "messages")
    bad_role = {**good(), "messages": [{"role": "wizard", "content": "x"}]}
    assert_error(call(server, bad_role), 400, "messages[0].role")
    image = {**good(), "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert_error(call(server, image), 400)


@pytest.mark.parametrize("value", [-1, 0, 10**9])
def test_negative_or_huge_max_tokens(server: BackgroundServer, value: int) -> None:
    error = assert_error(call(server, {**good(), "max_tokens": value}), 400, "max_tokens")
    assert "1000" in error["message"]


@pytest.mark.parametrize(("field", "value"), [("temperature", 2.5), ("temperature", -0.1),
                                              ("top_p", 0), ("presence_penalty", 3),
                                              ("repetition_penalty", 1e-38),
                                              ("repetition_penalty", 0.009)])  # fmt: skip
def test_sampling_values_out_of_range(server: BackgroundServer, field: str, value: float) -> None:
    assert_error(call(server, {**good(), field: value}), 400, field)


@pytest.mark.parametrize(("field", "value"), [("functions", [{"name": "f"}])])
def test_fields_that_cannot_be_honoured(server: BackgroundServer, field: str, value: Any) -> None:
    error = assert_error(call(server, {**good(), field: value}), 400, field)
    assert "not supported" in error["message"]


@pytest.mark.parametrize("n", [0, -1, 17])
def test_choices_past_their_range_are_a_400(server: BackgroundServer, n: int) -> None:
    error = assert_error(call(server, {**good(), "n": n}), 400, "n")
    assert error["message"] == f"n must be from 1 to 16, got {n}"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": "yes"}, "logprobs"),
    ],
)
def test_bad_logprobs_requests_name_the_field(
    server: BackgroundServer, extra: dict[str, Any], field: str
) -> None:
    assert_error(call(server, {**good(), **extra}), 400, field)


def test_chat_logprobs_in_openais_shape(server: BackgroundServer) -> None:
    status, _, body = call(server, {**good(), "logprobs": True, "top_logprobs": 2})
    assert status == 200
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert "".join(c["token"] for c in content) == body["choices"][0]["message"]["content"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the top one
        assert entry["bytes"] == list(entry["token"].encode())
    status, _, plain = call(server, good())
    assert plain["choices"][0]["logprobs"] is None


def test_completion_logprobs_in_openais_shape(server: BackgroundServer) -> None:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4, "temperature": 0, "logprobs": 3}
    status, _, out = call(server, body, path="/v1/completions")
    assert status == 200
    lp = out["choices"][0]["logprobs"]
    text = out["choices"][0]["text"]
    assert "".join(lp["tokens"]) == text and len(lp["token_logprobs"]) == len(lp["tokens"])
    assert lp["text_offset"][0] == 0 and all(len(t) == 3 for t in lp["top_logprobs"])
    assert all(lp["top_logprobs"][i][tok] == lp["token_logprobs"][i] for i, tok in
               enumerate(lp["tokens"]))  # fmt: skip


def test_unknown_fields_are_ignored(server: BackgroundServer) -> None:
    status, _, _ = call(server, {**good(), "user": "me", "some_future_field": {"a": 1}})
    assert status == 200


def test_unknown_model(server: BackgroundServer) -> None:
    error = assert_error(call(server, {**good(), "model": "gpt-9"}), 404, "model")
    assert error["code"] == "model_not_found" and MODEL in error["message"]


def test_oversized_body(server: BackgroundServer) -> None:
    body = {**good(), "messages": [{"role": "user", "content": "x" * (BODY_LIMIT * 2)}]}
    error = assert_error(call(server, body), 413)
    assert str(BODY_LIMIT) in error["message"]


def test_prompt_longer_than_the_context(server: BackgroundServer) -> None:
    body = {**good(), "messages": [{"role": "user", "content": "the dog ran " * 40}]}
    error = assert_error(call(server, body), 400, "messages")
    assert error["code"] == "context_length_exceeded" and str(CONTEXT) in error["message"]
    ids = {"model": MODEL, "prompt": list(range(3, 3 + CONTEXT)), "max_tokens": 2}
    assert_error(call(server, ids, "/v1/completions"), 400, "prompt")


def test_max_tokens_past_the_context_is_a_400_naming_what_fits(server: BackgroundServer) -> None:
    """60 prompt ids in a 64-token context leave 4 new tokens: asking for 10 is refused as
    OpenAI and vLLM refuse it, naming the prompt, the context and the largest that fits;
    asking for 4 runs; not asking runs to the context's end."""
    prompt = list(range(3, 63))  # 60 ids
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
    error = assert_error(call(server, body, "/v1/completions"), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"
    for figure in ("60 tokens", f"holds {CONTEXT}", "at most 4 new tokens"):
        assert figure in error["message"], error["message"]
    status, _, ok = call(server, {**body, "max_tokens": 4, "ignore_eos": True}, "/v1/completions")
    assert status == 200 and ok["usage"]["completion_tokens"] == 4
    unset = {"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    status, _, ran = call(server, unset, "/v1/completions")
    assert status == 200 and ran["choices"][0]["finish_reason"] == "length"
    assert ran["usage"]["completion_tokens"] == 4 and ran["specd"]["max_tokens"] == 4


@pytest.fixture(scope="module")
def clamping(stories_target: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from keyed_server(
        stories_target, tmp_path_factory, KEY,
        {"context.length": CONTEXT, "limits.clamp_max_tokens": True},
    )  # fmt: skip


def test_clamp_max_tokens_cuts_and_says_so(clamping: BackgroundServer) -> None:
    body = {"model": MODEL, "prompt": list(range(3, 63)), "max_tokens": 10, "temperature": 0}
    status, _, ran = call(clamping, {**body, "ignore_eos": True}, "/v1/completions")
    assert status == 200 and ran["usage"]["completion_tokens"] == 4
    assert ran["specd"]["max_tokens"] == 4  # the effective limit, not the 10 asked for


def test_bad_host_header(server: BackgroundServer) -> None:
    error = assert_error(call(server, good(), headers={"Host": "evil.example.com"}), 403)
    assert error["code"] == "host_not_allowed"
    status, _, _ = call(server, good(), headers={"Host": f"localhost:{server.server.port}"})
    assert status == 200


def test_origin_and_cors(server: BackgroundServer) -> None:
    error = assert_error(call(server, good(), headers={"Origin": "http://evil.example.com"}), 403)
    assert error["code"] == "origin_not_allowed"
    status, headers, _ = call(server, good(), headers={"Origin": "http://app.localhost:3000"})
    assert status == 200
    assert headers["access-control-allow-origin"] == "http://app.localhost:3000"
    preflight = {"Origin": "http://app.localhost:3000", "Authorization": ""}
    status, headers, _ = call(server, None, headers=preflight, method="OPTIONS")
    assert status == 204 and "POST" in headers["access-control-allow-methods"]


def test_api_key_required(server: BackgroundServer) -> None:
    assert_error(call(server, good(), headers={"Authorization": ""}), 401)
    error = assert_error(call(server, good(), headers={"Authorization": "Bearer wrong"}), 401)
    assert error["type"] == "authentication_error"
    for wrong in (f"Basic {KEY}", f"Bearer{KEY}", KEY, f"Bearer {KEY}x"):
        assert_error(call(server, good(), headers={"Authorization": wrong}), 401)
    # The scheme is case-insensitive (RFC 9110).
    for scheme in ("bearer", "BEARER", "beArer"):
        status, _, body = call(server, good(), headers={"Authorization": f"{scheme} {KEY}"})
        assert status == 200, body
    # /health stays open so that `specd status` works without the key.
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def test_unknown_route(server: BackgroundServer) -> None:
    assert_error(call(server, None, "/v1/embeddings"), 404)


def test_health_is_503_while_loading(stories_target: Path) -> None:
    """The HTTP side is up before the models: /health and requests say 503 + Retry-After."""
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "test"),
            "runtime.compile": ("off", "test"),
            "server.port": (0, "test"),
        },
    )
    server = Server(settings)
    release = threading.Event()
    real_factory = server.engine._runtime_factory

    def slow_factory(options):  # type: ignore[no-untyped-def]
        release.wait(timeout=60)
        return real_factory(options)

    server.engine._runtime_factory = slow_factory
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=30)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 503 and resp.getheader("Retry-After")
        assert body["status"] == "loading" and body["error"]["code"] == "loading"
        conn.request("POST", "/v1/chat/completions", body=json.dumps(good()))
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        assert resp.status == 503 and resp.getheader("Retry-After")
        assert error["code"] == "model_loading"
        release.set()
        assert server.engine.loaded.wait(timeout=60)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
    finally:
        release.set()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_strategy_that_needs_a_missing_draft_is_a_400(server: BackgroundServer) -> None:
    """This daemon has no draft: asking for speculation is the request's fault, not a 500."""
    for name in ("linear", "tree"):
        error = assert_error(call(server, {**good(), "strategy": name}), 400, "strategy")
        assert "draft" in error["message"]
    status, _, _ = call(server, {**good(), "strategy": "autoregressive"})
    assert status == 200


@pytest.mark.parametrize("value", ["sideways", 3, None])
def test_tree_verification_outside_its_choices_is_a_400(server: BackgroundServer, value) -> None:
    if value is None:  # absent: the configured one
        assert call(server, {**good(), "tree_verification": None})[0] == 200
        return
    error = assert_error(call(server, {**good(), "tree_verification": value}), 400,
                         "tree_verification")  # fmt: skip
    assert "auto, walk, rejection" in error["message"]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_outside_64_bits_is_a_400(server: BackgroundServer, seed: int) -> None:
    error = assert_error(call(server, {**good(), "seed": seed}), 400, "seed")
    assert "seed" in error["message"]


def test_seeds_at_the_64_bit_edges_work(server: BackgroundServer) -> None:
    for seed in (-(2**63), 2**64 - 1):
        status, _, body = call(server, {**good(), "seed": seed, "temperature": 0.8})
        assert status == 200, body


def test_vanishing_temperature_samples_the_argmax(server: BackgroundServer) -> None:
    """A temperature so small that logits / T overflows float32 is the greedy limit, not a
    NaN distribution (which made torch.multinomial fail with a 500)."""
    greedy = call(server, good())[2]["choices"][0]["message"]["content"]
    for temperature in (1e-30, 1e-45, 5e-324):
        status, _, body = call(server, {**good(), "temperature": temperature})
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == greedy


@pytest.mark.parametrize("stream", [False, True])
def test_a_budget_above_the_planned_tree_is_a_400(server: BackgroundServer, stream: bool) -> None:
    """speculation.budget is auto here: the plan holds the largest tree auto explores, and a
    request asking for more (whose ancestor mask alone is budget² bytes) is refused, naming
    the field and the maximum, before anything is queued."""
    for budget in (AUTO_MAX_BUDGET + 1, 65536):
        body = {**good(), "budget": budget, "stream": stream}
        error = assert_error(call(server, body), 400, "budget")
        assert error["code"] == "budget_too_large"
        assert str(AUTO_MAX_BUDGET) in error["message"] and str(budget) in error["message"]
    status, _, _ = call(server, {**good(), "budget": AUTO_MAX_BUDGET})
    assert status == 200


# ---- bad input that used to reach a 500, and errors that are ours ----


def test_a_body_nested_past_the_parser_s_depth_is_a_400(server: BackgroundServer) -> None:
    """json's decoder recurses once per level: 2,000 levels (all that fits the small body
    limit here; tests/test_hostile_input.py sends 20,000) were a RecursionError and a 500."""
    deep = "[" * 2000 + "]" * 2000
    assert len(deep) < BODY_LIMIT
    error = assert_error(call(server, deep.encode()), 400)
    assert error["code"] == "invalid_json" and "deeply" in error["message"]


def test_a_lone_surrogate_in_the_content_is_a_400_naming_the_field(
    server: BackgroundServer,
) -> None:
    """JSON may spell "\\ud800", which decodes to no text (the tokenizer raised a TypeError
    and the client got a 500)."""
    body = {**good(), "messages": [{"role": "user", "content": "Hi \ud800 there"}]}
    assert b"\\ud800" in json.dumps(body).encode()
    error = assert_error(call(server, body), 400, "messages[0].content")
    assert error["code"] == "invalid_unicode" and "surrogate" in error["message"]
    # A pair is a character: served.
    status, _, _ = call(server, {**good(), "messages": [{"role": "user", "content": "\U0001f600"}]})
    assert status == 200


@pytest.fixture
def specd_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="specd")
    return caplog


def logged_tracebacks(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.exc_info and text in str(r.exc_info[1])
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_an_internal_value_error_is_a_500_with_its_traceback_logged(
    server: BackgroundServer,
    monkeypatch: pytest.MonkeyPatch,
    specd_log: pytest.LogCaptureFixture,
    stream: bool,
) -> None:
    """A ValueError is not the request's fault unless it is a RequestError: an invariant
    that breaks inside a pass (or before the generation starts) is ours."""

    def broken_pass(requests):  # type: ignore[no-untyped-def]
        raise ValueError("an invariant broke inside the pass")

    monkeypatch.setattr(batching, "execute", broken_pass)
    body = {**good(), "stream": stream}
    if stream:
        status, text = call_raw(server, body)
        assert status == 200
        error = json.loads(text.split("data: ")[2])["error"]  # after the role chunk
    else:
        error = assert_error(call(server, body), 500)
    assert error["type"] == "server_error" and "invariant" in error["message"]
    assert logged_tracebacks(specd_log, "an invariant broke inside the pass")
    monkeypatch.undo()

    def broken_start(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ValueError("an invariant broke before the first pass")

    monkeypatch.setattr(active_jobs_module, "Generation", broken_start)
    error = assert_error(call(server, good()), 500)
    assert error["type"] == "server_error"
    assert logged_tracebacks(specd_log, "an invariant broke before the first pass")


def _rust_panic() -> BaseException:
    """A real panic of a Rust library (pyo3's PanicException, a BaseException): the
    tokenizers library's regex engine past its retry limit."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("(a|a)*b|a"), "isolated")
    try:
        backend.encode("a" * 64)
    except BaseException as exc:
        return exc
    raise AssertionError("no panic")


def test_a_library_panic_is_a_500_and_the_daemon_serves_on(
    server: BackgroundServer,
    monkeypatch: pytest.MonkeyPatch,
    specd_log: pytest.LogCaptureFixture,
) -> None:
    """A Rust library's panic is no Exception: in a pass it ended the engine's thread (no
    generation ran again), in a handler it closed the connection unanswered. Each is one
    request's 500 now, with the traceback logged, and the next request is answered."""
    panic = _rust_panic()
    assert not isinstance(panic, Exception)

    def panicking(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise panic

    for module, name in ((batching, "execute"), (active_jobs_module, "Generation")):
        monkeypatch.setattr(module, name, panicking)
        for stream in (False, True):
            body = {**good(), "stream": stream}
            if stream:
                status, text = call_raw(server, body)
                assert status == 200 and '"server_error"' in text, text
            else:
                assert assert_error(call(server, body), 500)["type"] == "server_error"
        monkeypatch.undo()
        assert call(server, good())[0] == 200  # the engine serves on
    monkeypatch.setattr(completions_module, "settle", panicking)
    assert assert_error(call(server, good()), 500)["type"] == "server_error"
    monkeypatch.undo()
    assert call(server, good())[0] == 200
    assert logged_tracebacks(specd_log, "retry-limit")


def test_a_request_error_from_the_engine_is_still_a_400(
    server: BackgroundServer,
    monkeypatch: pytest.MonkeyPatch,
    specd_log: pytest.LogCaptureFixture,
) -> None:
    def too_long(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ContextFullError("the prompt has 70 tokens but the context holds 64")

    monkeypatch.setattr(active_jobs_module, "Generation", too_long)
    error = assert_error(call(server, good()), 400)
    assert "context holds 64" in error["message"]
    assert not logged_tracebacks(specd_log, "context holds 64")  # the client's, not a bug


def test_errors_escaping_a_handler(
    server: BackgroundServer,
    monkeypatch: pytest.MonkeyPatch,
    specd_log: pytest.LogCaptureFixture,
) -> None:
    """At the edge: a RequestError is a 400 naming its field; any other exception a 500
    with the traceback logged, never a 400."""

    def refuse(runtime, ask, **kwargs):  # type: ignore[no-untyped-def]
        raise RequestError("strategy refused for a test", "strategy", "test_refusal")

    monkeypatch.setattr(completions_module, "settle", refuse)
    error = assert_error(call(server, good()), 400, "strategy")
    assert error["code"] == "test_refusal"

    def broken(runtime, ask, **kwargs):  # type: ignore[no-untyped-def]
        raise ValueError("a bug in a handler")

    monkeypatch.setattr(completions_module, "settle", broken)
    error = assert_error(call(server, good()), 500)
    assert "a bug" not in error["message"]  # the log has it, not the client
    assert logged_tracebacks(specd_log, "a bug in a handler")


def test_a_non_streaming_client_that_disconnects_is_cancelled(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is written before a non-streamed answer is complete, so no failed write
    tells the handler that its client left: it must look, and cancel the job as a stream
    does (it used to generate every token for nobody)."""
    engine = server.server.engine
    real_execute = batching.execute
    passes = []

    def slow_execute(requests):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        passes.append(len(requests))
        return real_execute(requests)

    monkeypatch.setattr(batching, "execute", slow_execute)
    cancelled = engine.metrics.cancelled.value
    completed = engine.metrics.completion_tokens.value
    max_tokens = CONTEXT - 4
    body = {"model": MODEL, "prompt": [1], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    raw = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(raw)).encode()
        + b"\r\n\r\n"
        + raw
    )
    deadline = time.monotonic() + 20
    while len(passes) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(passes) >= 3, "the generation did not start"
    sock.close()  # the client goes away 60 ms in
    while engine.metrics.cancelled.value == cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.metrics.cancelled.value == cancelled + 1
    assert engine.active_count == 0
    assert len(passes) < max_tokens // 2  # stopped early, not run to the end for nobody
    assert engine.metrics.completion_tokens.value == completed


# ---- an attacker's findings of 2026-12-07 ------------------------------------------------


def test_a_lone_surrogate_in_a_tools_parameters_names_them(server: BackgroundServer) -> None:
    """It reached the grammar engine, whose refusal named `tools` ("unexpected end of hex
    escape", code unsupported_grammar)."""
    raw = json.dumps({**good(), "tools": [{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "string",
        "description": "SURROGATE"}}}}}]}).replace("SURROGATE", "\\ud800").encode()  # fmt: skip
    error = assert_error(call(server, raw), 400, "tools[0].function.parameters")
    assert error["code"] == "invalid_unicode"
    raw = json.dumps({**good(), "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "SURROGATE"}}}})  # fmt: skip
    error = assert_error(call(server, raw.replace("SURROGATE", "\\udc00").encode()), 400)
    assert error["param"] == "response_format.json_schema.schema"


def test_max_tokens_and_max_completion_tokens_are_each_checked(server: BackgroundServer) -> None:
    """`max_tokens` was never looked at beside `max_completion_tokens` ("garbage" passed),
    and a limit past the context named `max_tokens`, a field the client had not sent."""
    assert_error(call(server, {**good(), "max_completion_tokens": 2, "max_tokens": "x"}), 400,
                 "max_tokens")  # fmt: skip
    error = assert_error(call(server, {**good(), "max_completion_tokens": 2, "max_tokens": 3}), 400,
                         "max_tokens")  # fmt: skip
    assert "differ" in error["message"]
    status, _, body = call(server, {**good(), "max_completion_tokens": 2, "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2
    alone = {k: v for k, v in good().items() if k != "max_tokens"}
    error = assert_error(call(server, {**alone, "max_completion_tokens": 900}), 400,
                         "max_completion_tokens")  # fmt: skip
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("max_completion_tokens is 900")


def test_a_wrong_method_says_which_methods_the_path_takes(server: BackgroundServer) -> None:
    error = assert_error(call(server, None, "/health", method="PUT"), 405)
    _, headers, _ = call(server, None, "/health", method="PUT")
    assert "GET" in headers["allow"] and error["code"] == "method_not_allowed"
    assert assert_error(call(server, None, "/nowhere", method="GET"), 404)["code"] == "not_found"


def test_a_model_is_retrieved_by_its_id(server: BackgroundServer) -> None:
    """GET /v1/models/{id}: the official client's `models.retrieve`."""
    status, _, body = call(server, None, f"/v1/models/{MODEL}", method="GET")
    assert status == 200 and body == {"id": MODEL, "object": "model", "created": 0,
                                      "owned_by": "specd"}  # fmt: skip
    error = assert_error(call(server, None, "/v1/models/other/model", method="GET"), 404, "model")
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("header", "value", "status", "code"),
    [("Content-Encoding", "x-unknown", 415, "unsupported_content_encoding"),
     ("Content-Encoding", "gzip, gzip", 415, "unsupported_content_encoding"),
     ("Content-Encoding", "br", 415, "unsupported_content_encoding"),
     ("Transfer-Encoding", "gzip, chunked", 400, "unsupported_transfer_encoding")],
)  # fmt: skip
def test_a_body_in_an_encoding_specd_cannot_read_is_refused(
    server: BackgroundServer, header: str, value: str, status: int, code: str
) -> None:
    """aiohttp read an unknown Content-Encoding as plain bytes, and for br and zstd told the
    client which package to install."""
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=30)
    body = json.dumps(good()).encode()
    length = f"Content-Length: {len(body)}\r\n" if header == "Content-Encoding" else ""
    if header == "Transfer-Encoding":
        body = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            f"{KEY}\r\nContent-Type: application/json\r\n{header}: {value}\r\n{length}\r\n")  # fmt: skip
    sock.sendall(head.encode() + body)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    # (br is refused by aiohttp's parser, whose status line says HTTP/1.0)
    assert got.split(b"\r\n")[0].split(b" ")[1] == str(status).encode(), got[:200]
    answer = json.loads(got.split(b"\r\n\r\n", 1)[1])
    assert answer["error"]["code"] == code and "install" not in answer["error"]["message"]
