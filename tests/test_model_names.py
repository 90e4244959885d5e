"""How a model is named: what `--model` and `--draft` say they accept, the error for a
`.gguf` path that is not there, the id a served model is listed under and the names a
request's `model` may give for it, and the dtype reason a GGUF file's plan prints."""

from __future__ import annotations

import argparse
import http.client
import json
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import main
from daemon.cli.commands import build_parser
from daemon.http.edge import ApiConfig
from daemon.http.openai_fields import WireLimits
from daemon.http.server import BackgroundServer, api_config
from daemon.settings_loading import load_settings
from modeling.checkpoints.checkpoint import (
    ModelNotFoundError,
    dtype_candidates,
    open_checkpoint,
    resolve,
)
from tests.conftest import SHARED_MODELS

Q4_1 = SHARED_MODELS / "smollm2-135m-instruct" / "smollm2-135m-instruct-q4_1.gguf"
F32 = SHARED_MODELS / "gguf" / "stories260k-F32.gguf"
Q8_0 = SHARED_MODELS / "gguf" / "stories260k-Q8_0.gguf"
FORMS = (".gguf", "ollama:NAME[:TAG]", "lmstudio:PUBLISHER/REPO[/FILE]", "hub id")


# ---- --model and --draft ----


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser by its path ("generate", "config show")."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found[f"{path} {name}".strip()] = sub
                    walk(sub, f"{path} {name}")

    walk(build_parser(), "")
    return found


def flag_help(parser: argparse.ArgumentParser, flag: str) -> str | None:
    return next((a.help for a in parser._actions if flag in a.option_strings), None)


def test_every_model_and_draft_flag_names_every_form_it_accepts() -> None:
    parsers = subcommands()
    with_model = {name for name, p in parsers.items() if flag_help(p, "--model") is not None}
    assert {"generate", "serve", "start", "plan", "bench"} <= with_model
    for name in with_model:
        for flag in ("--model", "--draft"):
            text = flag_help(parsers[name], flag)
            assert text is not None, f"specd {name} has --model but no {flag}"
            assert all(form in text for form in FORMS), f"specd {name} {flag}: {text}"
        draft = flag_help(parsers[name], "--draft") or ""
        assert "'ngram'" in draft and "'substitute'" in draft, f"specd {name}: {draft}"


# ---- a .gguf path that is not there ----


@pytest.mark.parametrize("name", ["x.gguf", "X.GGUF"])
def test_a_missing_gguf_file_is_said_not_to_exist(tmp_path: Path, name: str) -> None:
    path = tmp_path / "absent" / name
    with pytest.raises(ModelNotFoundError, match="does not exist") as caught:
        resolve(path)
    assert str(path) in str(caught.value) and "Hugging Face" not in str(caught.value)


