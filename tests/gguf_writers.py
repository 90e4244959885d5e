"""GGUF files written in the tests from tiny transformers checkpoints (never committed), as
llama.cpp's converter (convert_hf_to_gguf.py) writes each architecture: its metadata keys,
its tensor names, and what it does to values (Gemma's norms stored as 1 + w). The layers'
projections are Q8_0 blocks (gguf-py's quantizer) unless a writer is told not to, the rest
F32, and the tokenizer is the shared
stories260k file's 512-piece SentencePiece vocabulary under the file's architecture.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

from modeling.checkpoints.gguf_file import read_gguf
from tests.conftest import SHARED_MODELS

SPM_SOURCE = SHARED_MODELS / "gguf" / "stories260k-F32.gguf"
SPM_VOCABULARY = 512

# Hugging Face's names (after `model.layers.N.`) → llama.cpp's (after `blk.N.`)
GEMMA3_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _tokenizer(writer: gguf.GGUFWriter, add_space_prefix: bool) -> None:
    fields = read_gguf(SPM_SOURCE).metadata
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_scores(fields["tokenizer.ggml.scores"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)


def _tensor(writer: gguf.GGUFWriter, name: str, value: np.ndarray, quantize: bool = True) -> None:
    value = np.ascontiguousarray(value, dtype=np.float32)
    projection = value.ndim == 2 and name.startswith("blk.")
    if quantize and projection and value.shape[1] % 32 == 0:
        kind = gguf.GGMLQuantizationType.Q8_0
        blocks = gguf.quants.quantize(value, kind)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
    else:
        writer.add_tensor(name, value)


def _finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _shape_keys(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any]) -> None:
    writer.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    writer.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    writer.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    writer.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    writer.add_uint32(f"{arch}.attention.head_count", config["num_attention_heads"])
    writer.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])


PHI3_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_phi3(folder: Path, path: Path, quantize: bool = True) -> Path:
    """The Phi-3 checkpoint in `folder` as llama.cpp's Phi3MiniModel writes it: `attn_qkv`
    and the fused `ffn_up` as stored, the rotary width in dimensions, the window (0 for
    none), LongRoPE's factors as two tensors; F32 throughout unless `quantize`."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == SPM_VOCABULARY
    arch = "phi3"
    writer = gguf.GGUFWriter(str(path), arch)
    _shape_keys(writer, arch, config)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    writer.add_uint32(f"{arch}.rope.dimension_count", int(partial * hidden) // heads)
    writer.add_float32(f"{arch}.rope.freq_base", rope.get("rope_theta", 10000.0))
    original = rope.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings", config["max_position_embeddings"]
    )
    writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
    writer.add_uint32(f"{arch}.attention.sliding_window", config.get("sliding_window") or 0)
    _tokenizer(writer, add_space_prefix=True)
    writer.add_pad_token_id(config.get("pad_token_id") or 0)  # transformers' default: 32000
    if rope.get("long_factor"):
        writer.add_string(f"{arch}.rope.scaling.type", "longrope")
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    for name, value in load_file(folder / "model.safetensors").items():
        name = name.removeprefix("model.")
        outer = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}  # fmt: skip
        if name in outer:
            _tensor(writer, outer[name], value, quantize)
        elif name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            part, _, kind = rest.rpartition(".")
            _tensor(writer, f"blk.{index}.{PHI3_LAYER[part]}.{kind}", value, quantize)
    return _finish(writer, path)


