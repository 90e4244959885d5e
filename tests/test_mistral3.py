"""Mistral 3 (Ministral 3, Mistral Small 3.x) from GGUF: a file as llama.cpp's converter
writes architecture `mistral3` (tests/gguf_writers.py) runs as transformers runs the
checkpoint it came from, its attention temperature past the original context included;
what the file says is read as llama.cpp reads it, and hostile values are one line.
(Safetensors checkpoints, text-only and multimodal: tests/test_model_parity.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from modeling.checkpoints.checkpoint import load
from modeling.config import UnsupportedModelError
from modeling.layers.rope import rope_attention_factor
from modeling.models import SUPPORTED_GGUF_ARCHITECTURES
from scripts.tiny_models import make_checkpoint
from tests.gguf_writers import SPM_VOCABULARY, as_stored, write_mistral3
from tests.test_model_parity import _check_parity, _hf_model

FLOOR = 8  # the tiny family's original context: where the temperature's steps fall


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("ministral3"), "ministral3", vocab_size=SPM_VOCABULARY
    )


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "q8_0"])
def test_a_mistral3_file_runs_as_transformers_runs_its_checkpoint(
    folder: Path, tmp_path: Path, quantize: bool
) -> None:
    """Prefill, cached decode steps and a tree pass at positions 0-26 (three of the
    temperature's steps), against the checkpoint (through Q8_0 where the file is)."""
    path = write_mistral3(folder, tmp_path / "ministral3.gguf", quantize=quantize)
    config = load(path)[2].config
    assert config.model_type == "ministral3" and config.query_scale is not None
    assert config.query_scale == (pytest.approx(0.1), FLOOR)  # (a float32 in the file)
    # The file's log multiplier is mscale_all_dim (1.0), beside an mscale of 1: a factor of
    # 1 on cos and sin, as transformers' ratio gives.
    assert config.rope.kind == "yarn" and rope_attention_factor(config.rope) == 1.0
    reference = folder if not quantize else as_stored(folder, tmp_path / "stored")
    _check_parity(path, f"mistral3-gguf-{quantize}", _hf_model(reference))


def test_a_log_multiplier_of_0_is_yarns_own_factor(tmp_path: Path) -> None:
    """`mscale_all_dim` 0 (Mistral's own configs with `apply_scale`, Devstral 2): the
    converter writes a log multiplier of 0, and the factor on cos and sin is YaRN's
    0.1 ln(factor) + 1, as transformers and llama.cpp compute it (it was fixed at 1)."""
    from scripts.tiny_models import FAMILIES

    rope = {**FAMILIES["ministral3"]["rope_parameters"], "mscale_all_dim": 0.0}
    folder = make_checkpoint(
        tmp_path / "m", "ministral3", vocab_size=SPM_VOCABULARY, rope_parameters=rope
    )
    path = write_mistral3(folder, tmp_path / "m.gguf", quantize=False)
    config = load(path)[2].config
    assert rope_attention_factor(config.rope) == pytest.approx(0.1 * math.log(16.0) + 1)
    _check_parity(path, "mistral3-gguf-mscale-0", _hf_model(folder))


def test_the_architecture_is_listed(folder: Path, tmp_path: Path) -> None:
    assert "mistral3" in SUPPORTED_GGUF_ARCHITECTURES
    # A file stating no key_length (head_dim = hidden / heads) turns whole heads too.
    plain = make_checkpoint(tmp_path / "p", "ministral3", vocab_size=SPM_VOCABULARY,
                            head_dim=16)  # fmt: skip
    keys = {"attention.key_length": None, "attention.value_length": None}
    path = write_mistral3(plain, tmp_path / "p.gguf", quantize=False, keys=keys)
    assert load(path)[2].config.head_dim == 16


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        ({"attention.temperature_scale": -0.5}, "temperature_scale"),
        (
            {"attention.temperature_scale": 1e9},
            "temperature_scale 1000000000.0 is not from 0 to 10",
        ),
        # (the floor: 2**64 - 1 wrapped negative in the division and every logit was NaN)
        ({"rope.scaling.original_context_length": 2**32 - 1}, "past the"),
        ({"rope.scaling.yarn_attn_factor": 1e30}, "attention_factor"),
        ({"rope.scaling.yarn_log_multiplier": 1e30}, "yarn_log_multiplier"),
        ({"rope.scaling.factor": 1e-30}, "factor"),
        ({"rope.dimension_count": 8}, "turns whole heads"),
        ({"expert_count": 4}, "mistral3 files without experts only"),
        ({"rope.scaling.original_context_length": 0}, "original_context_length"),
    ],
    ids=[
        "negative-beta",
        "huge-beta",
        "huge-floor",
        "huge-attn-factor",
        "huge-log-mul",
        "tiny-factor",
        "partial-rotary",
        "experts",
        "no-floor",
    ],
)
def test_hostile_mistral3_keys_are_one_line(
    folder: Path, tmp_path: Path, keys: dict, said: str
) -> None:
    path = write_mistral3(folder, tmp_path / "bad.gguf", quantize=False, keys=keys)
    with pytest.raises((UnsupportedModelError, ValueError)) as info:
        load(path)
    message = str(info.value)
    assert said in message and str(path) in message and "\n" not in message


