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

from modeling.architecture import Architecture
from modeling.checkpoints.gguf_file import CORRUPT_FILE, GGUFContents, TensorInfo, short_repr
from modeling.checkpoints.gguf_model import GGUFError, our_name
from modeling.config import ModelConfig, UnsupportedModelError
from modeling.models import SUPPORTED_GGUF_ARCHITECTURES, config_from_hf, gguf_architecture
from modeling.weights.gguf_blocks import FLOAT_TYPES, UnsupportedGGMLTypeError, supported_type
from modeling.weights.quant import EMBEDDING, QuantizationSpec

_BLOCK = re.compile(r"blk\.(\d+)\.")


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
            "Qwen2/2.5, Qwen3, Gemma 3)"
        )
    module, model_type = found

    keys = _Keys(meta, arch, source)
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
    for name, (shape, stated) in expected.items():
        if name in tensors and tensors[name].ne != shape:
            raise GGUFError(
                f"{source}: tensor {name} is {list(tensors[name].ne)} but {stated} make it "
                f"{list(shape)}: {CORRUPT_FILE}"
            )
    quantization = _quantization(tensors, meta, source, module)
    raw = {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": count("context_length", 2048),
        "rope_theta": number("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _token_id(meta, "tokenizer.ggml.bos_token_id", vocab, source),
        "eos_token_id": _token_id(meta, "tokenizer.ggml.eos_token_id", vocab, source),
        "torch_dtype": _float_dtype(tensors) if quantization is None else "bfloat16",
        "attention_bias": "blk.0.attn_output.bias" in tensors,
        **_rope_scaling(meta, arch, source),
        **module.gguf_config(keys, tensors),
    }
    return replace(config_from_hf(raw, source), quantization=quantization)


class _Keys:
    """`{arch}.*` metadata values, checked as read (modeling/architecture.py's GGUFKeys)."""

    def __init__(self, meta: dict[str, Any], arch: str, source: str) -> None:
        self.meta, self.arch, self.source = meta, arch, source

    def _value(self, name: str, default: Any) -> Any:
        value = self.meta.get(f"{self.arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(
                f"{self.source}: metadata key {self.arch}.{name} is missing"
            )
        return value

    def count(self, name: str, default: int | None = None) -> int:
        value = self._value(name, default)
        if type(value) is not int or value < 1:
            raise _malformed(
                self.source, f"{self.arch}.{name}", value, "a whole number of at least 1"
            )
        return value

    def number(self, name: str, default: float | None = None) -> float:
        value = self._value(name, default)
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            raise _malformed(
                self.source, f"{self.arch}.{name}", value, "a finite number of at least 0"
            )
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
    return value if value is not None else embedding[-1]


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


def _rope_scaling(meta: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The file's RoPE scaling as config.json writes it: none, or linear (also the older
    `rope.scale_linear`). Llama 3.1's own scaling is its `rope_freqs` tensor, not a key;
    any other kind (YaRN in Qwen2.5's long-context files) is refused, as for config.json,
    rather than run unscaled."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor_key = f"{arch}.rope.scaling.factor"
    if meta.get(factor_key) is None:
        factor_key = f"{arch}.rope.scale_linear"
    factor = meta.get(factor_key)
    if kind in (None, "none") and meta.get(f"{arch}.rope.scale_linear") is None:
        return {}
    if kind in (None, "linear") and factor is not None:
        if type(factor) not in (int, float) or not 0 < factor < math.inf:
            raise _malformed(source, factor_key, factor, "a finite number above 0")
        return {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    raise UnsupportedModelError(
        f"{source}: RoPE scaling {short_repr(kind)} ({arch}.rope.scaling.type) is not "
        "supported; specd runs default, linear and Llama 3.1's RoPE"
    )


def _float_dtype(tensors: dict[str, TensorInfo]) -> str:
    """The dtype a float file's projections are stored in (config.json's torch_dtype)."""
    kinds = {t.ggml_type for n, t in tensors.items() if ".attn_q." in n}
    names = {0: "float32", 1: "float16", 30: "bfloat16"}
    return names.get(kinds.pop(), "float32") if len(kinds) == 1 else "float32"


def _quantization(
    tensors: dict[str, TensorInfo], meta: dict[str, Any], source: str, arch: Architecture
) -> QuantizationSpec | None:
    """None when every projection is stored as floats (a dense model); else the GGUF spec
    naming each projection's block type."""
    types: list[tuple[str, int]] = []
    stored: dict[str, int] = {}
    for gguf_name, info in tensors.items():
        name = our_name(gguf_name, arch)
        if name is None:
            continue
        try:
            kind = supported_type(info.ggml_type)
        except UnsupportedGGMLTypeError as err:
            raise GGUFError(f"{source}: tensor {gguf_name}: {err}") from None
        if name.startswith("layers."):
            stored[kind.name] = stored.get(kind.name, 0) + info.n_bytes
        if _projection(name):
            types.append((name, int(kind)))
        untied = "output.weight" in tensors
        if name == EMBEDDING and untied and kind not in FLOAT_TYPES:
            types.append((name, int(kind)))  # kept as blocks, rows decoded per lookup
    if all(kind in FLOAT_TYPES for name, kind in types if name != EMBEDDING):
        return None  # float projections: a dense model (its embedding decoded at load)
    file_type = _file_type(meta.get("general.file_type"))
    return QuantizationSpec.gguf(tuple(sorted(types)), file_type, tuple(sorted(stored.items())))


def _file_type(value: Any) -> str:
    """general.file_type as llama.cpp names it ("Q4_K_M"): a mixture, not every tensor's."""
    import gguf

    try:
        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return "mixed"