def write_gemma3(folder: Path, path: Path) -> Path:
    """The Gemma 3 checkpoint in `folder` as llama.cpp's Gemma3Model writes it: every
    norm + 1, `gemma3.*` keys (the window; no pattern, no local base, no score scale:
    llama.cpp fixes those), the embedding tied."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == SPM_VOCABULARY and config.get("tie_word_embeddings", True)
    arch = "gemma3"
    writer = gguf.GGUFWriter(str(path), arch)
    _shape_keys(writer, arch, config)
    writer.add_uint32(f"{arch}.attention.key_length", config["head_dim"])
    writer.add_uint32(f"{arch}.attention.value_length", config["head_dim"])
    full = (config.get("rope_parameters") or {}).get("full_attention") or {}
    writer.add_float32(f"{arch}.rope.freq_base", full.get("rope_theta", 1_000_000.0))
    if full.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", full["factor"])
    writer.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
    _tokenizer(writer, add_space_prefix=False)
    for name, value in load_file(folder / "model.safetensors").items():
        name = name.removeprefix("model.")
        if name.endswith("norm.weight"):
            value = value + 1  # Gemma3RMSNorm scales by (1 + w); llama.cpp by w
        if name == "embed_tokens.weight":
            _tensor(writer, "token_embd.weight", value)
        elif name == "norm.weight":
            _tensor(writer, "output_norm.weight", value)
        elif name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            part, _, kind = rest.rpartition(".")
            _tensor(writer, f"blk.{index}.{GEMMA3_LAYER[part]}.{kind}", value)
    return _finish(writer, path)


# Mixtures of experts: Hugging Face's names after `model.layers.N.` → llama.cpp's, and each
# expert's projection → the stacked tensor it is a slice of (Qwen3-MoE's, Mixtral's names).
MOE_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
MOE_STACKS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
              "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # fmt: skip
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def _llama_like(
    path: Path, arch: str, config: dict[str, Any], values: dict[str, Any]
) -> gguf.GGUFWriter:
    """A writer with the shape keys, `values` under `{arch}.` (strings, floats as F32, the
    rest U32; None left out) and the shared SentencePiece tokenizer."""
    writer = gguf.GGUFWriter(str(path), arch)
    _shape_keys(writer, arch, config)
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    _tokenizer(writer, add_space_prefix=True)
    return writer


def _qk_heads(config: dict[str, Any]) -> dict[str, int]:
    """The heads of the projections llama.cpp's Llama converter permutes."""
    return {
        "self_attn.q_proj": config["num_attention_heads"],
        "self_attn.k_proj": config["num_key_value_heads"],
    }


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Llama converter's q/k row order (pairs of adjacent values per head)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_moe(
    folder: Path,
    path: Path,
    quantize: bool = True,
    keys: dict[str, Any] | None = None,
    arch: str | None = None,
) -> Path:
    """The Qwen3-MoE, Qwen2-MoE or Mixtral checkpoint in `folder` as llama.cpp's converter
    writes it: `qwen3moe`, `qwen2moe` (its shared expert `ffn_*_shexp` and gate
    `ffn_gate_inp_shexp`), Mixtral as `llama` with `llama.expert_count` and q/k permuted;
    each layer's experts stacked into `ffn_{gate,up,down}_exps` ([columns, rows, experts]),
    the router `ffn_gate_inp` kept F32. `keys`: metadata written over the converter's (to
    make hostile files); `arch`: another `general.architecture` than the converter's."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == SPM_VOCABULARY
    mixtral = config["model_type"] == "mixtral"
    arch = arch or {"mixtral": "llama", "qwen2_moe": "qwen2moe"}.get(
        config["model_type"], "qwen3moe"
    )
    experts = config.get("num_experts") or config["num_local_experts"]
    values: dict[str, Any] = {
        "expert_count": experts,
        "expert_used_count": config["num_experts_per_tok"],
        "rope.freq_base": (config.get("rope_parameters") or {}).get("rope_theta", 10000.0),
    }
    if not mixtral:
        values["expert_feed_forward_length"] = config["moe_intermediate_size"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        values["attention.key_length"] = head_dim
    if config.get("shared_expert_intermediate_size"):
        values["expert_shared_feed_forward_length"] = config["shared_expert_intermediate_size"]
    values.update(keys or {})
    writer = _llama_like(path, arch, config, values)
    heads = _qk_heads(config)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, value in load_file(folder / "model.safetensors").items():
        layer = _outer_or_layer(writer, name, value, quantize)
        if layer is None:
            continue
        index, rest = layer
        expert = _EXPERT.fullmatch(rest)
        if expert is not None:
            stack = f"blk.{index}.{MOE_STACKS[expert[2]]}.weight"
            stacks.setdefault(stack, {})[int(expert[1])] = value
            continue
        part, _, kind = rest.rpartition(".")
        if mixtral and part in heads:
            value = _llama_permute(value, heads[part])
        router = MOE_LAYER[part] in ("ffn_gate_inp", "ffn_gate_inp_shexp")
        _tensor(writer, f"blk.{index}.{MOE_LAYER[part]}.{kind}", value, quantize and not router)
    for stack, per_expert in stacks.items():
        value = np.stack([per_expert[e] for e in range(len(per_expert))])  # (experts, rows, cols)
        if quantize and value.shape[-1] % 32 == 0:
            kind = gguf.GGMLQuantizationType.Q8_0
            blocks = gguf.quants.quantize(np.ascontiguousarray(value, dtype=np.float32), kind)
            writer.add_tensor(stack, blocks, raw_shape=blocks.shape, raw_dtype=kind)
        else:
            writer.add_tensor(stack, np.ascontiguousarray(value, dtype=np.float32))
    return _finish(writer, path)


def _outer_or_layer(
    writer: gguf.GGUFWriter, name: str, value: np.ndarray, quantize: bool
) -> tuple[str, str] | None:
    """A checkpoint tensor outside the layers written under llama.cpp's name (None); a
    layer's: (its index, the name after `model.layers.N.`), for the caller to write."""
    name = name.removeprefix("model.")
    outer = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    if name in outer:
        _tensor(writer, outer[name], value, quantize)
        return None
    _, index, rest = name.split(".", 2)
    return index, rest


