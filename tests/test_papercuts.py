"""The first hour's papercuts (issue 35, item 8), each with the check that would have caught
it: the web chat's temperature is the daemon's default, its tree budget under `auto` is
said as such, an answer replayed from the prefix cache has no tokens/s, the web chat's
files install without setuptools warnings, a subcommand's wrong flag shows that
subcommand's usage, `specd start` says how to stop a running daemon, and a daemon on every
interface says so. The page's figures are computed by daemon/http/static/stats.js, run
here under Node where it is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from daemon import service
from daemon.addresses import daemon_url, listening_on
from daemon.cli import main
from daemon.cli.chat import stats_line
from daemon.http.openai_fields import DEFAULT_TEMPERATURE, WireLimits, generation_fields
from daemon.http.server import BackgroundServer
from daemon.http.webchat import STATIC
from daemon.settings_loading import load_settings

ROOT = Path(__file__).resolve().parents[1]
NODE = shutil.which("node")
PROMPT = "Once upon a time"


def page_figures(calls: dict[str, list[Any]]) -> dict[str, Any]:
    """{name: stats.js's `function(*args)`} for each of `calls` (name → [function, args])."""
    if NODE is None:
        pytest.skip("no node found: the page's figures are checked under Node")
    module = (STATIC / "stats.js").as_uri()
    script = (
        f"import * as figures from {json.dumps(module)};\n"
        f"const calls = {json.dumps(calls)};\n"
        "const out = {};\n"
        "for (const [name, [fn, args]] of Object.entries(calls)) out[name] = figures[fn](...args);\n"
        "console.log(JSON.stringify(out));\n"
    )
    done = subprocess.run(
        [NODE, "--input-type=module", "-e", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def server(stories_target: Path, stories_draft: Path) -> Iterator[BackgroundServer]:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "test"),
            "models.draft": (str(stories_draft), "test"),
            "runtime.compile": ("off", "test"),
            "server.port": (0, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        yield srv


def get(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def greedy_stats(server: BackgroundServer, prompt: str) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 24}
    return get(server.url + "/v1/chat/completions", body)["specd"]


# ---- 1. the web chat's temperature is the daemon's own default ----


def test_the_page_sends_no_temperature_unless_one_is_set() -> None:
    page = (STATIC / "index.html").read_text()
    box = re.search(r'<input id="temperature"[^>]*>', page)
    assert box, "the Temperature box is gone"
    assert "value=" not in box.group(0)  # empty: the request carries no temperature
    assert 'placeholder="server default"' in box.group(0)


def test_a_request_without_temperature_gets_the_default_the_status_reports(
    server: BackgroundServer,
) -> None:
    fields = generation_fields({"prompt": "x"}, chat=False, limits=WireLimits(16, 64))
    assert fields["params"].temperature == DEFAULT_TEMPERATURE == 1.0
    status = get(server.url + "/v1/specd/status")
    assert status["default_temperature"] == DEFAULT_TEMPERATURE
    machine = (STATIC / "machine.js").read_text()
    assert "status.default_temperature" in machine  # the box's placeholder says it


# ---- 2. the tree budget under auto ----


def test_auto_budget_is_said_as_auto_with_its_nodes() -> None:
    plain = "auto: plain decoding, predicted 859 tokens/s; speculation does not pay"
    shown = page_figures(
        {
            "tree": ["budgetText", [{"budget": 16, "budget_reason": "auto: a 16-node tree"}]],
            "plain": ["budgetText", [{"budget": 0, "budget_reason": plain, "tree_nodes": 0}]],
            "plain_after_trees": [
                "budgetText",
                [{"budget": 0, "budget_reason": plain, "tree_nodes": 0.25}],
            ],
            "fixed": ["budgetText", [{"budget": 16, "budget_reason": "fixed: budget 16"}]],
            "none": ["budgetText", [{"budget": None}]],
            "configured_auto": [
                "configuredBudgetText",
                [{"budget": "auto", "max_tree_budget": 256}],
            ],
            "configured_fixed": ["configuredBudgetText", [{"budget": 12, "max_tree_budget": 12}]],
            "hover": ["statItems", [{"budget": 0, "budget_reason": plain}]],
        }
    )
    assert shown["tree"] == "auto (16 nodes)"
    assert shown["plain"] == "auto (plain decoding)"
    assert shown["plain_after_trees"] == "auto (last round plain; 0.3 nodes/round)"
    assert shown["fixed"] == "16"  # a request's own budget, as it asked
    assert shown["none"] == "–"
    assert shown["configured_auto"] == "auto (up to 256 nodes)"
    assert shown["configured_fixed"] == "12 nodes"
    assert ["tree budget", "auto (plain decoding)", plain] in shown["hover"]


def test_the_status_reports_the_configured_budget(server: BackgroundServer) -> None:
    status = get(server.url + "/v1/specd/status")
    assert status["budget"] == "auto" and status["max_tree_budget"] > 0
    if NODE is not None:
        shown = page_figures({"b": ["configuredBudgetText", [status]]})
        assert shown["b"] == f"auto (up to {status['max_tree_budget']} nodes)"


# ---- 3. an answer replayed from the prefix cache has no tokens/s ----


def test_a_replayed_answer_says_so_instead_of_a_speed(server: BackgroundServer) -> None:
    prompt = "The little dog ran to the park."
    first = greedy_stats(server, prompt)
    again = greedy_stats(server, prompt)  # greedy: every token is in the prefix cache now
    assert first["target_passes"] > 0 and again["target_passes"] == 0
    assert again["prefix_cache_hits"] > 0
    # (no pass: no tokens per pass and no batch, where they read 8.0 and 0.0)
    assert again["tokens_per_target_pass"] is None and again["batch_size"] is None
    assert "tokens/s" in stats_line(first)
    hits = again["prefix_cache_hits"]
    assert stats_line(again) == f"[replayed from the prefix cache: {hits} tokens, no target pass]"
    shown = page_figures(
        {
            "first": ["speedText", [first]],
            "again": ["speedText", [again]],
            "items": ["statItems", [again]],
        }
    )
    assert float(shown["first"]) > 0
    assert shown["again"] == "replayed from the prefix cache"
    assert ["tokens/pass", "–", ""] in shown["items"]  # no pass to divide by


def test_the_chat_stats_line_for_each_kind_of_answer() -> None:
    passes = {"tokens_per_second": 12.5, "tokens_per_target_pass": 2.5, "target_passes": 4}
    assert stats_line(passes) == "[12.5 tokens/s, 2.50 tokens per target pass]"
    partly = {**passes, "prefix_cache_hits": 3}
    assert stats_line(partly) == (
        "[12.5 tokens/s, 2.50 tokens per target pass, 3 tokens from the prefix cache]"
    )
    forced = {"tokens_per_second": 9e4, "target_passes": 0, "prefix_cache_hits": 0}
    assert stats_line(forced) == "[no target pass ran for this answer]"
    # A daemon that sends no pass count is taken at its word.
    assert stats_line({"tokens_per_second": 40.0}) == "[40.0 tokens/s, - tokens per target pass]"


# ---- 4. the web chat's files install without setuptools warnings ----


def test_the_static_files_are_package_data_of_their_own_package() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "daemon.http.static" in config["packages"]
    globs = config["package-data"]["daemon.http.static"]
    for path in STATIC.iterdir():
        assert any(path.match(g) for g in globs), f"{path.name} would not be installed"


def test_a_wheel_builds_without_warnings_and_holds_the_page(tmp_path: Path) -> None:
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("modeling", "speculative", "offload", "daemon", "config"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    out = tmp_path / "wheel"
    build = f"from setuptools import build_meta; build_meta.build_wheel({str(out)!r})"
    done = subprocess.run(
        [sys.executable, "-c", build],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    for warning in ("would be ignored", "absent from the `packages`", "as data is deprecated"):
        assert warning not in said, said[-3000:]
    (wheel,) = out.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in STATIC.iterdir():
        assert f"daemon/http/static/{path.name}" in names


# ---- 5. a subcommand's wrong flag shows that subcommand's usage ----


@pytest.mark.parametrize(
    ("argv", "prog", "unknown"),
    [
        (["chat", "--bogus"], "specd chat", "--bogus"),
        (
            ["generate", "--model", "m", "--max-token", "3"],
            "specd generate",
            "--max-token 3 (--max-token: did you mean --max-tokens?)",
        ),
        (
            ["generate", "--model", "m", "--modle", "x"],
            "specd generate",
            "--modle x (--modle: did you mean --model?)",
        ),
        (
            ["start", "--modle", "m"],
            "specd start",
            "--modle m (--modle: did you mean --model?)",
        ),
        (["config", "show", "--nope"], "specd config show", "--nope"),
        (["service", "install", "--what"], "specd service install", "--what"),
    ],
)
def test_a_wrong_flag_is_the_subcommands_error(
    argv: list[str], prog: str, unknown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Said in a few lines (a newcomer's `specd start --modle` printed 30 lines of usage
    before the error), with the flag meant where a misspelt one is close to one."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} [-h]")
    assert err.endswith(f"{prog}: error: unrecognized arguments: {unknown}\n")
    assert err.count("\n") <= 5, err


def test_an_unknown_subcommand_is_still_the_top_levels_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["bogus"])
    err = capsys.readouterr().err
    assert err.startswith("usage: specd [-h]") and "invalid choice: 'bogus'" in err


# ---- 6. `specd start` says how to stop the daemon it finds running ----


def test_start_names_the_running_daemon_and_how_to_stop_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = service.ServicePaths(tmp_path / "state", tmp_path / "log")
    monkeypatch.setattr(service, "_serves", lambda argv: True)  # this process stands in
    me = psutil.Process()
    service.DaemonRecord(me.pid, "http://127.0.0.1:8716", me.create_time()).write(paths)
    with pytest.raises(service.ServiceError) as refused:
        service.start(paths, [], "http://127.0.0.1:8716", 5.0)
    assert str(refused.value) == (
        f"specd is already running (pid {me.pid}) at http://127.0.0.1:8716; `specd stop` stops it"
    )


# ---- 7. a daemon on every interface says so ----


def test_where_a_daemon_listens_is_said_with_a_url_to_open() -> None:
    assert listening_on("127.0.0.1", 8716) == "listening on http://127.0.0.1:8716"
    assert listening_on("0.0.0.0", 8716) == (
        "listening on 0.0.0.0:8716 (all interfaces); open http://127.0.0.1:8716"
    )
    assert listening_on("::", 8716) == (
        "listening on [::]:8716 (all interfaces); open http://127.0.0.1:8716"
    )
    assert listening_on("::1", 9) == "listening on http://[::1]:9"
    # Clients still connect through loopback.
    assert daemon_url("0.0.0.0", 8716) == "http://127.0.0.1:8716"


def test_start_on_every_interface_prints_what_it_listens_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for var in ("XDG_CONFIG_HOME", "XDG_STATE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    asked: list[str] = []

    def started(paths: object, flags: object, url: str, *rest: object) -> service.DaemonRecord:
        asked.append(url)
        return service.DaemonRecord(4242, url, None)

    monkeypatch.setattr(service, "start", started)
    assert main(["start", "--model", "m", "--host", "0.0.0.0", "--port", "8716"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(
        "specd is running (pid 4242), listening on 0.0.0.0:8716 (all interfaces); "
        "open http://127.0.0.1:8716; logs: "
    )
    assert asked == ["http://127.0.0.1:8716"]  # what `specd start` polls for /health
    # Open to other machines with no API key: said (the Host check stops browsers only).
    assert captured.err.startswith("specd: warning: server.host 0.0.0.0 answers other machines")
    key = tmp_path / "key"
    key.write_text("k" * 32)
    assert main(["start", "--model", "m", "--host", "0.0.0.0", "--api-key-file", str(key)]) == 0
    assert capsys.readouterr().err == ""
    assert main(["start", "--model", "m", "--host", "::1"]) == 0
    assert capsys.readouterr().err == ""


# ---- a reader of stdout that leaves early (`specd status | head -2`) ----


def test_a_closed_stdout_is_no_traceback(tmp_path: Path) -> None:
    """`specd status | head -2` printed a BrokenPipeError traceback: whoever read the
    output has what it wanted, so specd leaves quietly, with the shell's 128 + SIGPIPE."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    argv = [sys.executable, "-m", "daemon.cli", "config", "show"]
    run = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert run.stdout is not None and run.stderr is not None
    run.stdout.close()  # before it writes a line
    err = run.stderr.read().decode()
    assert run.wait(timeout=60) == 141, err
    assert err == ""


# ---- what `--draft auto` chose, in `specd status` ----


def test_the_status_names_the_draft_auto_chose(
    stories_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`specd status` said `draft auto`; the daemon's status now gives what auto settled on
    and why, and `specd status` prints both."""
    from daemon.cli.service import format_machine

    for name in ("HOME", "HF_HOME"):  # no stores or hub cache of the user's to find
        monkeypatch.setenv(name, str(tmp_path))
    for name in ("OLLAMA_MODELS", "LMSTUDIO_MODELS"):
        monkeypatch.delenv(name, raising=False)
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "test"),
            "models.draft": ("auto", "test"),
            "runtime.compile": ("off", "test"),
            "server.port": (0, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        status = get(srv.url + "/v1/specd/status")
    assert status["draft"] == "ngram" and status["draft_kind"] == "ngram"
    assert status["draft_reason"].startswith("draft auto: prompt lookup")
    lines = format_machine(status).splitlines()
    assert lines[0] == f"  target {stories_target}, draft ngram"
    assert lines[1] == f"  {status['draft_reason']}"
    assert lines[3].startswith("  plan: ") and lines[3].endswith(", nothing streamed a pass")


def test_specd_bench_shows_a_replayed_row_without_a_speed_per_pass() -> None:
    """A row replayed from the prefix cache has no tokens per pass (None, where it read a
    made-up 8.0): `specd bench` printed it with `:.2f` and crashed, a reviewer found."""
    from daemon.cli.bench import per_pass, row_sentence

    row = {"target_passes": 0, "prefill_passes": 0, "generated_tokens": 32,
           "tokens_per_target_pass": None, "drafted": 0}  # fmt: skip
    assert per_pass(row) == "-" and row_sentence(row) == "32 tokens in 0 target passes"
    assert per_pass({**row, "tokens_per_target_pass": 2.5}) == "2.50"


def test_specd_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`specd --version` prints the installed version (it said a command is required)."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"specd {version('specd')}\n"
