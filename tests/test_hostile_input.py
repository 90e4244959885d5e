"""Hostile and malformed requests over raw sockets on 127.0.0.1 (issue 14): each row of the
table is sent as bytes, its status and error shape checked, and then a normal request must
come back exactly as it did before the attack. One server, with an API key and an extra
allowed host name, so that every check is reachable."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from daemon.hostname import allowed_host_names, host_name
from daemon.http.server import BackgroundServer
from tests.keyed_server import keyed_server

KEY = "hostile-key-456"
MODEL = "stories260k"
EXTRA_HOST = "myhost.lan"


@pytest.fixture(scope="module")
def server(
    stories_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundServer]:
    yield from keyed_server(
        stories_target,
        tmp_path_factory,
        KEY,
        {"server.allowed_hosts": [EXTRA_HOST], "context.length": 64, "limits.max_tokens": 1000},
    )


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def exchange(port: int, data: bytes | list[bytes]) -> Reply:
    """Send `data` (a list: piece by piece, 0.2 s apart) on a fresh connection and read one
    response (the server closes the connection after an error; normal requests here say
    `Connection: close`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for i, piece in enumerate([data] if isinstance(data, bytes) else data):
            if i:
                time.sleep(0.2)
            sock.sendall(piece)
        received = b""
        while True:
            try:
                piece = sock.recv(65536)
            except ConnectionResetError:  # closed while our bytes were still unread
                break
            if not piece:
                break
            received += piece
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Reply(status, headers, body)


def request(
    method: str = "GET",
    target: str = "/v1/models",
    headers: list[tuple[str, bytes | str]] | None = None,
    body: bytes | dict[str, Any] | None = None,
    *,
    host: bytes | str | None = "127.0.0.1",
    key: bytes | str | None = KEY,
) -> bytes:
    """A raw HTTP/1.1 request; None leaves out the Host or Authorization header."""
    raw_body = json.dumps(body).encode() if isinstance(body, dict) else body
    lines: list[tuple[str, bytes | str]] = []
    if host is not None:
        lines.append(("Host", host))
    if key is not None:
        lines.append(
            ("Authorization", b"Bearer " + (key.encode() if isinstance(key, str) else key))
        )
    lines += headers or []
    if raw_body is not None:
        lines += [("Content-Type", "application/json"), ("Content-Length", str(len(raw_body)))]
    lines.append(("Connection", "close"))
    out = f"{method} {target} HTTP/1.1\r\n".encode()
    for name, value in lines:
        out += name.encode() + b": " + (value.encode() if isinstance(value, str) else value)
        out += b"\r\n"
    return out + b"\r\n" + (raw_body or b"")


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
            **fields}  # fmt: skip


