"""scripts/bench_realtext.py's timed mode (`--timed`, what scripts/gpu_checks.sh runs on a
GPU): its figures on a CPU run of the stories model, and the projection's arithmetic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from daemon.runtime import Runtime, linear_drafter
from scripts.bench_realtext import draft_options, run, timed_figures, timed_table
from speculative.sampling import SamplingParams
from speculative.strategies.linear import Linear


def _run(tokens: int, seconds: float, passes: int, draft_passes: int) -> dict[str, float]:
    return {
        "timed_tokens": tokens, "timed_seconds": seconds, "timed_passes": passes,
        "timed_draft_passes": draft_passes,
    }  # fmt: skip


def test_projection_uses_the_runs_own_pass_and_step_times() -> None:
    plain = _run(100, 2.0, 100, 0)  # 20 ms a pass
    # a chain: 10 passes (0.2 s) and 40 draft passes in 0.6 s: 10 ms a draft pass
    chain = _run(50, 0.6, 10, 40)
    slow_chain = _run(10, 1.0, 10, 40)
    tree = _run(80, 0.5, 10, 20)  # 8 tokens a pass, 2 draft passes a pass
    got = timed_figures(tree, {"K=4": chain, "K=16": slow_chain}, plain)
    assert got["plain_tok_s"] == pytest.approx(50.0)
    assert got["tree_tok_s"] == pytest.approx(160.0)
    assert got["best_chain_tok_s"] == pytest.approx(50 / 0.6)
    assert got["pass_ms"] == pytest.approx(20.0)
    assert got["draft_step_ms"] == pytest.approx(10.0)
    assert got["projected_tree_tok_s"] == pytest.approx(8 / (0.020 + 2 * 0.010))


def test_timed_runs_on_the_stories_model(stories_target: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    rt = Runtime(draft_options("ngram", str(stories_target), tmp_path, 512))
    ids = [rt.tokenizer.encode("Once upon a time there was a little girl named Lily.")]
    greedy = SamplingParams(temperature=0.0)
    tree = run(rt, lambda: rt.strategy("tree", budget=8), ids, greedy, 24, 1)
    chain = run(rt, lambda: Linear(rt.target, linear_drafter(rt), 4), ids, greedy, 24, 1)
    plain = run(rt, lambda: rt.strategy("autoregressive"), ids, greedy, 24, 1)
    for got in (tree, chain, plain):
        assert got["tokens"] == 24  # lossless: every strategy makes the same 24 tokens
        assert 0 < got["timed_tokens"] <= got["tokens"]  # (the prefill's rounds not timed)
        assert 0 < got["timed_seconds"] <= got["seconds"]
    assert plain["timed_passes"] == plain["timed_tokens"]  # one token a plain pass
    figures = timed_figures(tree, {"K=4": chain}, plain)
    assert all(math.isfinite(v) and v >= 0 for v in figures.values())
    assert figures["plain_tok_s"] > 0 and figures["projected_tree_tok_s"] > 0
    row = {"model": "stories", "draft": "ngram", "temperature": 0.0, "cell": "x",
           "timed": figures}  # fmt: skip
    table = timed_table([row, {"draft": "ngram", "temperature": 0.0, "cell": "y"}])
    assert len(table) == 3 and table[2].startswith("| stories | ngram | 0 | x |")
