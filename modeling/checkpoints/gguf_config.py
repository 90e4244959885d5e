"""A GGUF file's ModelConfig, from its metadata and tensor infos (`config_from_gguf`), and
the checks of what that config is built from.

A file is taken as hostile: every metadata value the config is built from is checked for
its type and range, `block_count` against the `blk.N` tensors the file really holds and the
widths against the embedding's and the first layer's shapes, before anything is built per
layer. This is all `specd plan` needs of a GGUF (no tensor's bytes are read), so it stands
apart from modeling/checkpoints/gguf_model.py, which builds the decoder and copies the tensors in.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

import numpy as np

from modeling.architecture import Architecture
from modeling.checkpoints.gguf_file import CORRUPT_FILE, GGUFContents, TensorInfo, short_repr
from modeling.checkpoints.gguf_model import GGUFError, gguf_parts
from modeling.config import ModelConfig, UnsupportedModelError
from modeling.models import SUPPORTED_GGUF_ARCHITECTURES, config_from_hf, gguf_architecture
from modeling.weights.gguf_blocks import (
    FLOAT_TYPES,
    GGMLType,
    UnsupportedGGMLTypeError,
    supported_type,
)
from modeling.weights.quant import EMBEDDING, QuantizationSpec

_BLOCK = re.compile(r"blk\.(0|[1-9][0-9]*)\.")  # (canonical numbers: `blk.01` is not layer 1)


def _projection(name: str) -> bool:
    return name.startswith("layers.") and name.endswith("_proj.weight")


def config_from_gguf(contents: GGUFContents) -> ModelConfig:
    """The ModelConfig of a GGUF file from its metadata and tensor infos, checked as
    config.json is, and against the tensors the file holds."""
    meta, tensors, source = contents.metadata, contents.tensors_by_name, str(contents.path)
    arch = meta.get("general.architecture")
    found = gguf_architecture(arch) if isinstance(arch, str) else None
    if found is None or not isinstance(arch, str):
        raise UnsupportedModelError(
            f"{source}: architecture {short_repr(arch)} is not supported; specd runs GGUF files "
            f"of {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (Llama 2/3/3.1/3.2, Mistral, "
            "Ministral 3, Mistral Small 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral, Gemma 3, "
            "Phi-3/Phi-4, gpt-oss)"
        )
    module, model_type = found

    keys = _Keys(contents, arch)
    count, number = keys.count, keys.number
    heads, hidden = count("attention.head_count"), count("embedding_length")
    kv_heads = count("attention.head_count_kv", heads)
    head_dim = count("attention.key_length", max(hidden // heads, 1))
    intermediate, layers = count("feed_forward_length"), count("block_count")
    if head_dim % 2:
        raise _malformed(
            source, f"{arch}.attention.key_length", head_dim, "even (RoPE turns pairs)"
        )
    vocab = _vocab_size(meta, tensors, arch, source)
    _check_layers(tensors, layers, f"{arch}.block_count", source)
    # (columns, rows) as ne lists them; from the keys that set them, in the messages.
    widths = f"{arch}.embedding_length"
    q, kv = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
    expected = {
        "token_embd.weight": ((hidden, vocab), f"{widths} and the vocabulary"),
        "output.weight": ((hidden, vocab), f"{widths} and the vocabulary"),
        "blk.0.attn_q.weight": ((hidden, heads * head_dim), f"{widths}, {q}"),
        "blk.0.attn_k.weight": ((hidden, kv_heads * head_dim), f"{widths}, {kv}"),
        "blk.0.attn_v.weight": ((hidden, kv_heads * head_dim), f"{widths}, {kv}"),
        "blk.0.ffn_up.weight": ((hidden, intermediate), f"{widths}, {arch}.feed_forward_length"),
    }
    if module.gguf_layer_names.get("ffn_up") == "mlp.gate_up_proj":  # stored fused (Phi-3)
        qkv = (hidden, (heads + 2 * kv_heads) * head_dim)
        expected["blk.0.attn_qkv.weight"] = (qkv, f"{widths}, {q}, {kv}")
        expected["blk.0.ffn_up.weight"] = (
            (hidden, 2 * intermediate),
            f"{widths}, {arch}.feed_forward_length (gate and up)",
        )
    for name, (shape, stated) in expected.items():
        if name in tensors and tensors[name].ne != shape:
            raise GGUFError(
                f"{source}: tensor {name} is {list(tensors[name].ne)} but {stated} make it "
                f"{list(shape)}: {CORRUPT_FILE}"
            )
    experts = _check_experts(keys, tensors, hidden, intermediate, module)
    quantization = _quantization(tensors, meta, source, module, experts)
    raw = {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", positive=True),
        "max_position_embeddings": count("context_length", 2048),
        "rope_theta": number("rope.freq_base", 10000.0, positive=True),  # (0: inf, NaN)
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _token_id(meta, "tokenizer.ggml.bos_token_id", vocab, source),
        "eos_token_id": _token_id(meta, "tokenizer.ggml.eos_token_id", vocab, source),
        "torch_dtype": _float_dtype(tensors) if quantization is None else "bfloat16",
        "attention_bias": "blk.0.attn_output.bias" in tensors,
        **_rope_scaling(meta, arch, source, module.gguf_yarn_log_multiplier),
        **module.gguf_config(keys, tensors),
    }
    # What the file states and specd would otherwise not read: the rotated width (only an
    # architecture that reads it, Phi-3's, turns part of a head; llama.cpp refuses other
    # widths for the rest) and the values' width (every architecture here: the keys').
    if "partial_rotary_factor" not in raw and count("rope.dimension_count", head_dim) != head_dim:
        raise _malformed(
            source, f"{arch}.rope.dimension_count", meta[f"{arch}.rope.dimension_count"],
            f"{arch}.attention.key_length ({head_dim}): this architecture turns whole heads",
        )  # fmt: skip
    if count("attention.value_length", head_dim) != head_dim:
        raise _malformed(
            source, f"{arch}.attention.value_length", meta[f"{arch}.attention.value_length"],
            f"{arch}.attention.key_length ({head_dim}): specd's models read values as wide",
        )  # fmt: skip
    return replace(config_from_hf(raw, source), quantization=quantization, gguf=True)


class _Keys:
    """`{arch}.*` metadata values, checked as read (modeling/architecture.py's GGUFKeys)."""

    def __init__(self, contents: GGUFContents, arch: str) -> None:
        self.contents, self.arch = contents, arch
        self.meta, self.source = contents.metadata, str(contents.path)

    def has(self, name: str) -> bool:
        return self.meta.get(f"{self.arch}.{name}") is not None

    def floats(self, tensor: str, length: int) -> list[float] | None:
        info = self.contents.tensors_by_name.get(tensor)
        if info is None:
            return None
        if info.ggml_type != 0 or info.ne != (length,):
            raise GGUFError(
                f"{self.source}: tensor {tensor} is {list(info.ne)} of type {info.ggml_type}, "
                f"not F32 [{length}]: {CORRUPT_FILE}"
            )
        values = self.contents.tensor_bytes(info).copy().view(np.float32).reshape(-1)
        if not np.all(np.isfinite(values) & (values > 0)):
            raise GGUFError(
                f"{self.source}: tensor {tensor} holds a value that is not a finite number "
                f"above 0: {CORRUPT_FILE}"
            )
        return values.tolist()

    def _value(self, name: str, default: Any) -> Any:
        value = self.meta.get(f"{self.arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(
                f"{self.source}: metadata key {self.arch}.{name} is missing"
            )
        return value

    def count(self, name: str, default: int | None = None, minimum: int = 1) -> int:
        value = self._value(name, default)
        if type(value) is not int or value < minimum:
            raise _malformed(
                self.source, f"{self.arch}.{name}", value, f"a whole number of at least {minimum}"
            )
        return value

    def number(self, name: str, default: float | None = None, positive: bool = False) -> float:
        value = self._value(name, default)
        if (
            type(value) not in (int, float)
            or not math.isfinite(value)
            or value < 0
            or (positive and value == 0)
        ):
            wanted = "a finite number above 0" if positive else "a finite number of at least 0"
            raise _malformed(self.source, f"{self.arch}.{name}", value, wanted)
        return float(value)


def _malformed(source: str, key: str, value: Any, wanted: str) -> GGUFError:
    return GGUFError(f"{source}: {key} is {short_repr(value)}, not {wanted}: {CORRUPT_FILE}")


def _vocab_size(
    meta: dict[str, Any], tensors: dict[str, TensorInfo], arch: str, source: str
) -> int:
    """`{arch}.vocab_size`, else the vocabulary's length, else the embedding's rows."""
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{source}: the file has no token_embd.weight tensor: {CORRUPT_FILE}")
    value = meta.get(f"{arch}.vocab_size")
    if value is not None and (type(value) is not int or value < 1):
        raise _malformed(source, f"{arch}.vocab_size", value, "a whole number of at least 1")
    tokens = meta.get("tokenizer.ggml.tokens")
    if value is None and isinstance(tokens, list) and tokens:
        value = len(tokens)
    embedding = tensors["token_embd.weight"].ne
    rows = embedding[-1]
    if isinstance(tokens, list) and 0 < len(tokens) < rows:
        # llama.cpp takes the vocabulary's size from the token list, and its converter pads
        # the list to the embedding's rows: a shorter one leaves ids the model may write
        # without text (such a file ran and answered nothing, an attacker found).
        raise GGUFError(
            f"{source}: tokenizer.ggml.tokens holds {len(tokens):,} tokens but "
            f"token_embd.weight has {rows:,} rows: ids past the list would be written as "
            f"nothing; {CORRUPT_FILE}"
        )
    return value if value is not None else rows


def _token_id(meta: dict[str, Any], key: str, vocab: int, source: str) -> int | None:
    value = meta.get(key)
    if value is not None and (type(value) is not int or not 0 <= value < vocab):
        raise _malformed(source, key, value, f"a token id below the vocabulary's {vocab}")
    return value


def _check_layers(tensors: dict[str, TensorInfo], layers: int, key: str, source: str) -> None:
    """Every `blk.N` tensor is of a layer below `layers`, and every such layer has some: a
    block count the tensors do not bear out would have us build (or plan) layers that are
    not there."""
    present = set()
    for name in tensors:
        block = _BLOCK.match(name)
        if block is None:
            continue
        if len(block[1]) > 9 or int(block[1]) >= layers:  # digits: int() of any length is slow
            raise GGUFError(
                f"{source}: tensor {name} is of a layer past {key} {layers} (layers 0 to "
                f"{layers - 1}): {CORRUPT_FILE}"
            )
        present.add(int(block[1]))
    if len(present) < layers:
        first = min(set(range(len(present) + 1)) - present)
        raise GGUFError(
            f"{source}: {key} is {layers} but layer {first} has no tensors (the file holds "
            f"{len(present)} layers): {CORRUPT_FILE}"
        )


def _rope_scaling(
    meta: dict[str, Any], arch: str, source: str, log_multiplier: bool = False
) -> dict[str, Any]:
    """The file's RoPE scaling as config.json writes it: none; linear (also the older
    `rope.scale_linear`); YaRN (Qwen2.5's and Qwen3's long-context files, Ministral 3:
    `rope.scaling.factor`, `.original_context_length`, and the betas and attention factor
    when the converter wrote them); LongRoPE's kind, whose factors an architecture reads
    (Phi-3: tensors). Llama 3.1's own scaling is its `rope_freqs` tensor, not a key. Any
    other kind, or a YaRN option specd does not compute, is refused rather than run
    unscaled. `log_multiplier`: llama.cpp reads the architecture's
    `rope.scaling.yarn_log_multiplier` (Mistral 3's: the converter writes `mscale_all_dim`
    there) as transformers' `mscale_all_dim` beside an `mscale` of 1, 0 or absent meaning
    neither; other architectures' it ignores, and specd refuses one that is not 0."""
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(f"{prefix}type")
    factor_key = f"{prefix}factor"
    if meta.get(factor_key) is None:
        factor_key = f"{arch}.rope.scale_linear"
    factor = meta.get(factor_key)
    if kind is None and meta.get(f"{prefix}factor") is not None:
        kind = "linear"  # (llama.cpp's default type where a factor is stated)
    if kind in (None, "none") and meta.get(f"{arch}.rope.scale_linear") is None:
        return {}
    if kind == "longrope":
        return {"rope_scaling": {"rope_type": "longrope"}}
    if kind not in (None, "linear", "yarn") or factor is None:
        raise UnsupportedModelError(
            f"{source}: RoPE scaling {short_repr(kind)} ({prefix}type) is not "
            "supported; specd runs default, linear, YaRN, LongRoPE and Llama 3.1's RoPE"
        )
    if type(factor) not in (int, float) or not 0 < factor < math.inf:
        raise _malformed(source, factor_key, factor, "a finite number above 0")
    if kind != "yarn":
        return {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    for name, neutral in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        value = meta.get(f"{prefix}{name}")
        if log_multiplier and name == "yarn_log_multiplier":
            continue
        if value is not None and value != neutral:
            raise UnsupportedModelError(
                f"{source}: {prefix}{name} {short_repr(value)} is not supported (specd's YaRN "
                f"computes {name} {neutral})"
            )
    original = meta.get(f"{prefix}original_context_length")
    if type(original) is not int or original < 1:
        raise _malformed(
            source, f"{prefix}original_context_length", original, "a whole number of at least 1"
        )
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": original,
    }
    for name, ours in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                       ("yarn_attn_factor", "attention_factor")):  # fmt: skip
        value = meta.get(f"{prefix}{name}")
        if value is None:
            continue
        if type(value) not in (int, float) or not 0 < value < math.inf:
            raise _malformed(source, f"{prefix}{name}", value, "a finite number above 0")
        scaling[ours] = float(value)
    multiplier = meta.get(f"{prefix}yarn_log_multiplier")
    if log_multiplier and multiplier is not None:
        if type(multiplier) not in (int, float) or not 0 <= multiplier <= 100:
            raise _malformed(source, f"{prefix}yarn_log_multiplier", multiplier, "from 0 to 100")
        if multiplier:  # (llama.cpp: mscale 1 beside it, as transformers' ratio reads them)
            scaling["mscale"], scaling["mscale_all_dim"] = 1.0, float(multiplier)
    return {"rope_scaling": scaling}