def test_without_a_temperature_the_file_is_mistral_small(folder: Path, tmp_path: Path) -> None:
    """Mistral Small 3.x's files say mistral3 and state no temperature: no query scale, and
    the logits of the checkpoint with beta 0 (its queries unscaled at every position)."""
    from scripts.tiny_models import FAMILIES

    rope = {**FAMILIES["ministral3"]["rope_parameters"], "llama_4_scaling_beta": 0.0}
    plain = make_checkpoint(
        tmp_path / "plain", "ministral3", vocab_size=SPM_VOCABULARY, rope_parameters=rope
    )
    keys = {"attention.temperature_scale": None}
    path = write_mistral3(plain, tmp_path / "small.gguf", quantize=False, keys=keys)
    model, _, info = load(path)
    assert info.config.query_scale is None
    ids = torch.arange(3, 40)  # positions 0-36: past four of the temperature's steps
    got = model(ids, torch.arange(len(ids)), model.new_cache(64))
    with torch.no_grad():
        want = _hf_model(plain)(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_compiled_steps_scale_queries_as_eager_ones(folder: Path) -> None:
    """A compiled pass computes each query's temperature inside its graph (from the
    positions it is given): 30 decode steps and a tree pass, positions 0-35, equal eager."""
    from modeling.compiled import CompiledPasses
    from tests.test_compiled import _close, _steps

    model = load(folder)[0]
    eager_tokens, eager_logits = _steps(model)
    model.compiled = passes = CompiledPasses(model)
    try:
        passes.warm()
        tokens, logits = _steps(model)
    finally:
        model.compiled = None
    assert passes.passes == 32 and tokens == eager_tokens
    for a, b in zip(logits, eager_logits, strict=True):
        _close(a, b)


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ({"model_type": "mistral3", "text_config": [1]}, "text_config is [1]"),
        ({"model_type": "mistral3", "text_config": {"model_type": "pixtral"}},
         "text_config.model_type 'pixtral' is not supported"),
        ({"model_type": "ministral3", "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
          "original_max_position_embeddings": 8, "llama_4_scaling_beta": "hot"}},
         "llama_4_scaling_beta"),
    ],
    ids=["text-config-list", "inner-type", "beta-text"],
)  # fmt: skip
def test_hostile_mistral3_configs_are_one_line(raw: dict, said: str) -> None:
    from modeling.models import config_from_hf

    base = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    with pytest.raises(UnsupportedModelError) as info:
        config_from_hf({**base, **raw}, "x/config.json")
    assert said in str(info.value) and str(info.value).startswith("x/config.json: ")


def test_a_ministral3_config_that_leaves_keys_out_reads_transformers_defaults() -> None:
    """Ministral3Config's defaults: head_dim 128 (not hidden / heads), and YaRN from 16,384
    positions with the temperature's beta 0.1 where no RoPE block is given."""
    from transformers import Ministral3Config

    from modeling.models import config_from_hf

    raw = {"model_type": "ministral3", "vocab_size": 96, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2}  # fmt: skip
    ours = config_from_hf(raw, "x/config.json")
    ref = Ministral3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert ours.head_dim == ref.head_dim == 128
    assert ours.rope.kind == ref.rope_parameters["rope_type"] == "yarn"
    assert ours.rope.original_max_position_embeddings == 16384
    assert ours.query_scale == (ref.rope_parameters["llama_4_scaling_beta"], 16384)
    assert ours.rms_norm_eps == ref.rms_norm_eps
    assert ours.max_position_embeddings == ref.max_position_embeddings


def test_a_file_without_a_scaling_type_is_read_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    """A factor with no `rope.scaling.type` is linear scaling (llama.cpp's default type), and
    the temperature's floor is the file's original context whatever the type: as
    transformers runs the checkpoint (linear RoPE x16, beta 0.1 from 8 positions). It was
    given Ministral3Config's YaRN and beta instead of what the file says."""
    rope = {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 16.0,
            "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.1}  # fmt: skip
    folder = make_checkpoint(
        tmp_path / "m", "ministral3", vocab_size=SPM_VOCABULARY, rope_parameters=rope
    )
    path = write_mistral3(folder, tmp_path / "m.gguf", quantize=False,
                          keys={"rope.scaling.type": None})  # fmt: skip
    config = load(path)[2].config
    assert config.rope.kind == "linear" and config.query_scale == (pytest.approx(0.1), 8)
    _check_parity(path, "mistral3-gguf-untyped", _hf_model(folder))


def test_mistral_smalls_text_model_has_no_temperature(tmp_path: Path) -> None:
    """transformers' Mistral (Mistral Small's text model) ignores `llama_4_scaling_beta`:
    a wrapper whose text model is `mistral` runs without the temperature (it was applied,
    0.83 off past the floor)."""
    from tests.test_model_parity import check_mistral3_wrapper

    rope = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
            "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.1}  # fmt: skip
    check_mistral3_wrapper(tmp_path, "mistral", {"rope_parameters": rope})
