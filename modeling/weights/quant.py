"""Quantized checkpoints: what config.json's quantization_config declares, checked against
what specd can load (GPTQ v1, AWQ GEMM, compressed-tensors `pack-quantized`), as a
`QuantizationSpec` that builds each projection's packed module (modeling/weights/packed.py);
and `--quantize`, which packs a full-precision checkpoint while loading it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from modeling.weights import cpu_kernels
from modeling.weights.block_layout import BlockQuantizedLinear, layout_type
from modeling.weights.gguf_blocks import GGMLType
from modeling.weights.gguf_modules import GGUFEmbedding, GGUFLinear
from modeling.weights.hqq import HQQLinear
from modeling.weights.packed import AWQLinear, CompressedLinear, GPTQLinear, PackedLinear

SUPPORTED_FORMATS = (
    "gptq (checkpoint_format gptq, 4 or 8 bits)",
    "awq (version gemm, 4 bits, zero point)",
    "compressed-tensors (format pack-quantized, int weights of 4 or 8 bits)",
)


class UnsupportedQuantizationError(ValueError):
    """config.json's quantization_config names a format or option specd cannot load."""


@dataclass(frozen=True)
class QuantizationSpec:
    """What config.json's quantization_config says, enough to build every packed module
    (planning works from config.json alone)."""

    method: str  # "gptq" | "awq" | "compressed-tensors"
    bits: int
    group_size: int  # -1: one group spanning the whole input
    symmetric: bool
    scale_dtype: torch.dtype  # the stored scales' dtype
    # Quantized while loading a full-precision checkpoint (`--quantize`), not as stored.
    on_load: bool = False
    # Group-wise integer weights laid out as 32-blocks (Q8_0/Q4_0, or Q4_Z with zero
    # points), where the CPU kernels multiply those (`laid_out_for`); else as stored (or
    # compressed-tensors' packing).
    blocks: bool = False
    # GPTQ's desc_act: groups permuted along the input (blocks sort the inputs by group).
    act_order: bool = False
    # A GGUF file: each projection's own block type (our name → ggml type), which differ
    # within a file (a Q4_K_M mix holds Q4_K and Q6_K, and Q5_0 where rows are short).
    tensor_types: tuple[tuple[str, int], ...] = ()
    file_type: str = ""
    type_bytes: tuple[tuple[str, int], ...] = ()  # the layers' stored bytes per block type
    # The output matrix's ggml type (the embedding's where it is tied; -1: none recorded):
    # on a CPU with kernels for it, the head stays packed (modeling/checkpoints/gguf_model.py).
    head_type: int = -1
    # The config.json it was read from, for messages (not part of what the spec is).
    source: str = field(default="", compare=False)

    @classmethod
    def gguf(
        cls,
        tensor_types: tuple[tuple[str, int], ...],
        file_type: str,
        type_bytes: tuple[tuple[str, int], ...],
        head_type: int = -1,
    ) -> QuantizationSpec:
        return cls(
            "gguf", 0, -1, False, torch.float16, tensor_types=tensor_types,
            file_type=file_type, type_bytes=type_bytes, head_type=head_type,
        )  # fmt: skip

    @property
    def label(self) -> str:
        if self.method == "gguf":
            kinds = ", ".join(f"{kind} {_size(n)}" for kind, n in self.type_bytes)
            return f"gguf {self.file_type} as stored (layers: {kinds})"
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        how = "quantized on load" if self.on_load else "as stored"
        kind = layout_type(self.bits, self.symmetric or self.on_load, self.scale_dtype)
        if self.blocks and kind is not None:
            how += f", as {kind.name} blocks"
        return f"{self.method} {self.bits}-bit, {group} ({how})"

    def linear(self, in_features: int, out_features: int, bias: bool) -> PackedLinear:
        if self.method == "gguf":  # its type is set per tensor (`specialise`)
            return GGUFLinear(in_features, out_features, bias, GGMLType.F32)
        group = in_features if self.group_size == -1 else self.group_size
        if self.on_load:
            # A projection that is not a multiple of a group (a tiny model's 172 inputs)
            # takes the largest group that divides it; its last word may be part padding.
            group = max(g for g in range(1, min(group, in_features) + 1) if in_features % g == 0)
            if self.method == "hqq":  # the substitute draft (modeling/substitute.py)
                return HQQLinear(in_features, out_features, bias, self.bits, group)
            if self.blocks and group % 32 == 0:  # (a tiny model's odd widths: packed)
                return BlockQuantizedLinear(in_features, out_features, bias, self.bits, group)
            return CompressedLinear(
                in_features, out_features, bias, self.bits, group, True, self.scale_dtype
            )
        if self.blocks and in_features % group == 0 and group % 32 == 0:
            # A checkpoint's projection as the loader lays it out on this CPU
            # (`BlockQuantizedLinear.from_packed`): what the plan counts.
            return BlockQuantizedLinear(
                in_features, out_features, bias, self.bits, group, self.symmetric,
                self.act_order, self.scale_dtype,
            )  # fmt: skip
        if in_features % group or in_features * self.bits % 32 or out_features * self.bits % 32:
            raise UnsupportedQuantizationError(
                f"{self.source + ': ' if self.source else ''}"
                f"a {in_features} → {out_features} projection cannot be packed as {self.method} "
                f"with {self.bits} bits and group size {self.group_size}"
            )
        if self.method == "gptq":
            return GPTQLinear(in_features, out_features, bias, self.bits, group)
        if self.method == "awq":
            return AWQLinear(in_features, out_features, bias, group)
        return CompressedLinear(
            in_features, out_features, bias, self.bits, group, self.symmetric, self.scale_dtype
        )


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} B"


