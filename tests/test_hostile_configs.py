"""Hostile config.json files: a count of 0 or below, null or text where a number goes, a
NaN, a RoPE parameter that divides by zero, a width no model has. Each is refused as the
config is read, with one line naming the file and the key (an UnsupportedModelError, which
the command line prints as `specd: error: ...`, exit status 2), where it was a traceback
(IndexError, "negative dimension", ZeroDivisionError, ...) or, worse, a model that answered
token 0 every time. The configs shipped with the project's models, and those transformers
writes for every family specd runs, still load."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest

from daemon.cli.commands import main
from modeling.checkpoints.checkpoint import open_checkpoint
from modeling.checkpoints.gguf_config import config_from_gguf
from modeling.checkpoints.gguf_model import open_gguf
from modeling.config import UnsupportedModelError
from modeling.models import config_from_hf
from scripts.tiny_models import FAMILIES
from tests.conftest import SHARED_MODELS

STORIES = SHARED_MODELS / "stories260k"
LLAMA = json.loads((STORIES / "config.json").read_text())
SOURCE = "/models/x/config.json"


def yarn(**changes: Any) -> dict[str, Any]:
    scaling = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}
    return {"rope_scaling": {**scaling, **changes}}


def llama3(**changes: Any) -> dict[str, Any]:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return {"rope_scaling": {**scaling, **changes}}


def linear(factor: Any) -> dict[str, Any]:
    return {"rope_scaling": {"rope_type": "linear", "factor": factor}}


# (changes to stories260k's config.json, the key the message must name)
HOSTILE: list[tuple[dict[str, Any], str]] = [
    # counts and widths: IndexError, "negative dimension", TypeError, ValueError
    ({"sliding_window": 64, "layer_types": [{}] * 5}, "layer_types"),  # (unhashable: TypeError)
    # true or false: the text "false" was read as true
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"attention_bias": 1}, "attention_bias"),
    (
        {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}},
        "rope_scaling.truncate",
    ),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_hidden_layers": -1}, "num_hidden_layers"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ({"hidden_size": -64}, "hidden_size"),
    ({"hidden_size": None}, "hidden_size"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"intermediate_size": -172}, "intermediate_size"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"max_position_embeddings": "abc"}, "max_position_embeddings"),
    ({"max_position_embeddings": -5}, "max_position_embeddings"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"max_position_embeddings": 1e300}, "max_position_embeddings"),
    ({"num_attention_heads": -8, "num_key_value_heads": -4}, "num_attention_heads"),
    ({"num_key_value_heads": -4}, "num_key_value_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"head_dim": 0}, "head_dim"),
    ({"head_dim": None, "hidden_size": 4}, "hidden_size"),
    # past any model: the plan said "the cpu needs 276 TiB", naming neither file nor key
    ({"vocab_size": 10**12}, "vocab_size"),
    ({"hidden_size": 10**12}, "hidden_size"),
    ({"intermediate_size": 10**12}, "intermediate_size"),
    ({"head_dim": 10**12}, "head_dim"),
    ({"num_attention_heads": 2**20, "num_key_value_heads": 1}, "num_attention_heads"),
    # the RMSNorm epsilon: ValueError, or every answer token 0
    ({"rms_norm_eps": "abc"}, "rms_norm_eps"),
    ({"rms_norm_eps": -1}, "rms_norm_eps"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    ({"rms_norm_eps": 1e308}, "rms_norm_eps"),
    # the RoPE blocks: ValueError, TypeError, ZeroDivisionError, a math domain error, or
    # frequencies of inf or NaN (every answer token 0)
    ({"rope_scaling": "garbage"}, "rope_scaling"),
    ({"rope_scaling": [1, 2]}, "rope_scaling"),
    ({"rope_parameters": [1]}, "rope_parameters"),
    ({"rope_scaling": {"rope_type": ["linear"]}}, "rope scaling type"),
    (linear("x"), "rope_scaling.factor"),
    (linear(0), "rope_scaling.factor"),
    (linear(-2), "rope_scaling.factor"),
    (linear(math.inf), "rope_scaling.factor"),
    (yarn(factor=math.nan), "rope_scaling.factor"),
    (yarn(mscale="x"), "rope_scaling.mscale"),
    (yarn(mscale=-100, mscale_all_dim=1), "rope_scaling.mscale"),
    (yarn(attention_factor=0), "rope_scaling.attention_factor"),
    (yarn(original_max_position_embeddings=0), "rope_scaling.original_max_position_embeddings"),
    (yarn(original_max_position_embeddings="abc"), "original_max_position_embeddings"),
    (yarn(beta_fast=-1), "rope_scaling.beta_fast"),
    (yarn(beta_slow=-1), "rope_scaling.beta_slow"),
    ({**yarn(), "rope_theta": 1.0}, "rope_theta"),
    (llama3(factor=-8.0), "rope_scaling.factor"),
    (llama3(original_max_position_embeddings=0), "original_max_position_embeddings"),
    (llama3(low_freq_factor=2.0, high_freq_factor=2.0), "rope_scaling.high_freq_factor"),
    (llama3(low_freq_factor=0), "rope_scaling.low_freq_factor"),
    (llama3(low_freq_factor=None, high_freq_factor=0.5), "rope_scaling.high_freq_factor"),
    ({"partial_rotary_factor": "x"}, "partial_rotary_factor"),
    # sliding windows of no positions: every answer token 0
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": -1}, "sliding_window"),
    ({"sliding_window": "128"}, "sliding_window"),
    ({"model_type": "qwen2", "sliding_window": 0, "use_sliding_window": True}, "sliding_window"),
    (
        {
            "model_type": "qwen2",
            "sliding_window": 8,
            "use_sliding_window": True,
            "max_window_layers": -1,
        },
        "max_window_layers",
    ),
    # the dtype (AttributeError; "float128" was taken silently) and the token ids
    ({"torch_dtype": [1]}, "torch_dtype"),
    ({"torch_dtype": "float128"}, "torch_dtype"),
    ({"torch_dtype": None, "dtype": "float128"}, "dtype"),
    ({"eos_token_id": {"a": 1}}, "eos_token_id"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id"),
    ({"bos_token_id": [1]}, "bos_token_id"),
    ({"bos_token_id": -1}, "bos_token_id"),
]


@pytest.mark.parametrize(
    ("changes", "key"), HOSTILE, ids=[json.dumps(c, default=str)[:60] for c, _ in HOSTILE]
)
def test_a_hostile_value_is_refused_naming_the_file_and_the_key(
    changes: dict[str, Any], key: str
) -> None:
    with pytest.raises(UnsupportedModelError) as refused:
        config_from_hf({**LLAMA, **changes}, SOURCE)
    message = str(refused.value)
    assert message.startswith(f"{SOURCE}: ") and key in message, message
    assert "\n" not in message and len(message) < 300, message


# (another architecture's config: its reader's own keys)
TINY = {
    k: LLAMA[k]
    for k in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    )
}
MIXTRAL = {**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN3_MOE = {
    **TINY,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
GPT_OSS = {**TINY, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2}
PHI3 = {**TINY, "model_type": "phi3"}
GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 2, "vocab_size": 512}
ARCHITECTURES: list[tuple[dict[str, Any], str]] = [
    ({**MIXTRAL, "sliding_window": 0}, "sliding_window"),
    ({**MIXTRAL, "num_local_experts": "4"}, "num_local_experts"),
    ({**MIXTRAL, "num_experts_per_tok": None}, "num_experts_per_tok"),
    ({**QWEN3_MOE, "decoder_sparse_step": "x"}, "decoder_sparse_step"),
    ({**QWEN3_MOE, "norm_topk_prob": "true"}, "norm_topk_prob"),
    ({**QWEN3_MOE, "moe_intermediate_size": 10**9}, "moe_intermediate_size"),
    (
        {**QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 10**9},
        "shared_expert_intermediate_size",
    ),
    ({**GPT_OSS, "sliding_window": 0}, "sliding_window"),
    ({**GPT_OSS, "rms_norm_eps": 2.0}, "rms_norm_eps"),
    ({**PHI3, "partial_rotary_factor": 2.0}, "partial_rotary_factor"),
    ({**PHI3, "partial_rotary_factor": math.nan}, "partial_rotary_factor"),
    ({**PHI3, "sliding_window": -1}, "sliding_window"),
    (
        {
            **PHI3,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0] * 4,
                "long_factor": [1.0] * 4,
                "factor": 4.0,
            },
            "original_max_position_embeddings": 1,
        },
        "original_max_position_embeddings",
    ),
    ({**GEMMA3, "query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({**GEMMA3, "query_pre_attn_scalar": -256}, "query_pre_attn_scalar"),
    ({**GEMMA3, "attn_logit_softcapping": 0}, "attn_logit_softcapping"),
    ({**GEMMA3, "sliding_window_pattern": 0}, "sliding_window_pattern"),
    ({**GEMMA3, "layer_types": [{}, {}]}, "layer_types"),  # (unhashable: a TypeError)
    ({**GEMMA3, "sliding_window": None}, "sliding_window"),
    ({**GEMMA3, "hidden_size": -640}, "hidden_size"),
    ({**GEMMA3, "num_key_value_heads": 0}, "num_key_value_heads"),
    ({**GEMMA3, "rope_parameters": {"full_attention": [1]}}, "rope_parameters.full_attention"),
    ({**GEMMA3, "rope_local_base_freq": "x"}, "rope_local_base_freq"),
    ({**GEMMA3, "rope_local_base_freq": 0}, "rope_local_base_freq"),
    ({"model_type": "gemma3", "text_config": [1]}, "text_config"),
]


@pytest.mark.parametrize(
    ("raw", "key"), ARCHITECTURES, ids=[f"{r['model_type']}-{k}" for r, k in ARCHITECTURES]
)
def test_each_architecture_refuses_its_hostile_values_by_name(
    raw: dict[str, Any], key: str
) -> None:
    with pytest.raises(UnsupportedModelError) as refused:
        config_from_hf(raw, SOURCE)
    message = str(refused.value)
    assert message.startswith(f"{SOURCE}: ") and key in message, message


@pytest.mark.parametrize("root", [[1, 2, 3], "llama", 7, None])
def test_a_config_that_is_no_object_is_refused(root: Any) -> None:
    with pytest.raises(UnsupportedModelError, match=r"not an object of config keys"):
        config_from_hf(root, SOURCE)


def test_what_a_config_may_leave_out_or_null_takes_its_default() -> None:
    """Absent or null is transformers' unset key: the default (kv heads the heads, head_dim
    the width over the heads, 4096.0 taken as the whole number it is)."""
    given = config_from_hf(
        {
            **LLAMA,
            "num_key_value_heads": None,
            "head_dim": None,
            "max_position_embeddings": None,
            "rope_scaling": None,
            "vocab_size": 512.0,
        }
    )
    assert (given.num_kv_heads, given.head_dim, given.vocab_size) == (8, 8, 512)
    assert given.max_position_embeddings == 2048  # LlamaConfig's default


@pytest.fixture
def quiet_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No user config file, no model stores, no hub cache of the user's."""
    for name in ("HOME", "XDG_CONFIG_HOME", "HF_HOME"):
        monkeypatch.setenv(name, str(tmp_path / "home"))
    for name in ("OLLAMA_MODELS", "LMSTUDIO_MODELS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "home"


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"num_hidden_layers": 0}, "num_hidden_layers"),  # was an IndexError
        ({"rms_norm_eps": 1e308}, "rms_norm_eps"),  # was every answer token 0
        (yarn(original_max_position_embeddings=0), "original_max_position_embeddings"),
        ({"sliding_window": 0}, "sliding_window"),  # was every answer token 0
    ],
)
def test_generate_and_plan_answer_one_line_naming_the_file_and_the_key(
    changes: dict[str, Any], key: str, quiet_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = quiet_home.parent / "model"
    shutil.copytree(STORIES, folder)
    (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    for command in (
        ["plan", "--model", str(folder)],
        [
            "generate",
            "--model",
            str(folder),
            "--draft",
            "none",
            "--prompt",
            "Once",
            "--max-tokens",
            "2",
        ],
    ):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"specd: error: {folder / 'config.json'}: "), err
        assert key in err and err.count("\n") == 1 and "Traceback" not in err, err


GGUF_SOURCE = SHARED_MODELS / "gguf" / "stories260k-Q8_0.gguf"


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        # (0 was taken: a division by zero in RMSNorm of a zero row)
        (
            {"llama.attention.layer_norm_rms_epsilon": (0.0, gguf.GGUFValueType.FLOAT32)},
            "llama.attention.layer_norm_rms_epsilon",
        ),
        (
            {"llama.attention.layer_norm_rms_epsilon": (1e30, gguf.GGUFValueType.FLOAT32)},
            "rms_norm_eps",
        ),
        ({"llama.context_length": (2**40, gguf.GGUFValueType.UINT64)}, "max_position_embeddings"),
    ],
)
def test_a_gguf_file_is_checked_as_config_json_is(
    changes: dict[str, tuple[Any, ...]], key: str, tmp_path: Path
) -> None:
    """A GGUF file's config is read through `config_from_hf`, so the same checks apply."""
    from tests.test_hostile_files import rewrite

    path = rewrite(tmp_path / "x.gguf", changes)
    with pytest.raises(ValueError) as refused:
        config_from_gguf(open_gguf(path))
    assert str(refused.value).startswith(f"{path}: ") and key in str(refused.value)


def test_the_shipped_configs_and_every_family_s_load(tmp_path: Path) -> None:
    """Every config.json and GGUF file under shared/models, and the config.json that
    transformers writes for each family of scripts/tiny_models.py, reads as before."""
    from transformers import AutoConfig

    folders = sorted(p.parent for p in SHARED_MODELS.glob("**/config.json"))
    assert STORIES in folders and len(folders) >= 3
    for folder in folders:
        config = open_checkpoint(folder, config_only=True).config
        assert config.num_layers >= 1 and config.vocab_size >= 1
    for path in sorted(SHARED_MODELS.glob("gguf/*.gguf")):
        assert config_from_gguf(open_gguf(path)).num_layers >= 1
    for family, spec in FAMILIES.items():
        fields = {k: v for k, v in spec.items() if k != "model_type"}
        out = tmp_path / family
        AutoConfig.for_model(spec["model_type"], **{**TINY, **fields}).save_pretrained(out)
        raw = json.loads((out / "config.json").read_text())
        assert config_from_hf(raw, str(out)).model_type == spec["model_type"]