def _float_dtype(tensors: dict[str, TensorInfo]) -> str:
    """The dtype a float file's projections are stored in (config.json's torch_dtype)."""
    kinds = {t.ggml_type for n, t in tensors.items() if ".attn_q." in n}
    names = {0: "float32", 1: "float16", 30: "bfloat16"}
    return names.get(kinds.pop(), "float32") if len(kinds) == 1 else "float32"


def _quantization(
    tensors: dict[str, TensorInfo],
    meta: dict[str, Any],
    source: str,
    arch: Architecture,
    experts: int,
) -> QuantizationSpec | None:
    """None when every projection is stored as floats (a dense model); else the GGUF spec
    naming each projection's block type (each expert's, of a stacked expert tensor)."""
    types: list[tuple[str, int]] = []
    stored: dict[str, int] = {}
    for gguf_name, info in tensors.items():
        names = [name for name, *_ in gguf_parts(info, arch, experts)]
        if names[0] is None:
            continue
        try:
            kind = supported_type(info.ggml_type)
            if not isinstance(kind, GGMLType):  # (specd's own layouts are never a file's)
                raise UnsupportedGGMLTypeError(f"ggml type {int(kind)} is not ggml's")
        except UnsupportedGGMLTypeError as err:
            raise GGUFError(f"{source}: tensor {gguf_name}: {err}") from None
        if names[0].startswith("layers."):
            stored[kind.name] = stored.get(kind.name, 0) + info.n_bytes
        types += [(name, int(kind)) for name in names if name and _projection(name)]
        untied = "output.weight" in tensors
        if names[0] == EMBEDDING and untied and kind not in FLOAT_TYPES:
            types.append((EMBEDDING, int(kind)))  # kept as blocks, rows decoded per lookup
    if all(kind in FLOAT_TYPES for name, kind in types if name != EMBEDDING):
        return None  # float projections: a dense model (its embedding decoded at load)
    file_type = _file_type(meta.get("general.file_type"))
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    head_type = int(head.ggml_type) if head is not None else -1
    return QuantizationSpec.gguf(
        tuple(sorted(types)), file_type, tuple(sorted(stored.items())), head_type
    )


