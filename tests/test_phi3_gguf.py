"""Phi-3 and Phi-4 from GGUF (`general.architecture` phi3): tiny random checkpoints written as
llama.cpp's Phi3MiniModel writes them (tests/gguf_writers.py: fused `attn_qkv` and
`ffn_up`, the rotary width, LongRoPE's factor tensors, the window). A plain one gives
transformers' GGUF loader's greedy ids; Phi-4-mini's partial rotary with Phi-3-mini's window
and LongRoPE, which transformers' GGUF loader does not read, gives the ids of its own
safetensors source past the window and the original context; speculation over the file is
its greedy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from modeling.checkpoints.checkpoint import load
from modeling.weights.gguf_modules import GGUFLinear
from tests.gguf_writers import SPM_VOCABULARY, write_phi3
from tests.greedy_checks import RUN_IDS, RUNS, speculation_runtime
from tests.test_gemma3_gguf import greedy, transformers_greedy
from tests.test_phi3 import LONGROPE


def prompts() -> list[list[int]]:
    make = torch.Generator().manual_seed(3)
    return [torch.randint(3, SPM_VOCABULARY, (n,), generator=make).tolist() for n in (5, 12)]


@pytest.fixture(scope="module")
def plain_gguf(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint("phi3", vocab_size=SPM_VOCABULARY)
    return write_phi3(folder, tmp_path_factory.mktemp("phi3-gguf") / "phi3-tiny.gguf")


def test_a_written_file_is_transformers_greedy(plain_gguf: Path) -> None:
    model, _, ckpt = load(plain_gguf, "fp32")
    cfg = ckpt.config
    assert (cfg.model_type, cfg.sliding_window, cfg.stored_fused) == ("phi3", None, True)
    fused = model.layers[0].self_attn.qkv_proj
    assert isinstance(fused, GGUFLinear)  # kept as its Q8_0 blocks, not split
    want = transformers_greedy(plain_gguf.parent, plain_gguf.name, prompts(), 24)
    assert [greedy(model, p, 24) for p in prompts()] == want


def test_partial_rotary_window_and_longrope_are_the_sources(
    tiny_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Window 7, original context 8, 30 new tokens: both LongRoPE tables and the window."""
    folder = tiny_checkpoint("phi3-partial", vocab_size=SPM_VOCABULARY, **LONGROPE)
    path = write_phi3(folder, tmp_path / "phi3-long.gguf", quantize=False)
    source, _, source_ckpt = load(folder, "fp32")
    model, _, ckpt = load(path, "fp32")
    ours, theirs = ckpt.config, source_ckpt.config
    for key in ("sliding_window", "max_position_embeddings", "head_dim"):
        assert getattr(ours, key) == getattr(theirs, key), key
    # the file holds the factors as float32
    factors = {"long_factor": (), "short_factor": ()}
    assert replace(ours.rope, **factors) == replace(theirs.rope, **factors)
    assert ours.rope.long_factor == pytest.approx(theirs.rope.long_factor, rel=1e-7)
    assert ours.rope.short_factor == pytest.approx(theirs.rope.short_factor, rel=1e-7)
    for prompt in prompts():
        assert greedy(model, prompt, 30) == greedy(source, prompt, 30)


@pytest.mark.parametrize(("draft", "strategy", "extra"), RUNS, ids=RUN_IDS)
def test_speculation_over_a_phi3_file_is_its_greedy(
    plain_gguf: Path, draft: str | None, strategy: str, extra: dict
) -> None:
    speculation_runtime(plain_gguf, draft, strategy, extra, seed=6)
