"""The memory plan's arithmetic on meta-device models shaped like real ones, its decisions
(resident/streamed, host tier), its errors, and `specd plan` on a config.json-only folder."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from daemon.cli import commands as cli
from daemon.footprint import footprint
from daemon.memory_plan import GRAPHS, OffloadOptions, plan_request
from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.layers.attention import ATTENTION_CHUNK_BYTES
from modeling.models import config_from_hf
from offload.device_parts import graph_bytes
from offload.machine import detect_budget
from offload.plan import MemoryBudget, PlanRequest
from offload.planning import PlanError, host_tier_bytes, make_plan
from offload.units import format_size, parse_rate, parse_size
from speculative.budget import AUTO_MAX_BUDGET
from speculative.prefill import PREFILL_CHUNK

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama(hidden: int, inter: int, layers: int, heads: int, tie: bool, factor: float) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": hidden // heads,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "factor": factor},
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
    }


# Real configs (abridged to the keys that matter) and their published parameter counts.
MODELS = {
    "Llama-3.2-1B": (llama(2048, 8192, 16, 32, True, 32.0), 1_235_814_400),
    "Llama-3.1-8B": (llama(4096, 14336, 32, 32, False, 8.0), 8_030_261_248),
    "Llama-3.1-70B": (llama(8192, 28672, 80, 64, False, 8.0), 70_553_706_496),
    "Qwen2.5-32B": (
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "hidden_size": 5120,
            "intermediate_size": 27648,
            "num_hidden_layers": 64,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "vocab_size": 152064,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "sliding_window": 131072,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        },
        32_763_876_352,
    ),
}


def true_layer_params(raw: dict) -> int:
    """Written out from the architecture, independently of ModelConfig."""
    d, f = raw["hidden_size"], raw["intermediate_size"]
    hd = raw.get("head_dim", d // raw["num_attention_heads"])
    q, kv = raw["num_attention_heads"] * hd, raw["num_key_value_heads"] * hd
    bias = (q + 2 * kv) if raw["model_type"] == "qwen2" else 0
    return d * q + 2 * d * kv + q * d + bias + 3 * d * f + 2 * d


def fp(name: str, dtype: torch.dtype = torch.bfloat16):
    raw, _ = MODELS[name]
    return footprint(config_from_hf(raw), dtype, name)


def budget(gpu: float, ram: float, bandwidth: float | None = 25e9) -> MemoryBudget:
    return MemoryBudget(
        "cuda", int(gpu), "configured", int(ram), "configured", bandwidth, "configured"
    )


def plan(name: str, gpu: float, ram: float, context: int = 8192, **options):
    request = plan_request(fp(name), None, context, OffloadOptions(**options))
    return make_plan(request, budget(gpu, ram))


@pytest.mark.parametrize("name", list(MODELS))
def test_sizes_match_the_true_parameter_counts(name: str) -> None:
    raw, published = MODELS[name]
    f = fp(name)
    assert f.num_layers == raw["num_hidden_layers"]
    assert abs(f.layer_bytes - 2 * true_layer_params(raw)) <= 0.01 * 2 * true_layer_params(raw)
    # RoPE's small fp table is the only non-parameter tensor counted.
    assert abs(f.weight_bytes - 2 * published) <= 0.01 * 2 * published
    hd = raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    assert (
        f.kv_bytes_per_token == 2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * hd * 2
    )


def test_a_model_that_fits_stays_resident() -> None:
    p = plan("Llama-3.1-8B", gpu=24e9, ram=64e9)
    assert (p.resident_layers, p.streamed_layers, p.host_tier) == (32, 0, None)
    assert p.device_bytes <= 24e9


def test_70b_on_a_24gb_card_streams_from_disk_when_ram_is_short() -> None:
    p = plan("Llama-3.1-70B", gpu=24e9, ram=64e9)
    layer = fp("Llama-3.1-70B").layer_bytes
    assert p.resident_layers + p.streamed_layers == 80
    assert p.streamed_layers > 60 and p.slots == 2
    assert p.device_bytes <= 24e9 < p.device_bytes + layer  # as many resident as fit
    assert p.host_tier == "disk"  # ~120 GB of streamed layers do not fit in 64 GB
    # Staging, and one piece of a cast where the file's dtype is not the run's
    assert p.host_bytes == host_tier_bytes(layer, 2) + fp("Llama-3.1-70B").disk_scratch_bytes
    assert p.streamed_bytes_per_pass == p.streamed_layers * layer
    assert p.seconds_per_pass == pytest.approx(p.streamed_layers * layer / 25e9)
    roomy = plan("Llama-3.1-70B", gpu=24e9, ram=256e9)
    assert roomy.host_tier == "ram"
    assert roomy.host_bytes == host_tier_bytes(layer, roomy.streamed_layers)
    text = roomy.render()
    assert "streamed through 2 slots" in text and "s per target pass" in text


def test_host_tier_bytes_are_one_arena_without_pinned_rounding() -> None:
    # One page-aligned arena per tier, page-locked in place: a 70B layer (1.59 GiB) is not
    # rounded up to the caching host allocator's 2 GiB.
    layer = fp("Llama-3.1-70B").layer_bytes
    assert 0 <= host_tier_bytes(layer, 80) - 80 * layer < 4096 * 16
    fits = plan("Llama-3.1-70B", gpu=24e9, ram=80 * layer + 2**20)
    assert fits.host_tier == "ram"
    assert fits.host_bytes == host_tier_bytes(layer, fits.streamed_layers)
    with pytest.raises(PlanError, match="--host-tier disk"):
        plan("Llama-3.1-70B", gpu=24e9, ram=fits.streamed_layers * layer // 2, host_tier="ram")
    # A CPU device pins nothing; its host tier is the same arena.
    cpu = MemoryBudget(
        "cpu", int(300e9), "configured", int(300e9), "configured", None, "configured"
    )
    request = plan_request(fp("Llama-3.1-70B"), None, 8192, OffloadOptions(offload="stream"))
    on_cpu = make_plan(request, cpu)
    assert on_cpu.host_tier == "ram"
    assert on_cpu.host_bytes == host_tier_bytes(layer, on_cpu.streamed_layers)


def test_forced_disk_tier_and_forced_ram_tier_that_cannot_fit() -> None:
    assert plan("Qwen2.5-32B", 16e9, 256e9, host_tier="disk").host_tier == "disk"
    with pytest.raises(PlanError, match="--host-tier disk"):
        plan("Qwen2.5-32B", 16e9, 16e9, host_tier="ram")


def test_explicit_resident_layers_and_slots() -> None:
    p = plan("Llama-3.1-8B", 24e9, 64e9, offload="stream", resident_layers=10, slots=3)
    assert (p.resident_layers, p.streamed_layers, p.slots) == (10, 22, 3)
    with pytest.raises(PlanError, match="fewer --resident-layers"):
        plan("Llama-3.1-70B", 24e9, 256e9, resident_layers=40)


def test_a_budget_that_cannot_fit_says_what_would() -> None:
    with pytest.raises(PlanError) as err:
        plan("Llama-3.1-8B", gpu=4e9, ram=64e9, context=131072)
    message = str(err.value)
    assert "do not fit" in message and "--context" in message
    context = int(message.split("--context ")[1].split()[0])
    assert 0 < context < 131072
    assert plan("Llama-3.1-8B", gpu=4e9, ram=64e9, context=context).streamed_layers > 0
    with pytest.raises(PlanError, match="--offload stream"):
        plan("Llama-3.1-70B", gpu=24e9, ram=64e9, offload="none")


def test_a_draft_that_does_not_fit_is_named() -> None:
    request = plan_request(fp("Llama-3.1-8B"), fp("Llama-3.1-8B"), 8192, OffloadOptions())
    with pytest.raises(PlanError, match="smaller draft"):
        make_plan(request, budget(17e9, 64e9))


def test_sizes_as_people_write_them() -> None:
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("24 gb") == 24 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_rate("25GB/s") == 25e9
    assert format_size(1.5 * 2**30) == "1.5 GiB"
    assert parse_size("512B") == 512 and parse_rate("800 MB/s") == 8e8
    # Text needs its unit: `--gpu-budget 24` meant 24 GB and planned with 24 bytes, and
    # `--bandwidth 25` estimated passes at 25 bytes a second.
    for bad in ("lots", "24XB", "-1GB", "0", "24", "0.5", "0.5B"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
    with pytest.raises(ValueError, match="not a rate: write a number with a unit"):
        parse_rate("25")


@pytest.mark.parametrize(
    ("flag", "value"), [("--gpu-budget", "24"), ("--bandwidth", "25"), ("--cpu-rate", "8")]
)
def test_a_size_or_rate_without_its_unit_is_refused(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from daemon.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "x", flag, value])
    assert exited.value.code == 2
    assert f"{flag}: " in capsys.readouterr().err


def test_measured_budget_on_this_machine() -> None:
    b = detect_budget("cpu", "auto", "auto", None, measure=True)
    assert b.device == "cpu" and b.device_bytes > 0 and b.ram_bytes > 0
    assert b.bandwidth is not None and b.bandwidth > 0 and b.bandwidth_source.startswith("measured")


def test_specd_plan_on_a_config_only_folder(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "Llama-3.1-70B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MODELS["Llama-3.1-70B"][0]))
    argv = ["plan", "--model", str(folder), "--dtype", "bf16", "--context", "8192"]
    argv += ["--gpu-budget", "24GB", "--ram-budget", "64GB", "--bandwidth", "25GB/s"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_tier"] == "disk" and out["resident_layers"] + out["streamed_layers"] == 80
    assert out["budget"]["bandwidth"] == 25e9 and out["seconds_per_pass"] > 0
    assert cli.main(argv) == 0
    assert "layers" in capsys.readouterr().out
    assert cli.main([*argv[:-6], "--gpu-budget", "2GB", "--offload", "none"]) == 2
    assert "do not fit" in capsys.readouterr().err


def test_runtime_streams_from_disk_when_forced(stories_target: Path) -> None:
    base = {"model": str(stories_target), "device": "cpu", "context": 64}
    runtime = Runtime(
        RuntimeOptions(**base, offload="stream", resident_layers=1, host_tier="disk", slots=2)
    )
    assert runtime.plan is not None and runtime.plan.host_tier == "disk"
    assert runtime.streamer is not None and runtime.streamer.storage.tier == "disk"
    plain = Runtime(RuntimeOptions(**base, offload="none"))
    tokens, positions = torch.tensor([1, 403, 407, 261]), torch.arange(4)
    a = runtime.target(tokens, positions, runtime.target.new_cache(8))
    b = plain.target(tokens, positions, plain.target.new_cache(8))
    assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks planning from a machine without CUDA")
def test_plan_a_gpu_profile_from_a_machine_without_one(tmp_path: Path, capsys) -> None:
    """The 24 GB profile says device: cuda; planning it on a laptop must work (its GPU
    budget is in the file), and without a GPU budget the error says what to pass."""
    folder = tmp_path / "Llama-3.1-70B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MODELS["Llama-3.1-70B"][0]))
    profile = Path(__file__).resolve().parents[1] / "config" / "profiles" / "gpu-24gb.yaml"
    argv = ["plan", "--config", str(profile), "--model", str(folder), "--draft", "ngram"]
    assert cli.main([*argv, "--ram-budget", "64GB", "--bandwidth", "25GB/s", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["streamed_layers"] > 0 and out["budget"]["device"] == "cuda"
    bare = ["plan", "--model", str(folder), "--device", "cuda", "--dtype", "bf16"]
    assert cli.main(bare) == 2
    assert "--gpu-budget" in capsys.readouterr().err


def test_the_plan_warns_when_every_conversation_at_full_length_would_not_fit() -> None:
    """Caches grow with use: the plan holds one full-context sequence and warns (does not
    refuse) when a daemon's active and kept conversations at full length would overflow."""
    target = footprint(config_from_hf(MODELS["Llama-3.1-8B"][0]), torch.bfloat16, "8B")
    budget = MemoryBudget("cuda", 24 * 2**30, "test", 64 * 2**30, "test", 25e9, "test")

    def plan_for(sequences: int):
        request = PlanRequest(target, None, 32768, 2048, sequences=sequences)
        return make_plan(request, budget)

    assert not any("conversations" in n for n in plan_for(1).notes)
    notes = [n for n in plan_for(12).notes if "conversations" in n]
    assert len(notes) == 1 and "12 conversations" in notes[0] and "about" in notes[0]


