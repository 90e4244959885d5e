"""GGUF files (llama.cpp's format; what Ollama and LM Studio keep): the model's config
from the file's metadata, and its tensors loaded into our decoder as they are stored.

The header is read by speculative/gguf_file.py over a memory map (gguf-py's reader parses
every metadata string in Python: seconds for a 128k vocabulary); each tensor is copied
from the map into the model as it loads. Quantized projections stay in their blocks
(`GGUFLinear`, rebuilt per pass like the other packed formats), and so does an untied
quantized embedding (`GGUFEmbedding`); a file whose projections are all float (F32, F16,
BF16) loads as a dense model. The output matrix (and a tied embedding) is decoded once, at
load, into the compute dtype. Llama's converter permutes the rows of q and k for
llama.cpp's rotary layout (pairs of adjacent values); they are put back in Hugging Face's
order (halves), whole rows, so the blocks need no decoding for it.

A file is taken as hostile: every metadata value the config is built from is checked for
its type and range, `block_count` against the `blk.N` tensors the file really holds and the
widths against the embedding's and the first layer's shapes, before anything is built per
layer; a tensor's shape is checked before its bytes are copied.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from speculative.config import ModelConfig, UnsupportedModelError
from speculative.gguf_blocks import (
    FLOAT_TYPES,
    UnsupportedGGMLTypeError,
    dequantize,
    supported_type,
)
from speculative.gguf_file import (
    CORRUPT_FILE,
    GGUFContents,
    GGUFFormatError,
    TensorInfo,
    open_regular,
    read_gguf,
    short_repr,
)
from speculative.gguf_modules import GGUFEmbedding, GGUFLinear
from speculative.model import Transformer, rope_inv_freq
from speculative.projections import fused_parts
from speculative.quant import EMBEDDING, QuantizationSpec

# general.architecture → our model_type. Mistral's files say "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF tensor names → ours, per layer and outside the layers.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_OUTER_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_OUTER = re.compile(r"(\w+)\.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.")
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1's frequency divisors (its rope scaling)


class GGUFError(ValueError):
    """A GGUF file specd cannot read or run: the message names the file and what to do."""


def is_gguf(ref: str | Path) -> bool:
    """A file named .gguf, or one that begins as a GGUF does (Ollama's blobs have no
    suffix)."""
    path = Path(ref).expanduser()
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with os.fdopen(open_regular(path), "rb") as f:  # no FIFO, even one swapped in since
            return f.read(4) == b"GGUF"
    except OSError:
        return False


SPLIT_PART = re.compile(r".*-\d{5}-of-\d{5}\.gguf", re.IGNORECASE)


def open_gguf(path: Path) -> GGUFContents:
    """The file's header read (speculative/gguf_file.py; its tensors stay in the memory
    map), or a GGUFError saying why it cannot be. One part of a split model is refused:
    its tensors are spread over several files."""
    try:
        contents = read_gguf(path)
    except GGUFFormatError as err:
        raise GGUFError(str(err)) from None
    parts = contents.metadata.get("split.count")
    if (isinstance(parts, int) and parts > 1) or SPLIT_PART.fullmatch(path.name):
        raise GGUFError(
            f"{path}: one part of a model split over several files; specd reads a whole "
            "GGUF: merge the parts with `llama-gguf-split --merge FIRST-PART OUT.gguf`"
        )
    return contents


def our_name(name: str) -> str | None:
    """A GGUF tensor name → ours ('blk.3.attn_q.weight' → 'layers.3.self_attn.q_proj.weight'),
    None for one we do not know."""
    layer = _LAYER.fullmatch(name)
    if layer is not None:
        part = _LAYER_NAMES.get(layer.group(2))
        return f"layers.{layer.group(1)}.{part}.{layer.group(3)}" if part else None
    outer = _OUTER.fullmatch(name)
    if outer is not None and outer.group(1) in _OUTER_NAMES:
        return f"{_OUTER_NAMES[outer.group(1)]}.weight"
    return None


def _projection(name: str) -> bool:
    return name.startswith("layers.") and name.endswith("_proj.weight")


def config_from_gguf(contents: GGUFContents) -> ModelConfig:
    """The ModelConfig of a GGUF file from its metadata and tensor infos, checked as
    config.json is, and against the tensors the file holds."""
    meta, tensors, source = contents.metadata, contents.tensors_by_name, str(contents.path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architecture {short_repr(arch)} is not supported; specd runs GGUF files "
            f"of {', '.join(ARCHITECTURES)} (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3)"
        )

    def count(name: str, default: int | None = None) -> int:
        """A whole number of at least 1 (a count or a width)."""
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"{source}: metadata key {arch}.{name} is missing")
        if type(value) is not int or value < 1:
            raise _malformed(source, f"{arch}.{name}", value, "a whole number of at least 1")
        return value

    def number(name: str, default: float | None = None) -> float:
        """A finite number of at least 0 (an epsilon, a base)."""
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"{source}: metadata key {arch}.{name} is missing")
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            raise _malformed(source, f"{arch}.{name}", value, "a finite number of at least 0")
        return float(value)

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
    for name, (shape, keys) in expected.items():
        if name in tensors and tensors[name].ne != shape:
            raise GGUFError(
                f"{source}: tensor {name} is {list(tensors[name].ne)} but {keys} make it "
                f"{list(shape)}: {CORRUPT_FILE}"
            )
    quantization = _quantization(tensors, meta, source)
    raw = {
        "model_type": ARCHITECTURES[arch],
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
    }
    return replace(ModelConfig.from_hf(raw, source), quantization=quantization)


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
    tensors: dict[str, TensorInfo], meta: dict[str, Any], source: str
) -> QuantizationSpec | None:
    """None when every projection is stored as floats (a dense model); else the GGUF spec
    naming each projection's block type."""
    types: list[tuple[str, int]] = []
    stored: dict[str, int] = {}
    for gguf_name, info in tensors.items():
        name = our_name(gguf_name)
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


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo the converter's q/k row order: within each head, rows (2i, 2i+1) go back to
    (i, i + head_dim / 2)."""
    out = rows.shape[0]
    return rows.reshape(heads, out // heads // 2, 2, -1).transpose(1, 2).reshape(out, -1)


def load_gguf_model(
    contents: GGUFContents, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> Transformer:
    """The decoder of `cfg` with every tensor of the GGUF file at `path` in place: float
    tensors in `dtype`, quantized projections as their blocks. Missing or unexpected
    tensors, or a shape that does not match the metadata, are a GGUFError."""
    path = contents.path
    with torch.device("meta"):
        model = Transformer(cfg)
    parts = fused_parts(model)
    fused = {where[0] for where in parts.values()}
    expected = {n for n, _ in model.named_parameters() if n not in fused} | set(parts)
    expected |= {n for n, _ in model.named_buffers() if n.endswith(".blocks")}
    seen: set[str] = set()
    problems: list[str] = []
    factors = None
    for info in contents.tensors:
        if info.name == ROPE_FACTORS:
            if info.ggml_type != 0 or info.ne != ((cfg.head_dim + 1) // 2,):
                problems.append(f"{info.name}: {info.ne} of type {info.ggml_type}, not F32 [hd/2]")
                continue
            factors = torch.from_numpy(contents.tensor_bytes(info).copy().view(np.float32))
            factors = factors.reshape(-1)  # (hd/2,)
            continue
        name = our_name(info.name)
        kind = info.ggml_type
        if name is None:
            problems.append(f"unexpected tensor {info.name}")
            continue
        # The shape is checked before the bytes are copied: a hostile file's tensor may
        # be far larger than the model its metadata describes.
        stored = contents.tensor_bytes(info)  # (rows, row bytes), a view of the map
        packed = f"{name.removesuffix('.weight')}.blocks"
        module = model.get_submodule(packed.rsplit(".", 1)[0]) if packed in expected else None
        if module is not None:  # kept as its blocks: a projection, or the embedding
            assert isinstance(module, GGUFLinear | GGUFEmbedding)
            if module.ggml_type != kind or tuple(module.stored().shape) != stored.shape:
                problems.append(f"{info.name}: {stored.shape} bytes of type {kind}")
                continue
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            problems.append("unexpected tensor output.weight (the embedding is tied)")
            continue
        elif (shape := _parameter_shape(model, name, parts)) != tuple(reversed(info.ne)):
            problems.append(f"{name}: shape {tuple(reversed(info.ne))}, not {shape}")
            continue
        rows = torch.from_numpy(stored.copy())
        if cfg.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            if len(info.ne) == 1:  # a bias: its values are what the rows of q/k are
                rows = _unpermute(rows.view(info.ne[0], -1), heads).reshape(1, -1)
            else:
                rows = _unpermute(rows, heads)
        columns = info.ne[0]
        if module is not None:
            if rows.shape[1] != module.blocks.shape[1]:  # room for another layer's type
                room = torch.zeros(module.blocks.shape, dtype=torch.uint8)
                room.view(-1)[: rows.numel()].copy_(rows.view(-1))
                rows = room
            module._buffers["blocks"] = rows.to(device)
            seen.add(packed)
            continue
        # Decoded a chunk at a time in fp32 and rounded once to `dtype`: no fp32 copy of a
        # whole embedding (4.2 GB for a 70B's).
        value = dequantize(rows.to(device), kind, columns, dtype)
        if len(info.ne) == 1:
            value = value.view(-1)
        _place(model, name, value, parts, problems)
        seen.add(name)
    missing = sorted(expected - seen - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing:
        problems.append("missing tensors: " + ", ".join(missing[:8]))
    if problems:
        raise GGUFError(f"{path}: " + "; ".join(problems[:8]))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope)
    if factors is not None:
        inv_freq = inv_freq / factors  # llama.cpp divides each frequency by its factor
    model.inv_freq = inv_freq.to(device)
    return model.eval()


def _parameter_shape(
    model: nn.Module, name: str, parts: dict[str, tuple[str, int, int]]
) -> tuple[int, ...] | None:
    """The shape the tensor `name` has in `model` (built on the meta device): its rows of a
    stacked (fused) parameter, or the parameter; None for a name the model does not have."""
    if name in parts:
        fused, row, end = parts[name]
        return (end - row, *model.get_parameter(fused).shape[1:])
    owner, _, attr = name.rpartition(".")
    try:
        current = model.get_submodule(owner)._parameters.get(attr)
    except AttributeError:
        return None
    return None if current is None else tuple(current.shape)


def _place(
    model: nn.Module,
    name: str,
    value: torch.Tensor,
    parts: dict[str, tuple[str, int, int]],
    problems: list[str],
) -> None:
    """A float tensor into its parameter, or into its rows of a stacked (fused) one."""
    if name in parts:
        fused, row, end = parts[name]
        stacked = model.get_parameter(fused)
        if stacked.is_meta:
            stacked = nn.Parameter(
                torch.empty(stacked.shape, dtype=value.dtype, device=value.device),
                requires_grad=False,
            )
            owner, _, attr = fused.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = stacked
        if tuple(stacked[row:end].shape) != tuple(value.shape):
            problems.append(
                f"{name}: shape {tuple(value.shape)}, not {tuple(stacked[row:end].shape)}"
            )
            return
        with torch.no_grad():
            stacked[row:end].copy_(value)
        return
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    current = module._parameters.get(attr)
    if current is None or tuple(current.shape) != tuple(value.shape):
        shape = None if current is None else tuple(current.shape)
        problems.append(f"{name}: shape {tuple(value.shape)}, not {shape}")
        return
    module._parameters[attr] = nn.Parameter(value, requires_grad=False)