def _check_experts(
    keys: _Keys,
    tensors: dict[str, TensorInfo],
    hidden: int,
    intermediate: int,
    arch: Architecture,
) -> int:
    """The experts a mixture of experts' file states (`expert_count`; 0 for a dense file),
    with every stacked expert tensor and router checked against it and the widths before
    anything is split by it or built for it. A file that routes other than by softmax over
    its experts, or has shared experts, is refused by name."""
    source, prefix = keys.source, keys.arch
    stacked = [name for name in tensors if arch.gguf_expert(name) is not None]
    experts = keys.count("expert_count", 0, minimum=0)
    if not experts:
        if stacked:
            raise GGUFError(
                f"{source}: tensor {stacked[0]} stacks experts but {prefix}.expert_count is "
                f"missing: {CORRUPT_FILE}"
            )
        return 0
    if not arch.gguf_experts:
        raise UnsupportedModelError(
            f"{source}: {prefix}.expert_count is {experts}, but specd runs {prefix} files "
            "without experts only (mixtures of experts: qwen3moe, and Mixtral as llama)"
        )
    if not stacked:
        raise GGUFError(
            f"{source}: {prefix}.expert_count is {experts}, but the file holds no expert "
            f"tensors (blk.N.ffn_up_exps.weight and the like): {CORRUPT_FILE}"
        )
    used = keys.count("expert_used_count")
    if used > experts:
        raise _malformed(source, f"{prefix}.expert_used_count", used,
                         f"at most {prefix}.expert_count {experts}")  # fmt: skip
    checked = (("expert_gating_func", arch.gguf_expert_gating),
               ("expert_shared_count", arch.gguf_expert_shared))  # fmt: skip
    for key, plain in checked:
        if plain is not None and keys.has(key) and keys.count(key, minimum=0) != plain:
            raise UnsupportedModelError(
                f"{source}: {prefix}.{key} {keys.count(key, minimum=0)} is not supported "
                "(specd routes as llama.cpp does for this architecture, with no shared expert)"
            )
    ff = keys.count("expert_feed_forward_length", intermediate)
    widths = (
        f"{prefix}.embedding_length, {prefix}.expert_feed_forward_length, {prefix}.expert_count"
    )
    for name, info in tensors.items():
        expert = arch.gguf_expert(name)
        shape: tuple[int, ...]
        if expert is not None:
            rows, columns = (hidden, ff) if expert[1] == "down_proj" else (ff, hidden)
            shape = (columns, rows, experts) if expert[2] == "weight" else (rows, experts)
            stated = widths
        elif name.endswith(".ffn_gate_inp.weight"):
            shape, stated = (hidden, experts), f"{prefix}.embedding_length, {prefix}.expert_count"
        else:
            continue
        if info.ne != shape:
            raise GGUFError(
                f"{source}: tensor {name} is {list(info.ne)} but {stated} make it "
                f"{list(shape)}: {CORRUPT_FILE}"
            )
    return experts


def _file_type(value: Any) -> str:
    """general.file_type as llama.cpp names it ("Q4_K_M"): a mixture, not every tensor's."""
    import gguf

    try:
        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return "mixed"
