"""Phi-3 / Phi-4 as one architecture module (modeling/models/phi3.py): q/k/v and gate/up
kept as the checkpoint stores them (one tensor each), partial rotary RoPE, the window by
position; exact parameter counts at Phi-4's and Phi-4-mini's shapes, LongRoPE refused by
name, and speculation (streamed, n-gram tree, substitute) giving the target's greedy
output. Logit parity with transformers is tests/test_model_parity.py's ("phi3",
"phi3-partial")."""

from __future__ import annotations

import pytest
import torch

from daemon.options import RuntimeOptions
from daemon.runtime import Runtime
from modeling.checkpoints.checkpoint import load
from modeling.config import UnsupportedModelError
from modeling.models import config_from_hf, parameter_count
from modeling.weights.hqq import HQQLinear
from tests.greedy_checks import RUN_IDS, RUNS, speculation_runtime

PHI4 = {
    "model_type": "phi3", "vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 17920,
    "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
    "max_position_embeddings": 16384, "rope_theta": 250000, "rms_norm_eps": 1e-5,
    "sliding_window": None, "tie_word_embeddings": False,
}  # fmt: skip
PHI4_MINI = {
    "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}  # fmt: skip


@pytest.mark.parametrize("shape", [PHI4, PHI4_MINI], ids=["phi-4", "phi-4-mini"])
def test_parameter_counts_are_transformers_at_real_shapes(shape: dict) -> None:
    from transformers import AutoModelForCausalLM, Phi3Config

    theirs = Phi3Config(**{k: v for k, v in shape.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(theirs)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert parameter_count(config_from_hf(shape)) == sum(unique.values())


def test_longrope_factors_are_checked() -> None:
    scaling = {"type": "longrope", "short_factor": [1.0] * 47, "long_factor": [2.0] * 48}
    with pytest.raises(UnsupportedModelError, match="short_factor has 47 factors"):
        config_from_hf({**PHI4_MINI, "rope_scaling": scaling})
    llama = {**PHI4_MINI, "model_type": "llama", "partial_rotary_factor": 1.0}
    llama["original_max_position_embeddings"] = 4096
    with pytest.raises(UnsupportedModelError, match="for Phi-3 models only"):
        config_from_hf({**llama, "rope_scaling": {**scaling, "short_factor": [1.0] * 64}})


LONGROPE = {
    "original_max_position_embeddings": 8,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5],
        "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 13.0],
    },
}


def test_longrope_matches_transformers_token_by_token(tiny_checkpoint) -> None:
    """Short factors below the original context (8), long ones from it on, chosen per
    position: our one-pass prefill of 20 tokens and our decode steps equal transformers fed
    the same tokens one at a time (where its choice by the pass's length is each
    position's own)."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("phi3-partial", vocab_size=96, **LONGROPE)
    ours, _, ckpt = load(path)
    assert ckpt.config.rope.kind == "longrope" and ckpt.config.rope.factor == 256 / 8
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(8))
    cache = ours.new_cache(64)
    got = [ours(tokens[:20], torch.arange(20), cache)]  # (20, V)
    got += [ours(tokens[i : i + 1], torch.tensor([i]), cache) for i in range(20, 24)]
    mine = torch.cat(got)  # (24, V)
    past, want = None, []
    with torch.no_grad():
        for i in range(24):
            out = ref(input_ids=tokens[None, i : i + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            want.append(out.logits[0])
    torch.testing.assert_close(mine, torch.cat(want).float(), atol=1e-4, rtol=0)


def test_speculation_across_the_original_context_is_greedy(tiny_checkpoint) -> None:
    """A prompt of 8 (the original context) and 40 new tokens: every tree round from the
    boundary on mixes both tables in one pass."""
    path = tiny_checkpoint("phi3-partial", vocab_size=96, **LONGROPE)
    speculation_runtime(path, "ngram", "tree", {}, seed=9)
    speculation_runtime(path, "substitute", "tree", {**RUNS[2][2]}, seed=9)


def test_fused_projections_load_as_stored(tiny_checkpoint) -> None:
    model, _, ckpt = load(tiny_checkpoint("phi3-partial", vocab_size=96))
    assert ckpt.config.rope.partial_rotary_factor == 0.75 and ckpt.config.sliding_window == 7
    attention = model.layers[0].self_attn  # type: ignore[index]
    assert type(attention.qkv_proj) is torch.nn.Linear  # one stored tensor, not stacked parts
    assert attention.qkv_proj.weight.shape == (64 + 2 * 32, 64)
    assert model.inv_freq.shape == (6,)  # 12 of the head's 16 dimensions turn


@pytest.mark.parametrize(("draft", "strategy", "extra"), RUNS, ids=RUN_IDS)
def test_speculation_is_the_targets_greedy(
    tiny_checkpoint, draft: str | None, strategy: str, extra: dict
) -> None:
    path = tiny_checkpoint("phi3-partial", vocab_size=96)
    rt = speculation_runtime(path, draft, strategy, extra, seed=5)
    if draft == "substitute":  # the stored qkv_proj quantized whole
        layer = rt.draft.layers[0]  # type: ignore[union-attr, index]
        assert isinstance(layer.self_attn.qkv_proj, HQQLinear)


def test_the_disk_tier_reads_the_stored_fused_tensors(tiny_checkpoint) -> None:
    """The disk tier finds each streamed tensor by the architecture's names: Phi-3's
    qkv_proj and gate_up_proj are read whole from the file, not as parts it lacks."""
    base = {"model": str(tiny_checkpoint("phi3-partial", vocab_size=96)), "device": "cpu"}
    disk = Runtime(
        RuntimeOptions(
            **base, context=64, offload="stream", resident_layers=0, host_tier="disk", slots=2
        )
    )
    assert disk.streamer is not None and disk.streamer.storage.tier == "disk"
    plain = Runtime(RuntimeOptions(**base, context=64, offload="none"))
    tokens, positions = torch.tensor([5, 17, 40, 61, 9]), torch.arange(5)
    a = disk.target(tokens, positions, disk.target.new_cache(8))
    b = plain.target(tokens, positions, plain.target.new_cache(8))
    assert torch.equal(a, b)