def chat(**fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hi"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **fields}


def big_int_body(field: str, digits: int = 5000, sign: str = "", chat_: bool = False) -> bytes:
    """A JSON body whose `field` is an integer literal of `digits` digits (json.dumps of a
    Python int that long would itself exceed the conversion limit)."""
    base = chat(**{field: 0}) if chat_ else completion(**{field: 0})
    text = json.dumps(base).replace(f'"{field}": 0', f'"{field}": {sign}{"9" * digits}')
    assert f'"{field}": {sign}9' in text
    return text.encode()


def normal_answer(port: int) -> dict[str, Any]:
    """The fields of a greedy completion that must not change after any attack."""
    reply = exchange(port, request("POST", "/v1/completions", body=completion()))
    assert reply.status == 200, reply.body
    body = reply.json()
    choice, usage = body["choices"][0], body["usage"]
    # (cached_tokens is left out: the second request reuses the first one's cache)
    return {
        "text": choice["text"],
        "finish_reason": choice["finish_reason"],
        "tokens": (usage["prompt_tokens"], usage["completion_tokens"]),
        "model": body["model"],
    }


@pytest.fixture(scope="module")
def baseline(server: BackgroundServer) -> dict[str, Any]:
    return normal_answer(port(server))


def port(server: BackgroundServer) -> int:
    assert server.server.port is not None
    return server.server.port


@pytest.fixture(autouse=True)
def next_request_unchanged(server: BackgroundServer, baseline: dict[str, Any]) -> Iterator[None]:
    yield
    assert normal_answer(port(server)) == baseline


def assert_openai_error(reply: Reply, status: int, code: str | None = None,
                        param: str | None = None) -> dict[str, Any]:  # fmt: skip
    assert reply.status == status, reply.body
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- the Host header (DNS rebinding) ----


def test_host_name_parsing() -> None:
    assert host_name("LocalHost.:8716") == "localhost"
    assert host_name("[0:0::1]:80") == "[::1]"
    for bad in ("[::1].evil.example", "[::1]x", "::1", "a b", "h:1:2", "h:x", "u@h", "h..", ""):
        assert host_name(bad) is None, bad
    names = allowed_host_names(["::1", "MyHost.LAN.", "other:8080", "[fe80::1]"])
    assert names == {"localhost", "127.0.0.1", "[::1]", "myhost.lan", "other", "[fe80::1]"}
    with pytest.raises(ValueError, match="evil"):
        allowed_host_names(["[::1].evil"])


REFUSED_HOSTS = [
    "[::1].evil.example",
    "[::1].evil.example:8716",
    "127.0.0.1.evil.example",
    "localhost.evil.example",
    "LOCALHOST.EVIL.EXAMPLE",
    "evil.example",
    "evil.localhost",  # exact names only: no wildcard under localhost
    "[::1]x",
    "[::1]:80x",
    "[::1",
    "::1",  # an IPv6 address in a Host header is bracketed
    "localhost..",  # one trailing dot is the same name; two are not a name
    "localhost:80:80",
    "user@localhost",
    "127.0.0.2",
    f"{EXTRA_HOST}.evil.example",
    "",
]


@pytest.mark.parametrize("host", REFUSED_HOSTS)
def test_host_not_allowed(server: BackgroundServer, host: str) -> None:
    error = assert_openai_error(exchange(port(server), request(host=host)), 403, "host_not_allowed")
    assert error["type"] == "permission_error" and "server.allowed_hosts" in error["message"]


def test_a_refused_host_gets_nothing_more_on_its_connection(server: BackgroundServer) -> None:
    """A body announced but not sent: the 403 comes and the connection closes at once (it
    stayed open until the body's read timed out, 15 s later)."""
    head = request("POST", "/v1/chat/completions", body=b"x" * 100, host="evil.example")
    with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as sock:
        sock.sendall(head[: len(head) - 90])  # 10 of the 100 bytes
        received = b""
        while piece := sock.recv(65536):  # (a socket.timeout if it stays open)
            received += piece
    assert received.startswith(b"HTTP/1.1 403") and b"host_not_allowed" in received


def test_latin1_host(server: BackgroundServer) -> None:
    assert_openai_error(exchange(port(server), request(host=b"localhost\xe9")), 403)


def test_missing_or_repeated_host(server: BackgroundServer) -> None:
    """HTTP/1.1 needs exactly one Host header (aiohttp's parser: 400); HTTP/1.0 may omit
    it, and no Host is no allowed host (403)."""
    assert_openai_error(exchange(port(server), request(host=None)), 400, "malformed_request")
    raw = request(headers=[("Host", "evil.example")])
    error = assert_openai_error(exchange(port(server), raw), 400, "malformed_request")
    assert "Host" in error["message"]
    raw = request(host=None).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    assert_openai_error(exchange(port(server), raw), 403, "host_not_allowed")


@pytest.mark.parametrize(
    "host",
    ["localhost", "LOCALHOST", "localhost.", "LocalHost.:{port}", "127.0.0.1:{port}",
     "[::1]", "[::1]:{port}", "[0:0:0:0:0:0:0:1]:{port}", "myhost.lan", "MyHost.LAN.:{port}"],
)  # fmt: skip
def test_allowed_hosts_any_case_port_and_trailing_dot(server: BackgroundServer, host: str) -> None:
    reply = exchange(port(server), request(host=host.format(port=port(server))))
    assert reply.status == 200, reply.body
    assert reply.json()["data"][0]["id"] == MODEL


# ---- absolute-form request targets ----


@pytest.mark.parametrize(
    "target",
    ["http://evil.example/v1/models", "http://127.0.0.1.evil.example/v1/models",
     "http://localhost.evil.example/v1/models", "https://evil.example:443/v1/models",
     "HTTP://EVIL.EXAMPLE/v1/models", "http://evil.example"],
)  # fmt: skip
def test_absolute_target_to_another_host(server: BackgroundServer, target: str) -> None:
    error = assert_openai_error(exchange(port(server), request(target=target)), 403)
    assert error["code"] == "host_not_allowed" and "request target" in error["message"]


def test_absolute_target_that_is_no_url(server: BackgroundServer) -> None:
    """`http://[::1].evil.example/...` is not a URL at all: aiohttp's parser refuses it."""
    raw = request(target="http://[::1].evil.example/v1/models")
    assert_openai_error(exchange(port(server), raw), 400, "malformed_request")


def test_absolute_target_to_an_allowed_host_is_served(server: BackgroundServer) -> None:
    for authority in (f"127.0.0.1:{port(server)}", "localhost", f"[::1]:{port(server)}"):
        reply = exchange(port(server), request(target=f"http://{authority}/v1/models"))
        assert reply.status == 200, (authority, reply.body)


def test_absolute_target_with_userinfo_or_another_scheme(server: BackgroundServer) -> None:
    for target in ("http://x@127.0.0.1/v1/models", "ftp://127.0.0.1/v1/models"):
        reply = exchange(port(server), request(target=target))
        assert reply.status in (400, 403, 404), (target, reply.body)
        assert_openai_error(reply, reply.status)


# ---- the API key ----


@pytest.mark.parametrize(
    "key",
    [b"\xe9\xe8", b"hostile-key-45\xe9", "é".encode(), b"\xff" * 40, b"", KEY.encode() + b"x"],
)
def test_wrong_or_non_ascii_api_key_is_a_401(server: BackgroundServer, key: bytes) -> None:
    reply = exchange(port(server), request(key=key))
    error = assert_openai_error(reply, 401, "invalid_api_key")
    assert error["type"] == "authentication_error"


def test_no_authorization_header_is_a_401(server: BackgroundServer) -> None:
    assert_openai_error(exchange(port(server), request(key=None)), 401, "invalid_api_key")


# ---- numbers too long to convert ----


@pytest.mark.parametrize(
    ("field", "sign"),
    [("max_tokens", ""), ("max_tokens", "-"), ("max_completion_tokens", ""), ("seed", ""),
     ("temperature", "-"), ("top_k", ""), ("top_p", ""), ("budget", ""), ("n", ""),
     ("presence_penalty", "")],
)  # fmt: skip
def test_a_5000_digit_integer_is_a_400_naming_the_field(
    server: BackgroundServer, field: str, sign: str
) -> None:
    for chat_, path in ((False, "/v1/completions"), (True, "/v1/chat/completions")):
        raw = request("POST", path, body=big_int_body(field, sign=sign, chat_=chat_))
        error = assert_openai_error(exchange(port(server), raw), 400, param=field)
        assert field in error["message"]
        if field != "n":  # (n says its range)
            assert "5000 digits" in error["message"]


def test_long_integers_in_token_id_prompts(server: BackgroundServer) -> None:
    body = json.dumps(completion(prompt=[1, 2, 3])).replace("[1, 2, 3]", f"[1, {'7' * 5000}]")
    raw = request("POST", "/v1/completions", body=body.encode())
    assert_openai_error(exchange(port(server), raw), 400, param="prompt")
    # Long but convertible: still out of the vocabulary, named as before.
    body = json.dumps(completion(prompt=[1, 2, 3])).replace("[1, 2, 3]", f"[1, {'7' * 60}]")
    raw = request("POST", "/v1/completions", body=body.encode())
    assert_openai_error(exchange(port(server), raw), 400, param="prompt")


# ---- legacy completion fields specd does not implement ----


@pytest.mark.parametrize(
    ("field", "value"),
    [("echo", True), ("echo", 1), ("echo", "yes"), ("suffix", " the end"), ("best_of", 2),
     ("best_of", True), ("best_of", 1.5)],
)  # fmt: skip
def test_echo_suffix_best_of_are_refused(server: BackgroundServer, field: str, value: Any) -> None:
    for stream in (False, True):
        raw = request("POST", "/v1/completions", body=completion(**{field: value}, stream=stream))
        error = assert_openai_error(exchange(port(server), raw), 400, param=field)
        assert "not supported" in error["message"]


def test_their_defaults_are_accepted(server: BackgroundServer, baseline: dict[str, Any]) -> None:
    body = completion(echo=False, suffix=None, best_of=1)
    reply = exchange(port(server), request("POST", "/v1/completions", body=body))
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["text"] == baseline["text"]


# ---- what aiohttp's HTTP parser refuses before the application ----

PARSER_ERRORS = {
    "bad method": (b"G@T /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "invalid_method"),
    "16 KB path": (request(target="/" + "a" * 16384), "line_too_long"),
    "1,000 headers": (request(headers=[(f"X-H{i}", "v") for i in range(1000)]), None),
    "100 KB header": (request(headers=[("X-Big", "a" * 100_000)]), "line_too_long"),
    "Content-Length with Transfer-Encoding": (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        None,
    ),
    "bad chunk size": (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: application/json\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        None,
    ),
    "bad Content-Length": (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1x\r\n\r\n{}",
        None,
    ),
    "TLS on the HTTP port": (
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 64,
        "invalid_method",
    ),
}


@pytest.mark.parametrize("case", list(PARSER_ERRORS))
def test_parser_errors_are_4xx_in_the_openai_shape(server: BackgroundServer, case: str) -> None:
    raw, code = PARSER_ERRORS[case]
    reply = exchange(port(server), raw)
    error = assert_openai_error(reply, 400, code or "malformed_request")
    assert error["message"].startswith("malformed HTTP request: ")
    # (exchange() read until the server closed the connection, as it does after these)


CHUNKED_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
    + KEY.encode()
    + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def test_bad_chunk_while_the_body_is_being_read(server: BackgroundServer) -> None:
    """The headers are handed to the application first; the bad chunk size arrives while
    it reads the body. aiohttp alone left that read waiting until the client hung up."""
    reply = exchange(port(server), [CHUNKED_HEAD, b'5\r\n{"pro\r\n', b"zz\r\nabc\r\n0\r\n\r\n"])
    error = assert_openai_error(reply, 400, "malformed_request")
    assert "chunk" in error["message"]
    assert reply.headers["connection"].lower() == "close"


def test_a_body_that_does_not_decode(server: BackgroundServer) -> None:
    raw = request("POST", "/v1/completions", [("Content-Encoding", "gzip")], b"0123456789")
    error = assert_openai_error(exchange(port(server), raw), 400, "malformed_request")
    assert "gzip" in error["message"]


def test_non_ascii_bytes_elsewhere_in_the_head(server: BackgroundServer) -> None:
    """Bytes outside ASCII in the path (the parser), an Origin header (CORS) or NUL in a
    header (the parser): each refused in the OpenAI shape."""
    raw = request(target="/v1/mod\xe9ls")
    assert_openai_error(exchange(port(server), raw), 400, "malformed_request")
    raw = request(headers=[("Origin", b"http://\xe9vil.example")])
    assert_openai_error(exchange(port(server), raw), 403, "origin_not_allowed")
    raw = request(headers=[("X-Nul", b"a\x00b")])
    assert_openai_error(exchange(port(server), raw), 400, "malformed_request")


def test_a_request_side_parser_error_without_detail_is_not_called_internal() -> None:
    from aiohttp.web_protocol import RequestPayloadError

    from daemon.http.connections import parser_error

    err = parser_error(400, RequestPayloadError("the body ended early"))
    assert err.status == 400 and err.body()["error"]["code"] == "malformed_request"
    assert "internal" not in err.body()["error"]["message"]


# ---- bodies that used to reach a 500 ----


def nested(depth: int, brackets: str) -> str:
    opening, closing = {"[]": ("[", "]"), "{}": ('{"a": ', "}")}[brackets]
    return opening * depth + "1" + closing * depth


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/"]
)
def test_an_unknown_expectation_is_a_417_in_the_openai_shape(
    server: BackgroundServer, path: str
) -> None:
    """aiohttp answered `Expect: foo` itself, in plain text, before any middleware."""
    body = (chat() if "chat" in path else completion()) if "completions" in path else None
    method = "POST" if body is not None else "GET"
    raw = request(method, path, headers=[("Expect", "foo" * 100)], body=body)
    error = assert_openai_error(exchange(port(server), raw), 417, "expectation_failed", "Expect")
    assert "100-continue" in error["message"] and len(error["message"]) < 200


def test_100_continue_is_answered_and_then_the_request(server: BackgroundServer) -> None:
    raw = request("POST", "/v1/completions", headers=[("Expect", "100-continue")],
                  body=completion())  # fmt: skip
    head, _, rest = raw.partition(b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port(server)), timeout=30) as sock:
        sock.sendall(head + b"\r\n\r\n")
        interim = sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), interim
        sock.sendall(rest)
        received = interim[len(b"HTTP/1.1 100 Continue\r\n\r\n") :]
        while piece := sock.recv(65536):
            received += piece
    assert received.startswith(b"HTTP/1.1 200 "), received[:200]


