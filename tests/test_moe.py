"""Mixture-of-experts models (issue 37, first step): Qwen3-MoE and Mixtral from safetensors,
resident. Checkpoints are written by transformers itself (its per-expert tensor names),
and the reference is transformers: logits (prefill, cached decode steps, a tree pass) to
fp32 rounding, routing exactly, greedy speculation equal to plain decoding, and exact
parameter counts at the published models' shapes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from greedy_checks import RUN_IDS, RUNS, speculation_runtime
from test_model_parity import _check_parity

from modeling.checkpoints.checkpoint import load
from modeling.config import MoEConfig
from modeling.layers.moe import MoEDecoderLayer, SparseMoE
from modeling.models import config_from_hf, parameter_count

FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tiny_checkpoint, family: str, tie: bool) -> None:
    path = tiny_checkpoint(family, tie_word_embeddings=tie, vocab_size=96)
    model = load(path)[0]
    assert all(isinstance(layer, MoEDecoderLayer) for layer in model.layers)
    _check_parity(path, f"moe-{family}-{tie}")


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_is_the_references(tiny_checkpoint, family: str) -> None:
    """The experts each token is sent to and their weights equal transformers' router's,
    for a batch with every expert chosen somewhere, and one expert's token subset adds up
    to the block's output as the reference adds it."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(family, vocab_size=96)
    ours = load(path)[0]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.randn(37, ours.config.hidden_size, generator=torch.Generator().manual_seed(5))
    block = ours.layers[0].mlp
    assert isinstance(block, SparseMoE)
    chosen, weights = block.route(x)
    ref_block = ref.model.layers[0].mlp
    router = getattr(ref_block, "gate", None) or ref_block.router
    with torch.no_grad():
        _, ref_weights, ref_chosen = router(x)
        ref_out = ref_block(x[None])[0]
    assert torch.equal(chosen, ref_chosen)
    torch.testing.assert_close(weights, ref_weights.float(), atol=0, rtol=0)
    assert set(chosen.unique().tolist()) == set(range(ours.config.moe.experts))
    with torch.no_grad():
        torch.testing.assert_close(block(x), ref_out, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("draft", "strategy", "extra"), RUNS[:2], ids=RUN_IDS[:2])
def test_speculation_is_the_targets_greedy_output(
    tiny_checkpoint, family: str, draft: str | None, strategy: str, extra: dict
) -> None:
    """A streamed expert model, and an n-gram tree over it, give plain greedy decoding's
    tokens (the tree's rows route each to its own experts in one pass)."""
    path = tiny_checkpoint(family, vocab_size=96)
    speculation_runtime(path, draft, strategy, extra, seed=7)


def test_a_linear_chain_and_a_tree_of_the_target_itself(tiny_checkpoint) -> None:
    """The target as its own draft: a chain and a tree accept everything and still give
    plain decoding's tokens."""
    path = tiny_checkpoint("qwen3_moe", vocab_size=96)
    for strategy in ("linear", "tree"):
        speculation_runtime(path, str(path), strategy, {}, seed=9)


REAL_SHAPES = {
    # Qwen3-30B-A3B's config.json (published), its parameter count: 30.5B
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    # Mixtral-8x7B-v0.1's config.json (published): 46.7B
    "mixtral-8x7b": {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
        "sliding_window": None, "tie_word_embeddings": False,
    },
}  # fmt: skip


@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_parameter_counts_equal_transformers_at_real_shapes(shape: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(REAL_SHAPES[shape])
    ours = parameter_count(config_from_hf(raw))
    model_type = raw.pop("model_type")
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **raw))
    assert ours == sum(p.numel() for p in ref.parameters())


def test_configs_it_cannot_run_are_refused_by_name() -> None:
    base = dict(REAL_SHAPES["qwen3-30b-a3b"])
    for key, value, words in (
        ("mlp_only_layers", [3], "mlp_only_layers"),
        ("decoder_sparse_step", 2, "decoder_sparse_step"),
        ("num_experts_per_tok", 200, "num_experts_per_tok"),
        ("num_experts", 0, "num_experts"),
        ("use_sliding_window", True, "use_sliding_window"),
    ):
        with pytest.raises(ValueError, match=words):
            config_from_hf({**base, key: value})


def test_a_config_says_it_is_a_mixture() -> None:
    cfg = config_from_hf(REAL_SHAPES["qwen3-30b-a3b"])
    assert cfg.moe == MoEConfig(experts=128, top_k=8, intermediate_size=768, normalize=True)
    assert replace(cfg, moe=None).moe is None
