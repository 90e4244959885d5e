"""`--draft auto` (daemon/draft_choice.py), each branch of its choice: a small model with the
target's tokenizer found on this machine (the largest of at most a quarter of the target's
parameters; another tokenizer, or a model too large, is passed over), else on a GPU the
substitute where it fits and some layers stream, else prompt lookup (a CPU; a resident
target, whose substitute would be itself; a substitute that does not fit). The choice and
its reason reach the runtime's stats and `specd plan`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from daemon import draft_choice
from daemon.cli import main
from daemon.draft_choice import choose_draft, find_draft_model
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.checkpoints.checkpoint import load_tokenizer, open_checkpoint
from offload.planning import PlanError
from speculative.sampling import SamplingParams

TINY = {"vocab_size": 512, "num_heads": 4, "num_kv_heads": 2}


@pytest.fixture(scope="module")
def models(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """A target, two small models of its tokenizer, one of another tokenizer, and one as
    large as the target."""
    target = tiny_checkpoint("llama", hidden_size=256, intermediate_size=512, num_layers=4, **TINY)
    small = tiny_checkpoint("llama", hidden_size=64, num_layers=2, seed=1, **TINY)
    larger = tiny_checkpoint("llama", hidden_size=96, num_layers=2, seed=2, **TINY)
    other = tmp_path_factory.mktemp("other") / "other"
    shutil.copytree(larger, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # one swap: another tokenizer of the same size
    (other / "tokenizer.json").write_text(json.dumps(tok))
    twin = tmp_path_factory.mktemp("twin") / "twin"
    shutil.copytree(target, twin)
    return {"target": target, "small": small, "larger": larger, "other": other, "twin": twin}


def opened(path: Path) -> tuple[Any, Any]:
    ckpt = open_checkpoint(path)
    return ckpt, load_tokenizer(ckpt)


def test_the_largest_small_model_of_the_same_tokenizer_is_found(models: dict[str, Path]) -> None:
    target, tok = opened(models["target"])
    found = [(name, models[name]) for name in ("twin", "other", "small", "larger")]
    best = find_draft_model(target, tok, found)
    # "other" is "larger"'s size but not the target's tokenizer; "twin" is the target's size
    assert best is not None and best[:2] == ("larger", models["larger"])
    passed_over = [("other", models["other"]), ("twin", models["twin"])]
    assert find_draft_model(target, tok, passed_over) is None
    only = find_draft_model(target, tok, [("small", models["small"])])
    assert only is not None and only[0] == "small"
    choice = choose_draft(target, tok, "cpu", lambda: pytest.fail("no plan is needed"), found)
    assert choice.draft == str(models["larger"]) and "larger" in choice.reason


def plan_stub(streamed: int, resident: int = 2, experts: str = "device") -> Any:
    return SimpleNamespace(
        streamed_layers=streamed, resident_layers=resident, expert_mode=experts,
        device_parts={"draft weights": 8 * 2**30},
    )  # fmt: skip


def test_without_a_model_a_gpu_drafts_with_the_substitute_where_it_pays(
    models: dict[str, Path],
) -> None:
    target, tok = opened(models["target"])
    choice = choose_draft(target, tok, "cuda", lambda: plan_stub(streamed=2), found=[])
    assert choice.draft == "substitute" and "2 of 4 layers stream" in choice.reason
    resident = choose_draft(target, tok, "cuda", lambda: plan_stub(streamed=0, resident=4), [])
    assert resident.draft == "ngram" and "the target itself" in resident.reason
    # A mixture whose experts live in RAM: the copies would take the expert cache's room.
    routed = choose_draft(target, tok, "cuda", lambda: plan_stub(0, 4, "stream"), found=[])
    assert routed.draft == "ngram" and "copies of every expert (8 GiB)" in routed.reason

    def too_big() -> Any:
        raise PlanError("the substitute draft does not fit at 2-bit\nmore")

    unfit = choose_draft(target, tok, "cuda", too_big, found=[])
    assert unfit.draft == "ngram" and "does not fit at 2-bit" in unfit.reason
    cpu = choose_draft(target, tok, "cpu", lambda: pytest.fail("no plan on a CPU"), found=[])
    assert cpu.draft == "ngram" and "on a CPU" in cpu.reason


def test_a_run_drafts_with_what_auto_found(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(draft_choice, "local_models", lambda: [("small", models["small"])])
    rt = Runtime(RuntimeOptions(model=str(models["target"]), draft="auto", device="cpu",
                                context=128))  # fmt: skip
    assert rt.draft_kind == "model" and rt.options.draft == str(models["small"])
    stats = rt.draft_stats()
    assert "small" in str(stats["draft_reason"])
    greedy = SamplingParams(temperature=0.0)
    prompt = [5, 6, 7, 8]
    tree = rt.generation(prompt, greedy, 24, ignore_eos=True).run()
    plain = rt.generation(prompt, greedy, 24, ignore_eos=True, strategy="autoregressive").run()
    assert tree.token_ids == plain.token_ids


def test_plan_says_what_auto_chose(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(draft_choice, "local_models", lambda: [])
    assert main(["plan", "--model", str(models["target"]), "--draft", "auto"]) == 0
    assert "note     draft auto: prompt lookup" in capsys.readouterr().out
    monkeypatch.setattr(draft_choice, "local_models", lambda: [("small", models["small"])])
    assert main(["plan", "--model", str(models["target"]), "--draft", "auto"]) == 0
    out = capsys.readouterr().out
    assert "draft auto: small" in out and "draft weights" in out


def test_a_target_streamed_from_disk_is_not_given_the_substitute(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The substitute is built from the streamed layers' copies in RAM: where the plan
    reads them from disk (a GGUF larger than the RAM left, the case the disk tier now
    serves), `auto` drafts by prompt lookup, and `--draft substitute` is refused by the
    plan as loading refuses it (`auto` chose the substitute, and the daemon could not
    start)."""
    from tests.test_gguf_model import GGUF

    monkeypatch.setattr(draft_choice, "local_models", lambda: [])
    argv = ["plan", "--model", str(GGUF / "llama-rand-256-Q4_K_M.gguf"), "--device", "cuda",
            "--gpu-budget", "17MB", "--ram-budget", "4MB", "--bandwidth", "10GB",
            "--prefix-cache", "0", "--context", "512", "--offload", "stream",
            "--resident-layers", "0", "--host-tier", "disk"]  # fmt: skip
    assert main([*argv, "--draft", "auto"]) == 0
    out = capsys.readouterr().out
    assert "draft auto: prompt lookup" in out and "streams them from disk" in out, out
    assert main([*argv, "--draft", "substitute"]) == 2
    assert "streams them from disk" in capsys.readouterr().err
