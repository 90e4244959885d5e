"""Defaults that suit the machine: `dtype auto` (the checkpoint's dtype on CUDA, fp32 on a
CPU when the model fits in fp32) and `context auto` (the longest that fits, never below
4,096), each explained by the plan; and the largest tree the plan holds (`--budget`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from daemon.cli import commands as cli
from daemon.footprint import footprint
from daemon.memory_plan import OffloadOptions, choose_plan, plan_request
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from daemon.settings import LimitsSettings
from daemon.settings_loading import load_settings
from modeling.checkpoints.checkpoint import dtype_candidates, dtype_key
from modeling.config import ModelConfig
from modeling.models import config_from_hf
from offload.plan import MemoryBudget
from offload.planning import MIN_AUTO_CONTEXT, PlanError, longest_context, make_plan
from scripts.real_shapes import full_config, hf_config
from speculative.budget import AUTO_MAX_BUDGET
from speculative.prefill import PREFILL_CHUNK

# Llama-3.1-8B/70B and Llama-3.2-1B as their config.json files declare them (bf16).
MODELS = {
    name: hf_config(full_config(preset))
    for name, preset in (
        ("Llama-3.2-1B", "llama-3.2-1b"),
        ("Llama-3.1-8B", "llama-3.1-8b"),
        ("Llama-3.1-70B", "llama-3.1-70b"),
    )
}


def gpu(size: float, ram: float = 256e9) -> MemoryBudget:
    return MemoryBudget("cuda", int(size), "configured", int(ram), "configured", 25e9, "configured")


def cpu(ram: float) -> MemoryBudget:
    return MemoryBudget("cpu", int(ram), "configured", int(ram), "configured", None, "configured")


def config(name: str) -> ModelConfig:
    return config_from_hf(MODELS[name])


def write_config(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MODELS[name]))
    return folder


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    path = tiny_checkpoint("llama", dtype=torch.bfloat16, seed=5)
    raw = json.loads((path / "config.json").read_text())
    assert "bfloat16" in (raw.get("torch_dtype"), raw.get("dtype"))  # what the test relies on
    return path


# ---- dtype auto ----


def test_the_checkpoint_dtype_is_read_from_config_json() -> None:
    assert dtype_key("bfloat16") == "bf16" and dtype_key("torch.float16") == "fp16"
    assert dtype_key("float32") == "fp32" and dtype_key("int8") is None and dtype_key(None) is None
    bf16 = config("Llama-3.1-8B")
    assert [d for d, _ in dtype_candidates("auto", bf16, "cuda")] == ["bf16"]
    assert [d for d, _ in dtype_candidates("auto", bf16, "cpu")] == ["fp32", "bf16"]
    assert [d for d, _ in dtype_candidates("fp16", bf16, "cpu")] == ["fp16"]
    fp32 = config_from_hf({**MODELS["Llama-3.1-8B"], "torch_dtype": "float32"})
    assert [d for d, _ in dtype_candidates("auto", fp32, "cuda")] == ["fp32"]
    with pytest.raises(ValueError, match="auto, fp32"):
        dtype_candidates("fp8", bf16, "cuda")


def test_a_bf16_checkpoint_plans_bf16_on_cuda_and_fp32_on_a_cpu_where_it_fits(
    bf16_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Planned for a GPU from this machine (which has none, in CI): that machine's default.
    argv = ["plan", "--model", str(bf16_checkpoint), "--gpu-budget", "1GB", "--ram-budget", "4GB"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budget"]["device"] == "cuda" and out["dtype"] == "bfloat16"
    assert "checkpoint" in out["dtype_reason"] and "CUDA" in out["dtype_reason"]
    assert cli.main(argv) == 0
    assert "dtype    bfloat16 (auto: the checkpoint's dtype" in capsys.readouterr().out
    # This machine's CPU: fp32, which fits easily.
    assert cli.main(["plan", "--model", str(bf16_checkpoint), "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budget"]["device"] == "cpu" and out["dtype"] == "float32"
    # An explicit dtype is kept and said to be asked for.
    assert cli.main([*argv, "--dtype", "fp16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "float16" and out["dtype_reason"] == "as requested"


def test_the_runtime_on_a_cpu_loads_a_bf16_checkpoint_in_fp32(bf16_checkpoint: Path) -> None:
    runtime = Runtime(RuntimeOptions(model=str(bf16_checkpoint), device="cpu"))
    assert runtime.dtype == "fp32" and runtime.target.embed_tokens.weight.dtype == torch.float32
    assert runtime.plan.request.target.dtype == "float32"
    forced = Runtime(RuntimeOptions(model=str(bf16_checkpoint), device="cpu", dtype="bf16"))
    assert forced.dtype == "bf16" and forced.target.embed_tokens.weight.dtype == torch.bfloat16


def test_on_a_cpu_without_room_for_fp32_the_checkpoint_dtype_is_used() -> None:
    target = config("Llama-3.1-8B")  # 32 GB in fp32, 16 GB in bf16
    roomy = choose_plan(target, None, "8B", "auto", 8192, "cpu", OffloadOptions(), cpu(64e9))
    assert roomy.request.target.dtype == "float32" and roomy.streamed_layers == 0
    tight = choose_plan(target, None, "8B", "auto", 8192, "cpu", OffloadOptions(), cpu(24e9))
    assert tight.request.target.dtype == "bfloat16" and tight.streamed_layers == 0
    assert "does not fit" in tight.dtype_reason


def test_tiny_fp32_checkpoints_keep_fp32_and_their_whole_context(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """The runtime on this CPU machine behaves as before the defaults changed."""
    small = Runtime(RuntimeOptions(model=str(tiny_checkpoint("llama")), device="cpu"))
    assert small.dtype == "fp32" and small.context == 256  # max below 4,096: the max
    assert "maximum" in small.plan.context_reason
    path = tiny_checkpoint("llama", max_position_embeddings=8192, seed=3)
    long = Runtime(RuntimeOptions(model=str(path), device="cpu"))
    assert long.context == 8192 and long.plan.streamed_layers == 0
    with pytest.raises(PlanError, match="longer than"):
        Runtime(RuntimeOptions(model=str(path), device="cpu", context=8193))


# ---- context auto ----


def test_context_auto_keeps_a_target_that_fits_resident() -> None:
    """An 8B in bf16 fits a 24 GB card whole with tens of thousands of tokens; its maximum
    (128k) would only fit streamed, which costs far more per pass than it gives."""
    plan = choose_plan(
        config("Llama-3.1-8B"), config("Llama-3.2-1B"), "8B", "auto", "auto", "cuda",
        OffloadOptions(), gpu(24e9),
    )  # fmt: skip
    assert plan.streamed_layers == 0 and plan.device_bytes <= 24e9
    assert MIN_AUTO_CONTEXT <= plan.request.context < 131072
    assert (
        "every target layer" in plan.context_reason
        and "streaming would allow" in plan.context_reason
    )
    # The longest: one more token would not fit with every layer resident.
    r = plan.request
    assert longest_context(replace(r, context=131072), gpu(24e9), r.target.num_layers) == r.context


def test_70b_with_a_1b_draft_on_a_24gb_card_plans_a_long_context_in_bf16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = write_config(tmp_path / "Llama-3.1-70B", "Llama-3.1-70B")
    draft = write_config(tmp_path / "Llama-3.2-1B", "Llama-3.2-1B")
    argv = ["plan", "--model", str(target), "--draft", str(draft), "--gpu-budget", "24GB"]
    argv += ["--ram-budget", "160GB"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "bfloat16" and out["budget"]["device"] == "cuda"
    assert MIN_AUTO_CONTEXT <= out["context"] < 131072
    assert out["context_reason"].startswith("auto: the longest that fits beside the draft")
    assert out["streamed_layers"] > 0 and out["device_bytes"] <= 24e9
    # The largest pass is a prefill chunk (the tree folds pending prompt tokens only while
    # they fit it); the largest auto tree returns a logit row per node.
    assert out["pass_tokens"] == max(PREFILL_CHUNK, AUTO_MAX_BUDGET + 1)
    # (and a row for each other sequence a daemon holds, as `specd start` plans it)
    limits = LimitsSettings()
    assert out["logit_rows"] == AUTO_MAX_BUDGET + limits.max_concurrent + limits.cached_sessions
    # Longest: a context one token longer does not fit even with nothing resident.
    sequences = limits.max_concurrent + limits.cached_sessions
    longer = plan_request(
        footprint(config("Llama-3.1-70B"), torch.bfloat16, "70B"),
        footprint(config("Llama-3.2-1B"), torch.bfloat16, "1B"),
        out["context"] + 1,
        OffloadOptions(offload="stream", resident_layers=0, sequences=sequences),
    )  # fmt: skip
    with pytest.raises(PlanError):
        make_plan(longer, gpu(24e9, 160e9))
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert f"context  {out['context']} tokens (auto:" in text and "dtype    bfloat16" in text


def test_a_budget_below_4096_tokens_says_what_would_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = write_config(tmp_path / "Llama-3.1-70B", "Llama-3.1-70B")
    draft = write_config(tmp_path / "Llama-3.2-1B", "Llama-3.2-1B")
    argv = ["plan", "--model", str(target), "--draft", str(draft), "--gpu-budget", "12GB"]
    assert cli.main([*argv, "--ram-budget", "160GB"]) == 2
    err = capsys.readouterr().err
    assert "context auto plans at least 4096 tokens" in err and "What would fit" in err
    shorter = int(err.split("--context ")[1].split()[0])
    assert 0 < shorter < MIN_AUTO_CONTEXT
    # Asking for that context explicitly is a plan.
    assert cli.main([*argv, "--ram-budget", "160GB", "--context", str(shorter)]) == 0


def test_context_auto_on_a_cpu_is_the_same_rule_against_ram() -> None:
    plan = choose_plan(
        config("Llama-3.1-8B"), None, "8B", "bf16", "auto", "cpu", OffloadOptions(), cpu(20e9)
    )
    assert plan.streamed_layers == 0 and MIN_AUTO_CONTEXT <= plan.request.context < 131072
    with pytest.raises(PlanError, match="at least 4096"):
        choose_plan(
            config("Llama-3.1-8B"), None, "8B", "bf16", "auto", "cpu",
            OffloadOptions(offload="none"), cpu(16.5e9),
        )  # fmt: skip


def test_settings_default_to_auto_and_an_integer_forces(tmp_path: Path) -> None:
    settings = load_settings(environ={}, overrides={"models.target": ("m", "test")})
    assert (settings.models.dtype, settings.context.length) == ("auto", "auto")
    options = settings.runtime_options()
    assert (options.dtype, options.context) == ("auto", "auto")
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text("models:\n  target: m\ncontext:\n  length: null\n")
    assert load_settings(config_file=legacy, environ={}).runtime_options().context == "auto"
    forced = load_settings(
        environ={"SPECD_CONTEXT_LENGTH": "8192", "SPECD_MODELS_DTYPE": "bf16"},
        overrides={"models.target": ("m", "test")},
    ).runtime_options()
    assert (forced.dtype, forced.context) == ("bf16", 8192)


def test_context_auto_on_a_cpu_counts_the_prefix_cache_in_its_search() -> None:
    """On a CPU the prefix cache is RAM beside the model: the search for the longest
    context must see it, or it picks a context whose plan then does not fit."""
    cache = OffloadOptions(prefix_cache_bytes=4 << 30)
    plan = choose_plan(
        config("Llama-3.1-8B"), None, "8B", "bf16", "auto", "cpu", cache, cpu(24e9)
    )  # fmt: skip
    assert plan.streamed_layers == 0 and plan.device_parts["prefix cache"] == 4 << 30
    assert plan.device_bytes <= 24e9 and plan.request.context >= MIN_AUTO_CONTEXT


# ---- the largest tree ----


def test_the_runtime_knows_the_largest_tree_its_plan_holds(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    path = str(tiny_checkpoint("llama", max_position_embeddings=8192, seed=3))
    auto = Runtime(RuntimeOptions(model=path, draft="ngram", device="cpu"))
    assert auto.max_tree_budget == AUTO_MAX_BUDGET
    assert auto.plan.request.pass_tokens == max(PREFILL_CHUNK, AUTO_MAX_BUDGET + 1)
    fixed = Runtime(RuntimeOptions(model=path, draft="ngram", device="cpu", budget=1000))
    assert fixed.max_tree_budget == 1000
    assert fixed.plan.request.pass_tokens == max(PREFILL_CHUNK, 1000 + 1)
    assert fixed.plan.request.logit_rows == 1000 + 1


def test_a_cli_budget_the_plan_cannot_hold_names_the_largest_that_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = write_config(tmp_path / "Llama-3.1-70B", "Llama-3.1-70B")
    draft = write_config(tmp_path / "Llama-3.2-1B", "Llama-3.2-1B")
    argv = ["plan", "--model", str(target), "--draft", str(draft), "--gpu-budget", "15GB"]
    argv += ["--ram-budget", "160GB"]
    assert cli.main([*argv, "--budget", "20000"]) == 2
    err = capsys.readouterr().err
    assert "--budget 20000" in err and "largest tree budget that fits is" in err
    largest = int(err.split("largest tree budget that fits is ")[1].split(":")[0])
    assert 1 <= largest < 20000
    assert cli.main([*argv, "--budget", str(largest)]) == 0
    capsys.readouterr()
    assert cli.main([*argv, "--budget", str(largest + 1)]) == 2


def test_generate_takes_auto_for_both_flags(
    bf16_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", str(bf16_checkpoint), "--prompt-ids", "1,5,9"]
    argv += ["--max-tokens", "2", "--json", "--device", "cpu"]
    assert cli.main([*argv, "--dtype", "auto", "--context", "auto"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2
    assert cli.main([*argv, "--context", "100000"]) == 2
    assert "longer than" in capsys.readouterr().err