def test_the_plan_reserves_the_largest_pass_and_its_logit_rows() -> None:
    """A prefill chunk returns one logit row, a tree pass one per node: the plan holds the
    largest pass with the most rows (auto budgeting grows trees up to AUTO_MAX_BUDGET)."""
    target = fp("Llama-3.1-8B")
    auto = plan_request(target, None, 8192, OffloadOptions())
    assert (auto.pass_tokens, auto.logit_rows) == (PREFILL_CHUNK, AUTO_MAX_BUDGET + 1)
    big = plan_request(target, None, 8192, OffloadOptions(), tree_budget=4095)
    assert (big.pass_tokens, big.logit_rows) == (4096, 4096)
    short = plan_request(target, None, 100, OffloadOptions(), tree_budget=4095)
    assert (short.pass_tokens, short.logit_rows) == (100, 100)
    p = make_plan(auto, budget(24e9, 64e9))
    part = f"activations ({PREFILL_CHUNK}-token pass, {AUTO_MAX_BUDGET + 1} logit rows)"
    assert p.device_parts[part] == target.activation_bytes(PREFILL_CHUNK, 257, 8192)
    assert p.to_dict()["logit_rows"] == 257 and "257 logit rows" in p.render()
    # Logit rows cost a vocabulary each (model dtype, then fp32): a 1,025-node tree's
    # 1,025 rows outweigh a 2,048-token prefill chunk's single row.
    assert target.activation_bytes(1025, 1025, 8192) > target.activation_bytes(2048, 1, 8192)


