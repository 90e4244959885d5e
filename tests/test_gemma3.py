"""Gemma 3 as one architecture module (modeling/models/gemma3.py): its config read as
transformers reads it (the published configs leave most keys to the defaults), the text
part of a multimodal checkpoint, exact parameter counts at real shapes, the memory plan,
and speculation over it (local window layers, two RoPE tables, a substitute built from its
own blocks) giving the target's greedy output. Logit parity with transformers is
tests/test_model_parity.py's (the "gemma3" family)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from daemon.footprint import footprint
from modeling.checkpoints.checkpoint import load
from modeling.config import UnsupportedModelError
from modeling.models import config_from_hf, parameter_count
from tests.greedy_checks import RUN_IDS, RUNS, speculation_runtime

# google/gemma-3-4b-it's text_config as published (the rest are Gemma3TextConfig defaults)
GEMMA3_4B_TEXT = {
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "model_type": "gemma3_text",
    "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}
GEMMA3_270M = {
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256, "sliding_window": 512, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
}  # fmt: skip


def test_a_published_config_reads_as_transformers_reads_it() -> None:
    from transformers import Gemma3TextConfig

    raw = {"model_type": "gemma3", "text_config": GEMMA3_4B_TEXT, "eos_token_id": [1, 106]}
    ours = config_from_hf(raw)
    theirs = Gemma3TextConfig(**{k: v for k, v in GEMMA3_4B_TEXT.items() if k != "model_type"})
    assert ours.layer_types == tuple(theirs.layer_types)
    assert ours.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert (ours.vocab_size, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.vocab_size, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim,
    )  # fmt: skip
    assert ours.rope.kind == "linear" and ours.rope.factor == 8.0
    assert ours.rope.theta == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert ours.local_rope is not None
    assert ours.local_rope.theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.local_rope.kind == "default"
    assert ours.attention_scale == theirs.query_pre_attn_scalar**-0.5
    assert ours.eos_token_ids == (1, 106)  # the multimodal config's top level
    assert ours.tie_word_embeddings and ours.sliding_window == 1024


@pytest.mark.parametrize("shape", [GEMMA3_270M, {**GEMMA3_4B_TEXT, "vocab_size": 262208}])
def test_parameter_counts_are_transformers_at_real_shapes(shape: dict) -> None:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    theirs = Gemma3TextConfig(**{k: v for k, v in shape.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(theirs)
    unique = {id(p): p.numel() for p in model.parameters()}
    config = config_from_hf(shape)
    assert parameter_count(config) == sum(unique.values())
    # The plan measures it too, with its two RoPE tables.
    size = footprint(config, torch.bfloat16, "gemma")
    assert size.num_layers == shape["num_hidden_layers"]
    assert size.activations.persistent_bytes_per_token == 2 * 2 * 256 * 2


def test_refused_options_name_their_key() -> None:
    for key, value in [
        ("hidden_activation", "silu"),
        ("final_logit_softcapping", 30.0),
        ("use_bidirectional_attention", True),
    ]:
        with pytest.raises(UnsupportedModelError, match=key):
            config_from_hf({**GEMMA3_270M, key: value})


def test_the_text_part_of_a_multimodal_checkpoint_loads(tiny_checkpoint, tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration's layout: config.json's text_config, the decoder
    under model.language_model., a vision tower the text model does not load."""
    text = tiny_checkpoint("gemma3", vocab_size=96)
    wrapped = tmp_path / "gemma3-mm"
    shutil.copytree(text, wrapped)
    raw = json.loads((text / "config.json").read_text())
    (wrapped / "config.json").write_text(
        json.dumps({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                    "text_config": raw, "torch_dtype": "float32"})
    )  # fmt: skip
    tensors = load_file(text / "model.safetensors")
    renamed = {name.replace("model.", "model.language_model.", 1): t for name, t in tensors.items()}
    renamed["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.ones(2, 2)
    renamed["model.multi_modal_projector.mm_input_projection_weight"] = torch.ones(2, 2)
    (wrapped / "model.safetensors").unlink()
    save_file(renamed, str(wrapped / "model.safetensors"))
    plain, _, _ = load(text)
    mm, _, ckpt = load(wrapped)
    assert ckpt.config.model_type == "gemma3"
    prompt = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(2))
    want = plain(prompt, torch.arange(12), plain.new_cache(32))
    torch.testing.assert_close(mm(prompt, torch.arange(12), mm.new_cache(32)), want)


@pytest.mark.parametrize(("draft", "strategy", "extra"), RUNS, ids=RUN_IDS)
def test_speculation_is_the_targets_greedy(
    tiny_checkpoint, draft: str | None, strategy: str, extra: dict
) -> None:
    path = tiny_checkpoint("gemma3", vocab_size=96)
    rt = speculation_runtime(path, draft, strategy, extra, seed=4)
    if draft == "substitute":  # its own blocks, sharing both RoPE tables
        assert rt.draft is not None and rt.draft.inv_freq_local is rt.target.inv_freq_local