def test_generate_with_a_missing_gguf_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.gguf"
    assert main(["generate", "--model", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"specd: error: model file {path} does not exist: check the path (`specd models` "
        "lists the models on this machine)"
    )


@pytest.mark.parametrize("command", [["serve", "--port", "1"], ["plan"]])
def test_a_relative_path_from_a_config_file_says_where_it_looked(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: list[str],
) -> None:
    """A relative path in a YAML file is taken from the folder specd runs in, not the
    file's: the one line says which file gave it and which folder it was looked for in
    (`plan` said only that the file did not exist)."""
    config = tmp_path / "cfg" / "specd.yaml"
    config.parent.mkdir()
    config.write_text("models:\n  target: models/x.gguf\n")
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model file models/x.gguf does not exist" in err
    assert f"models.target in {config}" in err and f"runs in, {tmp_path};" in err
    # The draft's too; a path given by a flag is the user's own, said as it is.
    config.write_text(f"models:\n  target: {Q8_0}\n  draft: models/d.gguf\n")
    assert main([*command, "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "model file models/d.gguf does not exist" in err and "models.draft in" in err
    assert main([*command, "--config", str(config), "--draft", "models/e.gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model file models/e.gguf does not exist" in err and "in, " not in err


# ---- the served id and the names a request may give ----


def served(target: str, name: str | None = None) -> ApiConfig:
    overrides: dict[str, Any] = {"models.target": (target, "test")}
    if name is not None:
        overrides["models.name"] = (name, "test")
    return api_config(load_settings(environ={}, overrides=overrides))


def test_a_gguf_file_is_served_without_its_extension_and_answers_to_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = served("models/smollm2-135m-instruct-q4_1.gguf")
    assert config.model_name == "smollm2-135m-instruct-q4_1"
    for name in (
        "smollm2-135m-instruct-q4_1",
        "smollm2-135m-instruct-q4_1.gguf",
        "models/smollm2-135m-instruct-q4_1.gguf",
        str(tmp_path / "models" / "smollm2-135m-instruct-q4_1.gguf"),
    ):
        assert config.serves(name), name
    for name in ("smollm2-135m-instruct", "other.gguf", "q4_1", "models"):
        assert not config.serves(name), name
    assert served("/m/Tiny.GGUF").model_name == "Tiny"
    assert served("lmstudio:pub/repo/Tiny-Q4_0.gguf").model_name == "Tiny-Q4_0"
    assert served("lmstudio:pub/repo/Tiny-Q4_0.gguf").serves("lmstudio:pub/repo/Tiny-Q4_0.gguf")


@pytest.mark.parametrize(
    ("target", "accepted", "refused"),
    [
        (
            "ollama:llama3.1:8b",
            ["llama3.1:8b", "ollama:llama3.1:8b", "library/llama3.1:8b",
             "registry.ollama.ai/library/llama3.1:8b"],
            ["llama3.1", "llama3.1:latest", "ollama:llama3.1", "llama3.1:70b", "8b"],
        ),
        (
            "ollama:tiny",
            ["tiny", "tiny:latest", "ollama:tiny", "ollama:tiny:latest", "library/tiny"],
            ["tiny:8b", "other", "latest"],
        ),
        (
            "ollama:tiny:latest",
            ["tiny", "tiny:latest", "ollama:tiny", "ollama:tiny:latest"],
            ["tiny:8b"],
        ),
        (
            "ollama:hf.co/someone/tiny-GGUF:Q4_0",
            ["hf.co/someone/tiny-GGUF:Q4_0", "ollama:hf.co/someone/tiny-GGUF:Q4_0"],
            ["tiny-GGUF:Q4_0", "someone/tiny-GGUF:Q4_0", "hf.co/someone/tiny-GGUF"],
        ),
    ],
)  # fmt: skip
def test_an_ollama_model_answers_to_ollamas_own_names(
    target: str, accepted: list[str], refused: list[str]
) -> None:
    config = served(target)
    assert config.model_name == target  # listed as it was given
    assert [n for n in accepted if not config.serves(n)] == []
    assert [n for n in refused if config.serves(n)] == []


def test_a_folder_or_hub_id_and_a_configured_name_answer_to_their_id_only() -> None:
    folder = served(str(SHARED_MODELS / "stories260k") + "/")
    assert folder.model_name == "stories260k" and folder.model_names == {"stories260k"}
    assert not folder.serves(str(SHARED_MODELS / "stories260k"))
    hub = served("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert hub.model_name == "SmolLM2-135M-Instruct"
    assert not hub.serves("HuggingFaceTB/SmolLM2-135M-Instruct")
    named = served("ollama:tiny", name="my-model")
    assert named.model_name == "my-model" and named.model_names == {"my-model"}
    assert not named.serves("tiny")


def test_an_api_config_without_other_names_serves_its_id_only() -> None:
    config = ApiConfig(model_name="m", limits=WireLimits(16, 64), max_body_bytes=1024)
    assert config.serves("m") and not config.serves("m.gguf")


def request(server: BackgroundServer, method: str, path: str, body: Any = None) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    try:
        payload = None if body is None else json.dumps(body)
        conn.request(method, path, payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_a_served_ollama_model_is_listed_and_answers_to_its_ollama_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_model_stores import pull

    store = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    pull(store, "registry.ollama.ai/library/tiny/latest", Q8_0)
    settings = load_settings(
        environ={},
        overrides={
            "models.target": ("ollama:tiny", "test"),
            "runtime.compile": ("off", "test"),
            "server.port": (0, "test"),
        },
    )
    with BackgroundServer(settings) as server:
        status, listed = request(server, "GET", "/v1/models")
        assert status == 200 and [m["id"] for m in listed["data"]] == ["ollama:tiny"]
        for name in ("tiny:latest", "tiny", "ollama:tiny"):
            body = {"model": name, "prompt": "Once", "max_tokens": 2, "temperature": 0}
            status, out = request(server, "POST", "/v1/completions", body)
            assert status == 200 and out["model"] == "ollama:tiny", (name, out)
        body = {"model": "tiny:8b", "prompt": "Once", "max_tokens": 2}
        status, out = request(server, "POST", "/v1/completions", body)
        assert status == 404
        assert out["error"]["param"] == "model" and out["error"]["code"] == "model_not_found"
        assert "'tiny:8b'" in out["error"]["message"]


# ---- a GGUF file's dtype in the plan ----


def plan_dtype_line(capsys: pytest.CaptureFixture[str], model: Path, *flags: str) -> str:
    budget = ["--ram-budget", "8GB", "--bandwidth", "25GB/s"]
    assert main(["plan", "--model", str(model), *budget, *flags]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if "dtype  " in line)


def test_a_quantized_gguf_plan_names_the_files_tensor_types(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = plan_dtype_line(capsys, Q4_1, "--device", "cpu")
    assert line == (
        "  dtype    float32 (auto: fp32 on the CPU, where the model fits in fp32 (the GGUF "
        "file's layers are F32, Q4_1))"
    )
    line = plan_dtype_line(capsys, Q4_1, "--device", "cuda", "--gpu-budget", "24GB")
    assert line == "  dtype    bfloat16 (auto: bf16 for the GGUF file's F32, Q4_1 layers on CUDA)"
    # Where fp32 does not fit in RAM, the next candidate says so, naming the types too.
    config = open_checkpoint(Q4_1, config_only=True).config
    assert dtype_candidates("auto", config, "cpu")[1] == (
        "bf16",
        "auto: bf16 for the GGUF file's F32, Q4_1 layers: in fp32 the model does not fit "
        "in the CPU's RAM budget",
    )


def test_a_float_gguf_plan_names_its_tensors_dtype_not_config_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = plan_dtype_line(capsys, F32, "--device", "cpu")
    assert line == "  dtype    float32 (auto: the checkpoint's dtype (float32) on CPU)"
