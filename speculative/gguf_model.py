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
"""

from __future__ import annotations

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
from speculative.gguf_file import GGUFContents, GGUFFormatError, TensorInfo, read_gguf
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
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


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
    config.json is."""
    meta, tensors, source = contents.metadata, contents.tensors_by_name, str(contents.path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architecture {arch!r} is not supported; specd runs GGUF files of "
            f"{', '.join(ARCHITECTURES)} (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3)"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"{source}: metadata key {arch}.{name} is missing")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    quantization = _quantization(tensors, meta, source)
    raw = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": vocab or tensors["token_embd.weight"].ne[1],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": _float_dtype(tensors) if quantization is None else "bfloat16",
        "attention_bias": "blk.0.attn_output.bias" in tensors,
        **_rope_scaling(meta, arch, source),
    }
    return replace(ModelConfig.from_hf(raw, source), quantization=quantization)


def _rope_scaling(meta: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The file's RoPE scaling as config.json writes it: none, or linear (also the older
    `rope.scale_linear`). Llama 3.1's own scaling is its `rope_freqs` tensor, not a key;
    any other kind (YaRN in Qwen2.5's long-context files) is refused, as for config.json,
    rather than run unscaled."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
    if kind in (None, "none") and meta.get(f"{arch}.rope.scale_linear") is None:
        return {}
    if kind in (None, "linear") and factor is not None:
        return {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    raise UnsupportedModelError(
        f"{source}: RoPE scaling {kind!r} ({arch}.rope.scaling.type) is not supported; "
        "specd runs default, linear and Llama 3.1's RoPE"
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
        rows = torch.from_numpy(contents.tensor_bytes(info).copy())
        if cfg.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            if len(info.ne) == 1:  # a bias: its values are what the rows of q/k are
                rows = _unpermute(rows.view(info.ne[0], -1), heads).reshape(1, -1)
            else:
                rows = _unpermute(rows, heads)
        columns = info.ne[0]
        packed = f"{name.removesuffix('.weight')}.blocks"
        if packed in expected:  # kept as its blocks: a projection, or the embedding
            module = model.get_submodule(packed.rsplit(".", 1)[0])
            assert isinstance(module, GGUFLinear | GGUFEmbedding)
            if module.ggml_type != kind or tuple(module.stored().shape) != tuple(rows.shape):
                problems.append(f"{info.name}: {tuple(rows.shape)} bytes of type {kind}")
                continue
            if rows.shape[1] != module.blocks.shape[1]:  # room for another layer's type
                room = torch.zeros(module.blocks.shape, dtype=torch.uint8)
                room.view(-1)[: rows.numel()].copy_(rows.view(-1))
                rows = room
            module._buffers["blocks"] = rows.to(device)
            seen.add(packed)
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            problems.append("unexpected tensor output.weight (the embedding is tied)")
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
