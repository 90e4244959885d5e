"""The web chat's files and `GET /v1/specd/status` over a live daemon (no browser): what is
public, what needs the key, the same-origin rule, and the plan the status reports."""

from __future__ import annotations

import itertools
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.cli import main
from daemon.http.server import BackgroundServer
from daemon.http.webchat import PAGE_FILES, STATIC
from daemon.settings_loading import load_settings

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("key") / "api_key"
    path.write_text(KEY + "\n")
    return path


@pytest.fixture(scope="module")
def server(stories_target: Path, stories_draft: Path, key_file: Path) -> Iterator[BackgroundServer]:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "test"),
            "runtime.compile": ("off", "test"),
            "models.draft": (str(stories_draft), "test"),
            "server.port": (0, "test"),
            "server.api_key_file": (str(key_file), "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        yield srv


def call(
    url: str, body: dict | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("path", sorted(PAGE_FILES))
def test_page_files_are_public_and_locked_down(server: BackgroundServer, path: str) -> None:
    status, headers, body = call(server.url + path)
    assert status == 200 and body
    assert headers["Content-Type"].startswith(PAGE_FILES[path][1])
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_the_page_loads_nothing_from_elsewhere(server: BackgroundServer) -> None:
    for path in PAGE_FILES:
        text = call(server.url + path)[2].decode()
        assert "http://" not in text and "https://" not in text, path


def test_every_static_file_and_module_import_is_served() -> None:
    # A module the page imports but the daemon does not serve breaks the whole page.
    served = {name for name, _ in PAGE_FILES.values()}
    assert served == {p.name for p in STATIC.iterdir() if p.is_file()}
    imported = set()
    for script in STATIC.glob("*.js"):
        for name in re.findall(r'from "\./([\w-]+\.js)"', script.read_text()):
            assert name in served, f"{script.name} imports {name}, which is not served"
            imported.add(name)
    assert imported == served - {"index.html", "app.js", "style.css"}


def test_other_paths_are_not_served_or_need_the_key(server: BackgroundServer) -> None:
    assert call(server.url + "/static/../pyproject.toml")[0] in (401, 404)
    assert call(server.url + "/static/index.html")[0] in (401, 404)
    assert call(server.url + "/v1/specd/status")[0] == 401


def test_a_foreign_host_is_refused_even_for_the_page(server: BackgroundServer) -> None:
    status, _, body = call(server.url + "/", headers={"Host": "evil.example"})
    assert status == 403 and json.loads(body)["error"]["code"] == "host_not_allowed"


def test_status_reports_the_plan_and_the_engine(server: BackgroundServer) -> None:
    status, _, body = call(server.url + "/v1/specd/status", headers=AUTH)
    assert status == 200
    info = json.loads(body)
    assert info["status"] == "ready" and info["model"] == "stories260k"
    assert info["active"] == 0 and info["queued"] == 0
    assert info["strategy"] == "tree" and info["draft"].endswith("stories260k-draft")
    plan = info["plan"]
    assert plan["resident_layers"] == 5 and plan["streamed_layers"] == 0
    assert {"slots", "host_tier", "seconds_per_pass", "device_parts"} <= set(plan)
    assert info["stream"]["gbps"] is None  # nothing streams on this machine's plan


def chat(server: BackgroundServer, headers: dict[str, str]) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": "Once"}], "max_tokens": 4}
    status, _, raw = call(server.url + "/v1/chat/completions", body, headers)
    return status, json.loads(raw)


def test_status_reports_what_tree_verification_accepted(server: BackgroundServer) -> None:
    """A sampled request without a seed starts its trees with rejection verification; the
    status then shows that table's rounds and first-child acceptance."""
    assert chat(server, AUTH)[0] == 200  # temperature 1 by default, no seed
    info = json.loads(call(server.url + "/v1/specd/status", headers=AUTH)[2])
    tables = info["tree_acceptance"]
    sampled = [v for k, v in tables.items() if k.startswith("rejection/")]
    assert sampled and sampled[0]["rounds"] >= 1, tables
    assert 0.0 < sampled[0]["first_child"] <= 1.0
    cache = info["prefix_cache"]  # the round's verified rows were stored
    assert cache["rows"] >= 1 and 0 < cache["bytes"] <= cache["allocated_bytes"]
    assert cache["allocated_bytes"] <= cache["max_bytes"]


def test_the_page_origin_may_post_and_others_may_not(server: BackgroundServer) -> None:
    # Browsers send Origin on same-origin POSTs: the daemon's own origin is allowed.
    status, body = chat(server, {**AUTH, "Origin": server.url})
    assert status == 200 and body["choices"][0]["message"]["content"]
    status, body = chat(server, {**AUTH, "Origin": "http://evil.example"})
    assert status == 403 and body["error"]["code"] == "origin_not_allowed"
    # An origin on another port of this machine is another site.
    other = server.url.rsplit(":", 1)[0] + ":1"
    assert chat(server, {**AUTH, "Origin": other})[0] == 403


def test_specd_status_prints_the_machine(
    server: BackgroundServer,
    key_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for var in ("XDG_CONFIG_HOME", "XDG_STATE_HOME"):  # no pid file or config of the user's
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    port = str(server.server.port)
    config = tmp_path / "specd.yaml"
    config.write_text(f"server:\n  api_key_file: {key_file}\n")
    assert main(["status", "--port", port, "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "specd: ready" in out and "serving stories260k" in out
    assert "plan: 5 resident / 0 streamed layers, 0 slots" in out
    assert "strategy tree, context 512 tokens" in out
    assert "streaming: nothing streamed" in out
    assert "prefix cache: " in out and "MiB allocated of 1024 MiB" in out
    # Without the key the health line still comes, and the details say why they do not.
    assert main(["status", "--port", port]) == 0
    assert "no machine details: /v1/specd/status answered 401" in capsys.readouterr().out
    # `specd chat` takes the configured key as `status` does (it sent none: a 401).
    once = ["chat", "--port", port, "--once", "Hi", "--max-tokens", "4"]
    assert main([*once, "--config", str(config)]) == 0
    assert main(once) == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert main([*once, "--api-key-file", str(tmp_path / "missing")]) == 2  # (a bad flag)
    assert "--api-key-file" in capsys.readouterr().err


def stream_events(server: BackgroundServer, body: dict) -> list[dict]:
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = resp.read().decode().splitlines()
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def traces(events: list[dict]) -> list[dict]:
    return [e["specd"]["trace"] for e in events if "trace" in e.get("specd", {})]


TRACED = {
    "messages": [{"role": "user", "content": "Lily and Ben went to the park."}],
    "temperature": 0,
    "max_tokens": 40,
    "budget": 12,
    "strategy": "tree",
}


def test_trace_adds_each_rounds_draft_tree(server: BackgroundServer) -> None:
    events = stream_events(server, {**TRACED, "specd": {"trace": True}})
    rounds = traces(events)
    assert rounds and [r["round"] for r in rounds] == list(range(1, len(rounds) + 1))
    final = next(e for e in events if e["choices"] and e["choices"][0]["finish_reason"])
    assert len(rounds) == final["specd"]["target_passes"]  # one tree per verify pass
    assert sum(r["accepted_count"] for r in rounds) == final["specd"]["accepted"]
    for r in rounds:
        n = len(r["tokens"])
        assert n == r["nodes"] + 1 <= 13 and not r["truncated"]
        assert r["parents"][0] == -1 and all(0 <= r["parents"][i] < i for i in range(1, n))
        # The accepted path is a chain from the root, and its tokens were emitted, in order,
        # followed by the target's own next token.
        chain = [0, *r["accepted"]]
        assert all(r["parents"][b] == a for a, b in itertools.pairwise(chain))
        cached = r["prefix_cache_hits"]
        accepted_text = [r["tokens"][v] for v in r["accepted"]]
        assert r["emitted"][cached : cached + len(accepted_text)] == accepted_text
        if r is not rounds[-1]:  # (the last round may be cut short by max_tokens)
            assert len(r["emitted"]) == cached + len(accepted_text) + 1
    # The text is what the same request gives without a trace (which sends no trees).
    plain = stream_events(server, TRACED)
    assert traces(plain) == []

    def text(evs: list[dict]) -> str:
        return "".join(e["choices"][0]["delta"].get("content", "") for e in evs if e["choices"])

    assert text(events) == text(plain)


def test_a_trace_is_bounded(server: BackgroundServer) -> None:
    # (A prompt of its own: one the prefix cache knows would need no tree.)
    messages = [{"role": "user", "content": "The cat sat on a big red mat."}]
    body = {**TRACED, "messages": messages, "budget": 200, "specd": {"trace": True}}
    rounds = traces(stream_events(server, body))
    assert rounds and all(len(r["tokens"]) <= 64 for r in rounds)
    assert any(r["truncated"] and r["nodes"] > 63 for r in rounds)


@pytest.mark.parametrize("specd", [True, {"trace": "yes"}, []])
def test_a_bad_specd_field_is_refused(server: BackgroundServer, specd: object) -> None:
    status, _, raw = call(
        server.url + "/v1/chat/completions", {**TRACED, "specd": specd}, headers=AUTH
    )
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"].startswith("specd")