def specialise(model: nn.Module, spec: QuantizationSpec) -> None:
    """A GGUF model's projections as their tensors are stored: each `GGUFLinear` of the
    block type `spec.tensor_types` names for it, with room for the largest type the same
    projection has in any layer (so every layer has one shape, for streaming)."""
    kinds: dict[str, set[int]] = {}
    for name, kind in spec.tensor_types:
        kinds.setdefault(_role(name), set()).add(kind)  # (the embedding's: one, its own)
    for name, kind in spec.tensor_types:
        if name == EMBEDDING:
            table = model.get_submodule("embed_tokens")
            assert isinstance(table, nn.Embedding)
            model.embed_tokens = GGUFEmbedding(table.num_embeddings, table.embedding_dim, kind)
            continue
        owner, _, attr = name.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(owner)
        old = getattr(parent, attr)
        also = tuple(kinds[_role(name)])
        bias = old.bias is not None
        setattr(parent, attr, GGUFLinear(old.in_features, old.out_features, bias, kind, also))


# The embedding's entry in `tensor_types`: a GGUF file's untied, quantized token table.
EMBEDDING = "embed_tokens.weight"


def _role(name: str) -> str:
    """'layers.3.mlp.down_proj.weight' → 'mlp.down_proj.weight'."""
    return name.split(".", 2)[2] if name.startswith("layers.") else name


QUANTIZE_CHOICES = ("int8", "int4")
# Input channels sharing one scale under `--quantize` (fewer where a projection's input is
# not a multiple: math.gcd): what GPTQ/AWQ releases use, about 0.13 extra bits per weight
# with fp16 scales.
QUANTIZE_GROUP = 128


def on_load_quantization(kind: str) -> QuantizationSpec:
    """`--quantize int8|int4`: symmetric round-to-nearest in groups of QUANTIZE_GROUP input
    channels with fp16 scales, in compressed-tensors' pack-quantized layout (so it shares
    that format's dequantization and plan arithmetic)."""
    bits = {"int8": 8, "int4": 4}.get(kind)
    if bits is None:
        raise UnsupportedQuantizationError(
            f"--quantize {kind!r}: choose one of {', '.join(QUANTIZE_CHOICES)}"
        )
    return QuantizationSpec(
        "compressed-tensors", bits, QUANTIZE_GROUP, True, torch.float16, on_load=True
    )