def _copy_all_but_weights(folder: Path, out: Path) -> None:
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name != "model.safetensors" and item.is_file():
            shutil.copy(item, out / item.name)


def as_stored(folder: Path, out: Path) -> Path:
    """`folder`'s checkpoint with each projection `_tensor` would quantize replaced by its
    Q8_0 blocks' values (quantized and decoded by gguf-py): what a file written with
    `quantize` holds, as a checkpoint transformers reads (the reference)."""
    from safetensors.numpy import save_file

    _copy_all_but_weights(folder, out)
    kind = gguf.GGMLQuantizationType.Q8_0
    tensors = {}
    for name, value in load_file(folder / "model.safetensors").items():
        value = np.ascontiguousarray(value, dtype=np.float32)
        router = name.endswith(
            ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")
        )
        if value.ndim == 2 and ".layers." in name and value.shape[1] % 32 == 0 and not router:
            value = gguf.quants.dequantize(gguf.quants.quantize(value, kind), kind)
        tensors[name] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


GPT_OSS_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
}


def _mxfp4(writer: gguf.GGUFWriter, name: str, value: np.ndarray) -> None:
    kind = gguf.GGMLQuantizationType.MXFP4
    blocks = gguf.quants.quantize(np.ascontiguousarray(value, dtype=np.float32), kind)
    writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)