def test_attention_scores_are_bounded_at_long_context() -> None:
    """Scores are held one query chunk at a time: a 70B's 2,048-token pass at 128k context
    holds one chunk of scores and the (T, S) boolean mask, not (heads, T, S) fp32 scores."""
    f = fp("Llama-3.1-70B")
    # At most one chunk of scores, beside the query copies and outputs of that chunk's
    # rows (the most rows a chunk has over at least 2,048 keys: a 2,048-token pass's own).
    a = f.activations
    chunk = ATTENTION_CHUNK_BYTES + a.query_chunk(2048) * a.score_bytes_per_query
    assert ATTENTION_CHUNK_BYTES < a.attention_bytes(2048, 131072) <= chunk
    short, long = f.activation_bytes(2048, 1, 8192), f.activation_bytes(2048, 1, 131072)
    assert long - short <= 2048 * (131072 - 8192) + ATTENTION_CHUNK_BYTES  # the mask grows
    all_scores = 64 * 2048 * 131072 * 4  # what one unchunked pass would hold: 64 GiB
    assert long < all_scores / 50


def test_cuda_graphs_are_planned() -> None:
    """`--compile on` on a GPU captures steps of up to 64 tokens as CUDA graphs, which hold
    memory for good: per model, the pool's step working sets (scores within 64 MiB), each
    graph's output and mask, the warm-up's scratch cache and cuBLAS's workspaces. Nothing
    without graphs or on a CPU."""
    target, draft = fp("Llama-3.1-8B"), fp("Llama-3.2-1B")
    request = plan_request(target, draft, 8192, OffloadOptions(cuda_graphs=True))
    assert request.graphs == GRAPHS
    assert (GRAPHS.tokens, GRAPHS.chunk_bytes, GRAPHS.count) == (64, 64 * 2**20, 64)
    parts = make_plan(request, budget(24e9, 64e9)).device_parts
    held = parts["CUDA graphs (steps of up to 64 tokens)"]
    expected = 0
    for m in (target, draft):
        a = m.activations
        step = replace(a, chunk_bytes=64 * 2**20).pass_bytes(64, 0, 8192)
        # A 32-head model's mask rows x slots under the score bound: 64 MiB / 257 bytes.
        per_graph = 64 * a.hidden_bytes_per_token + min((64 * 2**20) // 257, 64 * 8192)
        expected += 3 * step + m.kv_bytes(512) + 64 * per_graph + GRAPHS.workspace_bytes
    assert held == expected
    # Bounded: under the largest pass's working set (a prefill chunk's) plus 100 MiB, per
    # model, thrice (a 64-token step over 8k slots would have held 134 MB of scores alone).
    largest = parts[next(k for k in parts if k.startswith("activations"))]
    assert held < 3 * 2 * (largest + 100 * 2**20)
    plain = make_plan(plan_request(target, draft, 8192, OffloadOptions()), budget(24e9, 64e9))
    on_cpu = make_plan(request, replace(budget(24e9, 64e9), device="cpu"))
    for other in (plain, on_cpu):
        assert not any(k.startswith("CUDA graph") for k in other.device_parts)


def test_cuda_graphs_of_the_hqq_substitute_hold_a_rebuilt_projection() -> None:
    """A compiled substitute step rebuilds its HQQ projections inside the graph (issue 36),
    so its pool holds the largest rebuilt weight as part of the step's working set: an
    8B's 4-bit substitute, its (2 x 14,336, 4,096) gate/up in bf16 and the codes, ~0.3 GB
    a working set. A dense draft holds none."""
    from modeling.substitute import substitute_config

    target = config_from_hf(MODELS["Llama-3.1-8B"][0])
    sub = footprint(substitute_config(target, 4), torch.bfloat16, "substitute")
    dense = footprint(target, torch.bfloat16, "target")
    assert dense.traced_dequant_bytes == 0
    assert sub.traced_dequant_bytes == sub.dequant_bytes > 14336 * 4096 * 2
    with_rebuild = graph_bytes(sub, GRAPHS, 8192)
    without = graph_bytes(replace(sub, traced_dequant_bytes=0), GRAPHS, 8192)
    assert with_rebuild - without == 3 * sub.traced_dequant_bytes


def test_specd_plan_shows_the_cuda_graphs_with_compile_on(shared_models: Path, capsys) -> None:
    target, draft = shared_models / "stories260k", shared_models / "stories260k-draft"
    argv = ["plan", "--model", str(target), "--draft", str(draft), "--device", "cuda",
            "--gpu-budget", "8GB", "--ram-budget", "16GB", "--bandwidth", "25GB/s"]  # fmt: skip
    assert cli.main([*argv, "--compile", "on"]) == 0
    assert "CUDA graphs (steps of up to 64 tokens)" in capsys.readouterr().out
    assert cli.main([*argv, "--compile", "auto"]) == 0  # auto does not capture on CUDA yet
    assert "CUDA graphs" not in capsys.readouterr().out


@pytest.mark.parametrize("slots", ["1", "17"])
def test_slots_have_the_same_bounds_in_the_plan_and_the_configuration(
    slots: str, stories_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`specd plan --slots 17` planned 17 slots (100,000 too) where the daemon's
    configuration refused it: both now take 2 to 16."""
    from daemon.cli import main

    assert main(["plan", "--model", str(stories_target), "--slots", slots]) == 2
    assert f"--slots (offload.slots) must be from 2 to 16 (got {slots})" in capsys.readouterr().err
    assert main(["config", "show", "--slots", slots]) == 2
    assert "expected an integer from 2 to 16" in capsys.readouterr().err


def test_a_model_path_with_control_characters_is_shown_escaped(
    stories_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder's name is anyone's: an escape sequence in it reached the terminal."""
    import shutil

    from daemon.cli import main

    folder = tmp_path / "odd\x1b[31mname"
    shutil.copytree(stories_target, folder)
    assert main(["plan", "--model", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "odd\\x1b[31mname" in out


def test_plan_reads_the_settings_a_daemon_starts_with(
    stories_target: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`specd plan` without --config reads what `specd start` reads: the user config file
    and SPECD_* variables under its flags (it read only --config's file, and showed
    another plan than the daemon ran); the config's target stands for --model."""
    config = tmp_path / "config" / "specd"
    config.mkdir(parents=True)
    (config / "specd.yaml").write_text(
        f"models: {{target: {json.dumps(str(stories_target))}, device: cpu}}\n"
        "context: {length: 256}\n"
    )
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert cli.main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 256
    monkeypatch.setenv("SPECD_CONTEXT_LENGTH", "128")
    assert cli.main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 128
    assert cli.main(["plan", "--json", "--context", "64"]) == 0  # a flag over both
    assert json.loads(capsys.readouterr().out)["context"] == 64
    (config / "specd.yaml").write_text("context: {length: 256}\n")
    assert cli.main(["plan"]) == 2
    assert "specd plan needs --model MODEL" in capsys.readouterr().err