@pytest.mark.parametrize("expect", [True, False], ids=["100-continue", "no-expect"])
def test_an_oversized_body_is_refused_at_once_and_never_read(
    server: BackgroundServer, expect: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A 1 GiB Content-Length on a kept-alive connection: a 413 before any body (with
    `Expect: 100-continue`, no interim 100 first), and the connection closed rather than
    the body drained (it was read whole, or waited for, with the connection kept)."""
    headers = [("Expect", "100-continue")] if expect else []
    head = request("POST", "/v1/completions", headers=headers, body=b"")
    head = head.replace(b"Content-Length: 0", b"Content-Length: %d" % (1 << 30))
    head = head.replace(b"Connection: close\r\n", b"")
    with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as sock:
        sock.sendall(head)
        received = b""
        while piece := sock.recv(65536):  # (a timeout here: the server kept the connection)
            received += piece
    assert received.startswith(b"HTTP/1.1 413 "), received[:100]
    assert b"Connection: close" in received and b"request_too_large" in received
    # Logged as every refusal is (the answer to an Expect header passes no middleware).
    assert any("413 request_too_large" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_nan_and_infinity_are_not_json(server: BackgroundServer, constant: str) -> None:
    """Python's json reads them; in a schema `{"const": NaN}` became null and the answer
    was `{"a": null}`. A 400, anywhere in the body."""
    schema = {"type": "object", "properties": {"a": {"const": 0}}, "required": ["a"]}
    body = json.dumps(
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        )
    )
    body = body.replace('"const": 0', f'"const": {constant}')  # fmt: skip
    for raw in (body, json.dumps(completion()).replace('"temperature": 0', f'"x": {constant}')):
        path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
        reply = exchange(port(server), request("POST", path, body=raw.encode()))
        error = assert_openai_error(reply, 400, "invalid_json")
        said = "is past a float's range" if "e999" in constant else "is not a JSON value"
        assert f"{constant} {said}" in error["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"n": True}, "n"), ({"n": "1"}, "n"), ({"n": 1.0}, "n"),
     ({"stream": True, "stream_options": {"include_usage": "false"}},
      "stream_options.include_usage"),
     ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
     ({"stream_options": {"include_usage": True}}, "stream_options")],  # (not streamed)
)  # fmt: skip
def test_fields_of_the_wrong_type_that_python_would_take_are_a_400(
    server: BackgroundServer, fields: dict[str, Any], param: str
) -> None:
    """`n: true` was 1 and `"include_usage": "false"` a true value."""
    raw = request("POST", "/v1/chat/completions", body=chat(**fields))
    error = assert_openai_error(exchange(port(server), raw), 400, param=param)
    assert param.split(".")[-1] in error["message"]


@pytest.mark.parametrize("brackets", ["[]", "{}"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_nested_20000_deep_is_a_400(
    server: BackgroundServer, path: str, brackets: str
) -> None:
    """json's decoder recurses once per level: 20,000 levels were a RecursionError and a
    500. The whole body, or one field of a streamed request: the same 400."""
    deep = nested(20_000, brackets)
    field = "messages" if path.endswith("chat/completions") else "prompt"
    for raw in (deep, f'{{"model": "{MODEL}", "stream": true, "{field}": {deep}}}'):
        reply = exchange(port(server), request("POST", path, body=raw.encode()))
        error = assert_openai_error(reply, 400, "invalid_json")
        assert "deeply" in error["message"]


@pytest.mark.parametrize("depth", [500, 900, 1000, 2000])
def test_nesting_around_the_parser_s_limit_is_never_a_500(
    server: BackgroundServer, depth: int
) -> None:
    """Just inside the parser's depth, a nested value is a field's wrong type (whose
    message shows it) or an ignored unknown field; just past it, the parser's 400."""
    for field in ("temperature", "messages", "stop", "model", "stream_options", "unknown"):
        raw = json.dumps(chat()).replace('"model"', f'"{field}": {nested(depth, "[]")}, "model"')
        reply = exchange(port(server), request("POST", "/v1/chat/completions", body=raw.encode()))
        assert reply.status in (200, 400), (field, depth, reply.body[:200])
        if reply.status == 400:
            assert_openai_error(reply, 400)


@pytest.mark.parametrize("role", [["user"], {"a": 1}, 1, None, True])
def test_a_role_of_another_json_type_is_a_400_naming_it(
    server: BackgroundServer, role: Any
) -> None:
    """A list or an object as a role was looked up in the roles' table: unhashable, a 500."""
    raw = json.dumps(chat(messages=[{"role": role, "content": "Hi"}])).encode()
    reply = exchange(port(server), request("POST", "/v1/chat/completions", body=raw))
    error = assert_openai_error(reply, 400)
    assert error["param"] == "messages[0].role"


def test_an_error_quoting_a_huge_value_keeps_its_start_and_end(server: BackgroundServer) -> None:
    """A message may quote what the request sent: a 1 MiB `model` was answered with a
    2.9 MB message (held by a client that never reads it). Its middle is cut."""
    messages = []
    for name in ("m", "m" * 600_000):
        raw = json.dumps(chat(model=name)).encode()
        reply = exchange(port(server), request("POST", "/v1/chat/completions", body=raw))
        assert reply.status == 404 and len(reply.body) < 4096, len(reply.body)
        messages.append(json.loads(reply.body)["error"]["message"])
    short, cut = messages
    assert cut.startswith("model 'mmm") and "characters …]" in cut
    advice = short.split("'m'", 1)[1]  # what follows the quoted name
    assert cut.endswith(advice), (short, cut[-200:])


def _called(call_id: str = "c1", arguments: str = "{}") -> list[dict]:
    """A conversation whose assistant called a tool and got its answer."""
    call = {"id": call_id, "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "ok"},
    ]


SURROGATES = {
    "content": (chat(messages=[{"role": "user", "content": "Hi \ud800"}]), "messages[0].content"),
    "second message": (
        chat(messages=[{"role": "system", "content": "Be kind"},
                       {"role": "user", "content": "\udfff"}]),
        "messages[1].content",
    ),
    "text part": (
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "\udc80b"}]}]),
        "messages[0].content[1].text",
    ),
    "prompt": (completion(prompt="Once \ud800 upon"), "prompt"),
    "stop": (completion(stop=["\ud800"]), "stop"),
    # (the tools and earlier calls a chat template writes were not checked: a 200)
    "tool description": (
        chat(tools=[{"type": "function", "function": {"name": "f", "description": "x\ud800"}}]),
        "tools[0].function.description",
    ),
    "tool call id": (chat(messages=_called(call_id="c\udfff")), "messages[1].tool_calls[0].id"),
    "tool call arguments": (
        chat(messages=_called(arguments='{"a": "\\ud800"}')),
        "messages[1].tool_calls[0].function.arguments",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SURROGATES))