def write_gpt_oss(folder: Path, path: Path, quantize: bool = True) -> Path:
    """The gpt-oss checkpoint in `folder` as llama.cpp's GptOssModel writes it: gate and up
    taken apart from transformers' interleaved `gate_up_proj` and each layer's experts
    stacked ([columns, rows, experts]; MXFP4 blocks where `quantize`, as the released
    files hold them), their biases stacked as [rows, experts], the router and sinks F32,
    attention projections Q8_0 (where `quantize`), YaRN's keys without its truncation."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == SPM_VOCABULARY
    arch = "gpt-oss"
    writer = gguf.GGUFWriter(str(path), arch)
    _shape_keys(writer, arch, config)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    for key, value in (
        ("expert_count", config["num_local_experts"]),
        ("expert_used_count", config["num_experts_per_tok"]),
        ("expert_feed_forward_length", config["intermediate_size"]),
        ("attention.key_length", config["head_dim"]),
        ("attention.value_length", config["head_dim"]),
        ("attention.sliding_window", config["sliding_window"]),
        ("rope.scaling.original_context_length", rope["original_max_position_embeddings"]),
    ):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", rope.get("rope_theta", 150000.0))
    writer.add_string(f"{arch}.rope.scaling.type", "yarn")
    writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    _tokenizer(writer, add_space_prefix=True)
    for name, value in load_file(folder / "model.safetensors").items():
        layer = _outer_or_layer(writer, name, value, quantize)
        if layer is None:
            continue
        index, rest = layer
        at = f"blk.{index}"
        if rest == "self_attn.sinks":
            writer.add_tensor(f"{at}.attn_sinks.weight", value.astype(np.float32))
        elif rest == "mlp.experts.gate_up_proj":  # (experts, hidden, 2 ff), interleaved
            rows = value.transpose(0, 2, 1)  # (experts, 2 ff, hidden)
            for part, half in (("ffn_gate_exps", rows[:, 0::2]), ("ffn_up_exps", rows[:, 1::2])):
                if quantize:
                    _mxfp4(writer, f"{at}.{part}.weight", half)
                else:
                    writer.add_tensor(f"{at}.{part}.weight", np.ascontiguousarray(half))
        elif rest == "mlp.experts.gate_up_proj_bias":  # (experts, 2 ff)
            writer.add_tensor(f"{at}.ffn_gate_exps.bias", np.ascontiguousarray(value[:, 0::2]))
            writer.add_tensor(f"{at}.ffn_up_exps.bias", np.ascontiguousarray(value[:, 1::2]))
        elif rest == "mlp.experts.down_proj":  # (experts, ff, hidden)
            rows = np.ascontiguousarray(value.transpose(0, 2, 1))  # (experts, hidden, ff)
            if quantize:
                _mxfp4(writer, f"{at}.ffn_down_exps.weight", rows)
            else:
                writer.add_tensor(f"{at}.ffn_down_exps.weight", rows)
        elif rest == "mlp.experts.down_proj_bias":
            writer.add_tensor(f"{at}.ffn_down_exps.bias", value)
        else:
            part, _, kind = rest.rpartition(".")
            router = part == "mlp.router"
            _tensor(writer, f"{at}.{GPT_OSS_LAYER[part]}.{kind}", value, quantize and not router)
    return _finish(writer, path)


def as_stored_gpt_oss(folder: Path, out: Path) -> Path:
    """`folder`'s gpt-oss checkpoint with the values `write_gpt_oss(quantize=True)` stores:
    attention projections through Q8_0, experts through MXFP4 (along each row's inputs,
    as the file's blocks run), the router F32: the reference transformers reads."""
    from safetensors.numpy import save_file

    _copy_all_but_weights(folder, out)
    q8, mx = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4

    def through(value: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
        return gguf.quants.dequantize(gguf.quants.quantize(value, kind), kind)

    tensors = {}
    for name, value in load_file(folder / "model.safetensors").items():
        value = np.ascontiguousarray(value, dtype=np.float32)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # (E, in, out)
            rows = np.ascontiguousarray(value.transpose(0, 2, 1))  # (E, out, in): as stored
            value = np.ascontiguousarray(through(rows, mx).transpose(0, 2, 1))
        elif value.ndim == 2 and name.endswith("_proj.weight"):  # (not the experts' biases)
            value = through(value, q8)
        tensors[name] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


LLAMA_LAYER = {
    **{k: v for k, v in MOE_LAYER.items() if k.startswith(("input", "self_attn", "post"))},
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_mistral3(
    folder: Path, path: Path, quantize: bool = True, keys: dict[str, Any] | None = None
) -> Path:
    """The Ministral 3 checkpoint in `folder` as llama.cpp's Mistral3Model writes it:
    architecture `mistral3`, Llama's tensors with q/k permuted, YaRN's keys with
    `mscale_all_dim` as the log multiplier, and the attention temperature's beta as
    `attention.temperature_scale`. `keys`: metadata written over the converter's (None:
    left out)."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == SPM_VOCABULARY
    rope = config["rope_parameters"]
    head_dim = config["head_dim"]
    values: dict[str, Any] = {
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.dimension_count": head_dim,
        "rope.freq_base": float(rope["rope_theta"]),
        "rope.scaling.type": rope["rope_type"],
        "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        "attention.temperature_scale": float(rope["llama_4_scaling_beta"]),
    }
    for key, name in (("yarn_log_multiplier", "mscale_all_dim"), ("yarn_beta_fast", "beta_fast"),
                      ("yarn_beta_slow", "beta_slow")):  # fmt: skip
        if name in rope:  # (YaRN's)
            values[f"rope.scaling.{key}"] = float(rope[name])
    values.update(keys or {})
    writer = _llama_like(path, "mistral3", config, values)
    heads = _qk_heads(config)
    for name, value in load_file(folder / "model.safetensors").items():
        layer = _outer_or_layer(writer, name, value, quantize)
        if layer is None:
            continue
        index, rest = layer
        part, _, kind = rest.rpartition(".")
        if part in heads:
            value = _llama_permute(value, heads[part])
        _tensor(writer, f"blk.{index}.{LLAMA_LAYER[part]}.{kind}", value, quantize)
    return _finish(writer, path)
