"""The prefix cache's size from configuration (`speculation.prefix_cache`, also spelled
`speculative.prefix_cache`), environment and flags; its place in the memory plan; one cache
per runtime; and its hit/miss counts in --json stats, the API's `specd` block, /metrics and
`specd bench`."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from daemon.cli import main
from daemon.cli.bench import prefix_cache_hit_rate
from daemon.footprint import footprint
from daemon.http.server import BackgroundServer
from daemon.memory_plan import OffloadOptions, plan_request
from daemon.metrics import Metrics
from daemon.settings import SettingsError
from daemon.settings_loading import load_settings
from modeling.models import config_from_hf
from offload.plan import MemoryBudget
from offload.planning import PlanError, make_plan
from speculative.prefix_cache import DEFAULT_MAX_BYTES
from speculative.rounds import GenerationStats, RoundStats


def _settings(tmp_path: Path, text: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    path = tmp_path / "specd.yaml"
    path.write_text("models:\n  target: m\n" + text)
    return load_settings(path, environ=env or {})


def test_default_size_and_both_section_spellings(tmp_path: Path) -> None:
    assert _settings(tmp_path, "").runtime_options().prefix_cache == DEFAULT_MAX_BYTES == 1 << 30
    s = _settings(tmp_path, "speculation:\n  prefix_cache: 512MB\n")
    assert s.runtime_options().prefix_cache == 512_000_000
    s = _settings(tmp_path, "speculative:\n  prefix_cache: 2GiB\n  budget: 64\n")
    assert s.runtime_options().prefix_cache == 2 << 30 and s.speculation.budget == 64
    assert (
        _settings(tmp_path, "speculative:\n  prefix_cache: 0\n").runtime_options().prefix_cache == 0
    )


def test_bad_values_and_double_sections_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(
        SettingsError, match=r"speculation\.prefix_cache: 'lots' is not allowed.*0 \(off\)"
    ):
        _settings(tmp_path, "speculative:\n  prefix_cache: lots\n")
    with pytest.raises(SettingsError, match=r"speculation\.prefix_cache: -5 is not allowed"):
        _settings(tmp_path, "speculation:\n  prefix_cache: -5\n")
    with pytest.raises(
        SettingsError, match="speculative: the section 'speculation' spelled another way"
    ):
        _settings(tmp_path, "speculation:\n  budget: 8\nspeculative:\n  prefix_cache: 1GB\n")
    with pytest.raises(SettingsError, match=r"speculative\.prefix_cash: unknown key"):
        _settings(tmp_path, "speculative:\n  prefix_cash: 1GB\n")


def test_environment_in_either_spelling(tmp_path: Path) -> None:
    s = _settings(tmp_path, "", {"SPECD_SPECULATION_PREFIX_CACHE": "256MiB"})
    assert s.runtime_options().prefix_cache == 256 << 20
    assert s.sources["speculation.prefix_cache"] == "env SPECD_SPECULATION_PREFIX_CACHE"
    s = _settings(tmp_path, "", {"SPECD_SPECULATIVE_PREFIX_CACHE": "0"})
    assert s.runtime_options().prefix_cache == 0
    both = {"SPECD_SPECULATION_PREFIX_CACHE": "1GB", "SPECD_SPECULATIVE_PREFIX_CACHE": "2GB"}
    with pytest.raises(SettingsError, match="SPECD_SPECULATIVE_PREFIX_CACHE"):
        _settings(tmp_path, "", both)


def test_flag_overrides_the_config_for_serve(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "specd.yaml"
    path.write_text("speculative:\n  prefix_cache: 2GB\n")
    assert main(["config", "show", "--config", str(path), "--prefix-cache", "300MB"]) == 0
    out = capsys.readouterr().out
    assert "prefix_cache: 300MB  # --prefix-cache" in out


@pytest.mark.parametrize("command", ["generate", "serve", "plan"])
def test_a_bad_flag_value_names_the_flag(command: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_:
        main([command, "--model", "m", "--prefix-cache", "lots"])
    assert exit_.value.code == 2
    assert "--prefix-cache" in capsys.readouterr().err


def test_generate_samples_reuse_the_cache_and_report_hits(  # type: ignore[no-untyped-def]
    stories_target: Path, stories_draft: Path, capsys
) -> None:
    argv = ["generate", "--model", str(stories_target), "--draft", str(stories_draft)]
    argv += ["--prompt", "Once upon a time", "--max-tokens", "24", "--ignore-eos"]
    argv += ["--temperature", "1", "--seed", "3", "--samples", "2", "--budget", "8"]
    records = {}
    for size in ("64MiB", "0"):
        assert main([*argv, "--prefix-cache", size]) == 0
        records[size] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    on, off = records["64MiB"], records["0"]
    assert [r["token_ids"] for r in on] == [r["token_ids"] for r in off]  # lossless
    assert on[0]["stats"]["prefix_cache_misses"] > 0
    assert on[1]["stats"]["prefix_cache_hits"] > 0  # sample 2 starts from cached rows
    for r in off:
        assert r["stats"]["prefix_cache_hits"] == r["stats"]["prefix_cache_misses"] == 0


LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
}


def _plan(device: str, cache: int, ram: float = 64e9):  # type: ignore[no-untyped-def]
    budget = MemoryBudget(
        device, int(24e9), "configured", int(ram), "configured", 25e9, "configured"
    )
    target = footprint(config_from_hf(LLAMA_8B), torch.bfloat16, "8B")
    request = plan_request(target, None, 8192, OffloadOptions(prefix_cache_bytes=cache), 64)
    return make_plan(request, budget)


def test_the_plan_counts_the_cache_where_it_lives() -> None:
    # On a GPU the rows sit in pinned host RAM: not a device part, but host bytes.
    gpu, gpu_off = _plan("cuda", 1 << 30), _plan("cuda", 0)
    assert gpu.device_parts == gpu_off.device_parts
    assert gpu.host_bytes == gpu_off.host_bytes + (1 << 30)
    assert "prefix cache: 1 GiB of pinned RAM" in gpu.render()
    assert gpu.to_dict()["prefix_cache_bytes"] == 1 << 30
    with pytest.raises(PlanError, match="--prefix-cache"):
        _plan("cuda", 8 << 30, ram=4e9)
    # On a CPU the device is RAM: a device part.
    cpu, cpu_off = _plan("cpu", 1 << 30), _plan("cpu", 0)
    assert cpu.device_parts["prefix cache"] == 1 << 30
    assert cpu.device_bytes == cpu_off.device_bytes + (1 << 30)


def test_metrics_count_hits_and_misses() -> None:
    stats = GenerationStats()
    stats.add(RoundStats(prefix_cache_hits=5, prefix_cache_misses=1))
    stats.add(RoundStats(prefix_cache_hits=2))
    assert stats.to_dict()["prefix_cache_hits"] == 7
    assert prefix_cache_hit_rate(stats.to_dict()) == pytest.approx(7 / 8)
    assert prefix_cache_hit_rate(GenerationStats().to_dict()) is None
    metrics = Metrics()
    metrics.record_generation(stats, 10)
    text = metrics.render()
    assert "specd_prefix_cache_hits_total 7" in text
    assert "specd_prefix_cache_misses_total 1" in text


def test_api_stats_and_metrics_through_one_shared_cache(
    stories_target: Path, stories_draft: Path
) -> None:
    settings = load_settings(
        environ={},
        overrides={
            "models.target": (str(stories_target), "test"),
            "runtime.compile": ("off", "test"),
            "models.draft": (str(stories_draft), "test"),
            "speculation.strategy": ("tree", "test"),
            "speculation.prefix_cache": ("32MiB", "test"),
            "server.port": (0, "test"),
        },
    )
    with BackgroundServer(settings) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        replies = []
        for budget in (8, 16):  # two tree strategies in the engine, one cache between them
            reply = client.completions.create(
                model="stories260k",
                prompt="Once upon a time",
                max_tokens=16,
                temperature=1.0,
                seed=4,
                extra_body={"budget": budget, "ignore_eos": True},
            )
            replies.append(reply)
        first, second = (r.model_extra["specd"] for r in replies)  # type: ignore[index]
        assert first["prefix_cache_misses"] > 0
        assert second["prefix_cache_hits"] > 0
        assert replies[0].choices[0].text == replies[1].choices[0].text
        with urllib.request.urlopen(srv.url + "/metrics") as resp:
            text = resp.read().decode()
    hits = next(
        line for line in text.splitlines() if line.startswith("specd_prefix_cache_hits_total")
    )
    assert float(hits.split()[-1]) == second["prefix_cache_hits"] + first["prefix_cache_hits"]


def test_bench_prints_the_hit_rate(stories_target: Path, stories_draft: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["bench", "--model", str(stories_target), "--draft", str(stories_draft)]
    argv += ["--max-tokens", "16", "--strategies", "autoregressive", "tree", "--budget", "8"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("workload: ") and "prefix hits" in lines[1]
    autoregressive = next(line for line in lines if line.startswith("autoregressive"))
    tree = next(line for line in lines if line.startswith("tree"))
    assert autoregressive.split()[-2] == "-"  # no prefix cache consulted
    assert tree.split()[-2].endswith("%")


def test_without_a_draft_the_plan_holds_no_prefix_cache_and_no_tree(
    stories_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only autoregressive decoding runs without a draft: no prefix cache to reserve, and
    the largest pass is a prefill chunk with one logit row a sequence (the daemon's
    `limits.max_concurrent` + `limits.cached_sessions`). `--draft ngram` grows trees."""
    from daemon.settings import LimitsSettings

    argv = ["plan", "--model", str(stories_target), "--device", "cpu", "--json", "--draft", "none"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    limits = LimitsSettings()
    sequences = limits.max_concurrent + limits.cached_sessions
    assert "prefix cache" not in plain["device_parts"] and plain["logit_rows"] == sequences
    assert main([*argv[:-1], "ngram"]) == 0
    ngram = json.loads(capsys.readouterr().out)
    assert ngram["device_parts"]["prefix cache"] == DEFAULT_MAX_BYTES
    assert ngram["logit_rows"] > 1