def test_a_lone_surrogate_is_a_400_naming_the_field(server: BackgroundServer, case: str) -> None:
    """`"\\ud800"` is valid JSON but no text: the tokenizer raised a TypeError (a 500)."""
    body, field = SURROGATES[case]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    for stream in (False, True):
        raw = json.dumps({**body, "stream": stream}).encode()
        assert b"\\ud" in raw  # sent as the escape, as a client's JSON encoder does
        error = assert_openai_error(exchange(port(server), request("POST", path, body=raw)), 400)
        assert error["param"] == field and error["code"] == "invalid_unicode"
        assert field in error["message"] and "surrogate" in error["message"]


def test_a_surrogate_pair_is_a_character(server: BackgroundServer) -> None:
    raw = json.dumps(chat(messages=[{"role": "user", "content": "smile \U0001f600"}])).encode()
    assert b"\\ud83d\\ude00" in raw
    reply = exchange(port(server), request("POST", "/v1/chat/completions", body=raw))
    assert reply.status == 200, reply.body


def test_a_refused_request_cannot_forge_a_line_of_the_log(
    server: BackgroundServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusal's log line writes a client's path with its control characters escaped:
    a percent-encoded CR LF wrote a line of the attacker's into the log, NUL a NUL."""
    forged = "/%0d%0a2026-12-07%2016:00:00,000%20INFO%20specd.server:%20fake%00%1b[2J"
    with caplog.at_level("WARNING", logger="specd.api"):
        exchange(port(server), request("GET", forged, key=None))
    (line,) = [r.getMessage() for r in caplog.records if "refused GET" in r.getMessage()]
    assert not any(c in line for c in "\r\n\x00\x1b")
    assert "/\\x0d\\x0a2026-12-07 16:00:00,000 INFO specd.server: fake\\x00\\x1b[2J" in line