def laid_out_for(
    spec: QuantizationSpec | None, dtype: torch.dtype, device: torch.device | str
) -> QuantizationSpec | None:
    """`spec` as a model computing in `dtype` on `device` holds it: group-wise integer
    weights with fp16 or bf16 scales (`--quantize`; GPTQ, AWQ and compressed-tensors checkpoints:
    symmetric of 4 or 8 bits, 4 bits with zero points, GPTQ's act-order too) as 32-blocks
    the CPU kernels multiply where they lie (fp32 on a CPU with the kernels built), since
    no kernel reads those packings and a CPU would otherwise rebuild the float matrix for
    every product. The same values either way (modeling/weights/block_layout.py); the plan
    (daemon/footprint.py) and the loader ask here alike, so the bytes planned are the
    bytes loaded (a checkpoint whose projections turn out to have no exact block form,
    against what its config says, loads as stored: planned too)."""
    if spec is None or spec.blocks or spec.method not in ("compressed-tensors", "gptq", "awq"):
        return spec
    kind = layout_type(spec.bits, spec.symmetric or spec.on_load, spec.scale_dtype)
    if kind is None:  # 8 bits with zero points; fp32 scales
        return spec
    if not cpu_kernels.computes(kind, dtype, device):
        return spec
    return replace(spec, blocks=True)


_FLOAT_NAMES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _refuse(source: str, what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"{source}: quantization_config {what} is not supported; specd loads "
        + "; ".join(SUPPORTED_FORMATS)
    )


def parse_quantization(raw: dict[str, Any], source: str) -> QuantizationSpec | None:
    """config.json's quantization_config as a spec, None when there is none; anything this
    module cannot load exactly is refused here, naming the format, and a value of the wrong
    kind (a hostile or damaged file) naming its key."""
    q = raw.get("quantization_config")
    if not q:
        return None
    q = _section(q, "quantization_config", source)
    method = _field(q, "quant_method", str, "", source).lower()
    if method == "gptq":
        spec = _gptq(q, source)
    elif method == "awq":
        spec = _awq(q, source)
    elif method == "compressed-tensors":
        spec = _compressed(q, raw, source)
    else:
        raise _refuse(source, f"quant_method {method!r}")
    return replace(spec, source=source)


