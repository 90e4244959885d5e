"""`specd generate`: called in-process through `daemon.cli.main`, plus one run of the real
console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.cli import main


def _json_run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    return json.loads(out[0])


def _reference(stories_reference: dict, prompt: str) -> dict:
    return next(i for i in stories_reference["items"] if i["prompt"] == prompt)


def test_json_record_and_greedy_reference(capsys, stories_target, stories_reference) -> None:
    item = _reference(stories_reference, "The little dog")
    n = 24
    record = _json_run(
        capsys,
        "--model",
        str(stories_target),
        "--prompt",
        "The little dog",
        "--max-tokens",
        str(n),
        "--ignore-eos",
        "--draft",
        "none",  # plain decoding, one pass per token (the default drafts: `auto`)
    )
    assert record["prompt_ids"] == item["prompt_ids"]  # --prompt adds BOS: the config says so
    assert record["token_ids"] == item["new_token_ids"][:n]
    assert record["finish_reason"] == "length"
    assert item["full_text"].startswith("The little dog" + record["text"])
    assert record["stats"]["target_passes"] == n + record["stats"]["prefill_passes"]
    assert record["stats"]["generated_tokens"] == n
    assert record["stats"]["draft_kind"] is None and record["stats"]["strategy"] == "autoregressive"


def test_draft_auto_on_a_cpu_is_prompt_lookup(capsys, stories_target, stories_reference) -> None:
    """No --draft is --draft auto: it chooses (prompt lookup on a CPU, no model of the stories
    tokenizer being on this machine), says why, and greedy is still the target's own."""
    item = _reference(stories_reference, "The little dog")
    argv = ["--model", str(stories_target), "--prompt", "The little dog", "--max-tokens", "24"]
    record = _json_run(capsys, *argv, "--ignore-eos", "--device", "cpu")  # the default: auto
    assert record["token_ids"] == item["new_token_ids"][:24]
    stats = record["stats"]
    assert stats["draft_kind"] == "ngram" and stats["strategy"] == "tree"
    assert stats["draft_reason"].startswith("draft auto: prompt lookup")


def test_prompt_ids_are_fed_exactly(capsys, stories_target, stories_reference) -> None:
    """No BOS is added to --prompt-ids: without it the continuation differs from the
    reference, with it (given explicitly) it matches."""
    item = _reference(stories_reference, "Lily and Tom")
    ids = item["prompt_ids"]
    assert ids[0] == 1
    with_bos = _json_run(
        capsys,
        "--model",
        str(stories_target),
        "--prompt-ids",
        ",".join(map(str, ids)),
        "--max-tokens",
        "8",
    )
    assert with_bos["prompt_ids"] == ids
    assert with_bos["token_ids"] == item["new_token_ids"][:8]
    without = _json_run(
        capsys,
        "--model",
        str(stories_target),
        "--prompt-ids",
        ",".join(map(str, ids[1:])),
        "--max-tokens",
        "8",
    )
    assert without["prompt_ids"] == ids[1:]
    assert without["stats"]["prompt_tokens"] == len(ids) - 1


def test_text_output_streams_the_story(capsys, stories_target, stories_reference) -> None:
    item = _reference(stories_reference, "Once upon a time")
    argv = ["generate", "--model", str(stories_target), "--prompt", "Once upon a time"]
    assert main([*argv, "--max-tokens", "16"]) == 0
    out, err = capsys.readouterr()
    assert item["full_text"].startswith("Once upon a time" + out.rstrip("\n"))
    assert len(out) > 20
    # A cut answer says so, as `specd chat` marks it (JSON under a schema, cut, read as a
    # finished answer); at the context's end too.
    assert err == "specd: [cut at --max-tokens 16]\n"
    assert main([*argv, "--max-tokens", "200", "--context", "24"]) == 0
    assert capsys.readouterr().err == "specd: [cut: the context is full]\n"


@pytest.mark.parametrize(
    ("model", "expect"),
    [
        ("/no/such/model/folder", "not found: give a Hugging Face model folder"),
        ("nobody-here/not-a-cached-model", "'nobody-here/not-a-cached-model'"),
    ],
)
def test_bad_model_is_one_clear_line(capsys, monkeypatch, tmp_path, model: str, expect: str):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert main(["generate", "--model", model, "--prompt", "hi"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("specd: error: ") and expect in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_prompt_ids_outside_the_vocabulary(capsys, stories_target) -> None:
    argv = ["generate", "--model", str(stories_target), "--prompt-ids", "1,99999"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "outside the vocabulary" in err[0]


def test_console_script(stories_target: Path, stories_reference: dict) -> None:
    """The installed `specd` entry point, as a user runs it."""
    item = _reference(stories_reference, "One day, a big")
    script = Path(sys.executable).with_name("specd")
    argv = [str(script), "generate", "--model", str(stories_target), "--json"]
    argv += ["--prompt", "One day, a big", "--max-tokens", "12", "--device", "cpu"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["token_ids"] == item["new_token_ids"][:12]

    bad = [str(script), "generate", "--model", str(stories_target / "missing"), "--prompt", "x"]
    failed = subprocess.run(bad, capture_output=True, text=True, timeout=120, check=False)
    assert failed.returncode == 2
    assert failed.stderr.count("\n") == 1 and failed.stderr.startswith("specd: error: ")


# ---- the user's mistakes are one line; our bugs keep their traceback ----


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--top-p", "0"], "top_p=0.0 is out of range"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--context", "100000"], "longer than"),
    ],
)
def test_a_user_error_is_one_line_and_exit_2(capsys, stories_target, flags, expect) -> None:
    argv = ["generate", "--model", str(stories_target), "--prompt", "hi", "--device", "cpu"]
    assert main([*argv, *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specd: error: ") and expect in lines[0]


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (["--temperature", "500"], "temperature must be a number in [0.0, 2.0]"),
        (["--max-depth", "0"], "--max-depth must be at least 1"),
        (["--spec-length", "0"], "--spec-length must be at least 1"),
        (["--prompt", "a\udcff"], "--prompt is not valid UTF-8"),  # argv's byte 0xff
        (["--prompt", "a", "--stop", "\udcff"], "--stop is not valid UTF-8"),
    ],
)
def test_flag_values_the_strategies_refuse_are_usage_errors(
    capsys, stories_target, flags, expect
) -> None:
    """These reached the strategies (or the tokenizer) as a bare ValueError (a TypeError),
    which the command line took for the user's fault only by accident."""
    argv = ["generate", "--model", str(stories_target), "--device", "cpu"]
    if "--prompt" not in flags:
        argv += ["--prompt", "hi"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err


def test_an_internal_error_keeps_its_traceback(monkeypatch, stories_target) -> None:
    """A ValueError that is not a RequestError is a bug: it is not dressed up as one line
    blaming the user (the interpreter prints its traceback, exit status 1)."""
    from speculative import generation

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ValueError("an invariant broke")

    # `specd generate` imports Generation when it runs (the CLI imports no torch up front).
    monkeypatch.setattr(generation, "Generation", broken)
    argv = ["generate", "--model", str(stories_target), "--prompt", "hi", "--device", "cpu"]
    with pytest.raises(ValueError, match="an invariant broke"):
        main(argv)


def test_chat_sends_the_prompt_through_the_chat_template(capsys, shared_models: Path) -> None:
    """--chat on a real instruct model (SmolLM2, its GGUF as shipped): the question goes
    through the model's template as a user message and the answer ends at its end of
    turn, as transformers answers greedily (the model folder's README)."""
    gguf = shared_models / "smollm2-135m-instruct" / "smollm2-135m-instruct-q4_1.gguf"
    record = _json_run(
        capsys, "--model", str(gguf), "--compile", "off", "--chat",
        "--prompt", "What is the capital of France?", "--max-tokens", "40",
    )  # fmt: skip
    assert record["text"] == "The capital of France is Paris."
    assert record["finish_reason"] == "stop"
    # Without --chat the raw question ends at once: the terminal showed nothing, and
    # nothing said why.
    argv = ["generate", "--model", str(gguf), "--compile", "off", "--max-tokens", "8",
            "--prompt", "What is the capital of France?"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == "\n"
    assert "it has a chat template: --chat sends --prompt as a user message" in captured.err


def test_chat_takes_text_not_ids(capsys, stories_target) -> None:
    code = main(["generate", "--model", str(stories_target), "--chat", "--prompt-ids", "1,2"])
    assert code == 2
    assert "--chat" in capsys.readouterr().err
    # No text at all: an empty user message was sent (and answered).
    assert main(["generate", "--model", str(stories_target), "--chat"]) == 2
    assert "give --prompt" in capsys.readouterr().err


def test_a_schema_file_that_is_no_small_json_file_is_one_line(
    stories_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json-schema FILE read as a request's body is: a FIFO hung, /dev/zero filled the
    memory, 100,000 brackets were a RecursionError traceback."""
    import os

    fifo, deep = tmp_path / "fifo.json", tmp_path / "deep.json"
    os.mkfifo(fifo)
    deep.write_text("[" * 100_000)
    args = ["generate", "--model", str(stories_target), "--prompt", "Once", "--max-tokens", "2"]
    for schema, says in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"),
                         (deep, "is not JSON")):  # fmt: skip
        assert main([*args, "--json-schema", str(schema)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and f"--json-schema {schema}" in err, err


def test_a_first_build_of_the_cpu_kernels_and_a_substitutes_layers_are_announced(
    capsys, stories_target, monkeypatch, tmp_path
) -> None:
    """The first command on a machine built the CPU kernels for seconds, and a substitute
    draft its layers for minutes on a CPU, saying nothing; each says so on stderr once
    (the substitute's layers at most every few seconds)."""
    from modeling.weights import cpu_library

    monkeypatch.setattr(cpu_library._LIBRARY, "will_build", lambda: True)
    argv = ["generate", "--model", str(stories_target), "--prompt", "Once", "--max-tokens", "2"]
    assert (
        main([*argv, "--draft", "substitute", "--substitute-bits", "4", "--offload", "stream"]) == 0
    )
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "specd: building the CPU kernels for this machine (once: a few seconds)"
    assert err[1].startswith("specd: building the 4-bit substitute draft: 1 of ")
    assert not any("substitute draft" in line for line in err[2:])  # (within seconds)