def _section(value: Any, key: str, source: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UnsupportedQuantizationError(
            f"{source}: {key} is {type(value).__name__} {short(value)}, not an object"
        )
    return value


def _field(q: dict[str, Any], key: str, kind: type, default: Any, source: str) -> Any:
    """q[key] (default where absent or null), refused unless it is a `kind` (a bool is not
    an int here, nor a string "false" a bool)."""
    value = q.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UnsupportedQuantizationError(
            f"{source}: quantization_config {key} is {short(value)}, not a{'n' if kind is int else ''}"
            f" {kind.__name__}"
        )
    return value


def short(value: Any) -> str:
    """A value for a one-line message (a hostile file's string may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _group_size(q: dict[str, Any], key: str, default: int | None, source: str) -> int:
    """A group size: a positive number of inputs, or -1 for one group a row."""
    size = _field(q, key, int, default, source)
    if size is None:
        raise UnsupportedQuantizationError(f"{source}: quantization_config needs {key}")
    if size != -1 and not 1 <= size <= 1 << 20:
        raise UnsupportedQuantizationError(
            f"{source}: quantization_config {key} {size} is neither -1 (one group a row) nor "
            "a number of inputs"
        )
    return size


def _bits(q: dict[str, Any], key: str, allowed: tuple[int, ...], source: str, fmt: str) -> int:
    bits = _field(q, key, int, 0, source)
    if bits not in allowed:
        raise _refuse(source, f"{fmt} with {bits} bits")
    return bits


def _gptq(q: dict[str, Any], source: str) -> QuantizationSpec:
    fmt = _field(q, "checkpoint_format", str, "", source) or _field(q, "format", str, "", source)
    fmt = (fmt or "gptq").lower()
    if fmt != "gptq":
        raise _refuse(source, f"gptq checkpoint_format {fmt!r} (only 'gptq', the v1 layout)")
    if q.get("lm_head"):
        raise _refuse(source, "gptq with a quantized lm_head")
    if q.get("dynamic"):
        raise _refuse(source, "gptq with per-module 'dynamic' overrides")
    if _field(q, "pack_dtype", str, "int32", source) != "int32":
        raise _refuse(source, f"gptq with pack_dtype {q.get('pack_dtype')!r}")
    bits = _bits(q, "bits", (4, 8), source, "gptq")
    return QuantizationSpec(
        "gptq", bits, _group_size(q, "group_size", 128, source),
        _field(q, "sym", bool, True, source), torch.float16,
        act_order=_field(q, "desc_act", bool, False, source),
    )  # fmt: skip


def _awq(q: dict[str, Any], source: str) -> QuantizationSpec:
    version = _field(q, "version", str, "gemm", source).lower()
    if version != "gemm":
        raise _refuse(source, f"awq version {version!r} (only 'gemm')")
    if not _field(q, "zero_point", bool, True, source):
        raise _refuse(source, "awq without zero point")
    if q.get("modules_to_not_convert"):
        raise _refuse(source, f"awq modules_to_not_convert {short(q['modules_to_not_convert'])}")
    bits = _bits(q, "bits", (4,), source, "awq")
    return QuantizationSpec(
        "awq", bits, _group_size(q, "group_size", 128, source), False, torch.float16
    )


def _compressed(q: dict[str, Any], raw: dict[str, Any], source: str) -> QuantizationSpec:
    groups = _section(q.get("config_groups") or {}, "quantization_config.config_groups", source)
    if len(groups) != 1:
        raise _refuse(source, f"compressed-tensors with {len(groups)} config groups")
    group = _section(next(iter(groups.values())), "its config group", source)
    fmt = _field(group, "format", str, "", source) or _field(q, "format", str, "", source)
    if fmt != "pack-quantized":
        raise _refuse(source, f"compressed-tensors format {fmt!r} (only 'pack-quantized')")
    if q.get("sparsity_config") or q.get("transform_config"):
        raise _refuse(source, "compressed-tensors with sparsity or transforms")
    if group.get("input_activations") or group.get("output_activations"):
        raise _refuse(source, "compressed-tensors with quantized activations")
    targets = _field(group, "targets", list, [], source)
    if [t for t in targets if t != "Linear"]:
        raise _refuse(source, f"compressed-tensors targets {short(targets)}")
    ignore = _field(q, "ignore", list, [], source)
    if [m for m in ignore if m != "lm_head"]:
        raise _refuse(source, f"compressed-tensors ignore list {short(ignore)} (only lm_head)")
    w = _section(group.get("weights") or {}, "its weights", source)
    if w.get("type", "int") != "int" or w.get("dynamic") or w.get("block_structure"):
        raise _refuse(source, "compressed-tensors weights other than static int")
    if w.get("actorder") not in (None, "static", "weight"):
        raise _refuse(source, f"compressed-tensors actorder {short(w['actorder'])}")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(source, f"compressed-tensors weight strategy {short(strategy)}")
    bits = _bits(w, "num_bits", (4, 8), source, "compressed-tensors")
    scale_name = (
        _field(w, "scale_dtype", str, "", source)
        or _field(raw, "torch_dtype", str, "", source)
        or _field(raw, "dtype", str, "", source)
    )
    scale_dtype = _FLOAT_NAMES.get(scale_name.removeprefix("torch."), torch.float32)
    group_size = _group_size(w, "group_size", None, source) if strategy == "group" else -1
    return QuantizationSpec(
        "compressed-tensors", bits, group_size, _field(w, "symmetric", bool, True, source),
        scale_dtype,
    )  # fmt: skip
