"""A Hugging Face checkpoint's safetensors weights: the files that hold them
(`weight_files`: one file, or the shards an index names) and `load_model`, which builds the
decoder on the meta device and reads each tensor straight from the memory-mapped files into
its final dtype and device, so loading never holds a second full copy of the weights. Every
stored tensor is checked against the config: missing, unexpected, wrongly shaped or wrongly
typed ones are a CheckpointError that names them, as is a folder's JSON file that is past a
bound in size or nesting (`read_json_object`). modeling/checkpoints/checkpoint.py finds and
opens checkpoints; a GGUF file's weights are read by modeling/checkpoints/gguf_model.py."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from modeling.checkpoints.folder_files import (
    INDEX,
    CheckpointError,
    indexed_shards,
    refuse_irregular,
)
from modeling.checkpoints.gguf_model import is_gguf
from modeling.checkpoints.packed_layers import check_group_index, check_packed_layers, to_blocks
from modeling.config import ModelConfig
from modeling.decoder import Transformer
from modeling.models import architecture
from modeling.weights.block_layout import BlockQuantizedLinear
from modeling.weights.packed import CompressedLinear, PackedLinear
from modeling.weights.projections import fused_parts

log = logging.getLogger("specd.checkpoint")

# The safetensors names of the dtypes packed tensors are stored in.
_SAFETENSORS_NAMES = {
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
}
# The dtypes a float parameter may be stored in (cast to the compute dtype as it is read).
# Integers, booleans or FP8 where a float weight belongs are a damaged file or a format
# whose scales live elsewhere: casting them would load wrong weights without a word.
_FLOAT_NAMES = {"F64", "F32", "F16", "BF16"}
_FLOAT_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16}
# Buffers some exporters store that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(path: Path) -> list[Path]:
    if is_gguf(path):
        return [path]
    shards = indexed_shards(path)
    if shards is not None:
        refuse_irregular(*(path / s for s in shards))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            more = f" and {len(missing) - 8:,} more" if len(missing) > 8 else ""
            named = ", ".join(s[:100] for s in missing[:8])
            raise CheckpointError(f"{path / INDEX}: shard files missing: {named}{more}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    ours = [f for f in files if not f.name.startswith("consolidated")]
    if files and not ours:
        raise CheckpointError(
            f"{path}: only {', '.join(f.name for f in files[:3])}, Mistral's own format: specd "
            "reads the Hugging Face files beside it (model*.safetensors and config.json); "
            "download those"
        )
    files = ours  # (Mistral's own format beside them is not read: hub_patterns.SKIPPED_FILES)
    refuse_irregular(*files)
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" (found {', '.join(bins)}: convert to safetensors)" if bins else ""
        if ggufs:
            hint = f" (found {', '.join(ggufs)}: give --model the .gguf file itself)"
        raise CheckpointError(f"{path}: no *.safetensors weights{hint}")
    return files


@contextlib.contextmanager
def opened(file: Path) -> Iterator[Any]:
    """A safetensors file open for reading; one that is damaged or cut short (a download
    that stopped) is a CheckpointError naming it, wherever safetensors finds out."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as err:
        raise CheckpointError(
            f"{file}: {err} (the file is damaged or incomplete: download it again)"
        ) from None


def load_model(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
    skip: Callable[[str], bool] | None = None,
) -> Transformer:
    """Build the decoder on the meta device and materialise each tensor once, straight from
    the memory-mapped file into its final dtype and device.

    Parameters whose name `skip` accepts (e.g. "layers.7.mlp.up_proj.weight") are checked
    against the file but left on the meta device in `dtype`: the disk offload tier reads
    those layers from the files itself, so they never take host memory."""
    arch = architecture(config)
    spec = config.quantization
    # A symmetric checkpoint to be laid out as blocks (`laid_out_for`): read as stored,
    # then converted projection by projection (`_to_blocks`); the disk tier reads the
    # files' own layout, so it keeps that.
    relayout = spec is not None and spec.blocks and not spec.on_load
    if relayout:
        assert spec is not None
        config = replace(config, quantization=replace(spec, blocks=False))
    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: p.shape for name, p in model.named_parameters()}  # tied: embed only
    # Dense q/k/v and gate/up are stored apart and held stacked: each stored part is
    # expected in its own shape and copied into its rows of the stacked tensor.
    parts = fused_parts(model)
    for part, (fused, row, end) in parts.items():
        expected.pop(fused, None)
        expected[part] = torch.Size((end - row, *model.get_parameter(fused).shape[1:]))
    # Packed projections' stored tensors (modeling/weights/packed.py) are buffers kept in the
    # dtype the format stores them in; parameters take the compute dtype.
    stored = dict(_stored_buffers(model))
    expected.update({name: b.shape for name, b in stored.items()})
    # `--quantize`: the file holds full-precision projections, each packed as it is read.
    quantized_on_load: dict[str, CompressedLinear | BlockQuantizedLinear] = {}
    if config.quantization is not None and config.quantization.on_load:
        if skip is not None:
            raise CheckpointError(
                f"{path}: layers quantized on load live in RAM; the disk tier "
                "streams a checkpoint's own bytes (use a pre-quantized GPTQ, AWQ or "
                "compressed-tensors checkpoint to stream 4-bit layers from disk)"
            )
        for owner, module in model.named_modules():
            if isinstance(module, CompressedLinear | BlockQuantizedLinear):
                quantized_on_load[f"{owner}.weight"] = module
                for attr, buf in module._buffers.items():
                    if buf is not None and attr not in module._non_persistent_buffers_set:
                        del expected[f"{owner}.{attr}"], stored[f"{owner}.{attr}"]
                expected[f"{owner}.weight"] = torch.Size((module.out_features, module.in_features))
    tied = config.tie_word_embeddings
    files = weight_files(path)
    total = sum(f.stat().st_size for f in files)
    show = progress if progress is not None else (sys.stderr.isatty() and total > 256 * 2**20)
    reporter = _Progress(total, path.name) if show else None

    seen: set[str] = set()
    pending: dict[str, dict[str, torch.Tensor]] = {}  # parts of a tensor stored apart
    unexpected: list[str] = []
    wrong_shape: list[str] = []
    wrong_dtype: list[str] = []
    for file in files:
        with opened(file) as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                stack = arch.hf_stack_shape(config, hf_name)
                if stack is not None:  # every expert of a layer in one tensor: split
                    if skip is not None:
                        raise CheckpointError(
                            f"{path}: {hf_name} holds a layer's experts in one tensor, which "
                            "the disk tier cannot stream as stored; keep the model in RAM "
                            "(a larger --ram-budget)"
                        )
                    shape = tuple(f.get_slice(hf_name).get_shape())
                    if shape != stack:  # checked before the bytes are read
                        wrong_shape.append(f"{hf_name} {shape} (expected {stack})")
                        continue
                    stacked = f.get_tensor(hf_name)
                    for one, value in arch.hf_unstack(hf_name, stacked):
                        if "#" in one:  # a part of one tensor stored apart (MXFP4's scales)
                            base, part = one.split("#", 1)
                            pending.setdefault(base, {})[part] = value
                            joined = arch.hf_join(pending[base])
                            if joined is None:
                                continue
                            one, value = base, joined
                            del pending[base]
                        if one not in expected or tuple(value.shape) != tuple(expected[one]):
                            wrong_shape.append(f"{hf_name}: {one} {tuple(value.shape)}")
                            continue
                        if one not in stored and value.dtype not in _FLOAT_DTYPES:
                            wrong_dtype.append(f"{hf_name}: {one} {value.dtype} (expected a float)")
                            continue
                        seen.add(one)
                        if one in stored:  # packed blocks: their bytes as they are
                            _assign(model, one, value.to(device=device))
                        elif one in parts:  # gate and up, stacked in the expert's module
                            _load_part(model, parts[one], value, device, dtype)
                        else:
                            _assign(model, one, value.to(device=device, dtype=dtype))
                    if reporter:
                        reporter.advance(stacked.numel() * stacked.element_size())
                    del stacked
                    continue
                name = arch.hf_name(hf_name)
                if name is None or name.endswith(_IGNORED_SUFFIXES):  # not the decoder's
                    continue
                if tied and name == "lm_head.weight":
                    # Tied: the head is the embedding. Stored alone it is loaded as the
                    # embedding; stored next to it, the embedding (loaded before or after) wins.
                    if "embed_tokens.weight" in seen:
                        continue
                    name = "embed_tokens.weight"
                if name not in expected and _is_unused_packed_bias(model, name):
                    # GPTQ exporters (AutoGPTQ, GPTQ-for-LLaMa) store a bias for every
                    # quantized projection, zeros where the model has none.
                    if torch.count_nonzero(f.get_tensor(hf_name)):
                        unexpected.append(f"{hf_name} (non-zero, the config has no such bias)")
                    continue
                if name not in expected:
                    unexpected.append(hf_name)
                    continue
                sl = f.get_slice(hf_name)
                shape = tuple(sl.get_shape())
                if shape != tuple(expected[name]):
                    wrong_shape.append(f"{hf_name} {shape} (expected {tuple(expected[name])})")
                    continue
                want = stored[name].dtype if name in stored else dtype
                if name in stored and sl.get_dtype() != _SAFETENSORS_NAMES.get(want):
                    wrong_dtype.append(f"{hf_name} {sl.get_dtype()} (expected {want})")
                    continue
                if name not in stored and sl.get_dtype() not in _FLOAT_NAMES:
                    wrong_dtype.append(f"{hf_name} {sl.get_dtype()} (expected F32, F16 or BF16)")
                    continue
                seen.add(name)
                if name in quantized_on_load:
                    weight = f.get_tensor(hf_name).to(device=device)
                    quantized_on_load[name].quantize_from(weight)
                    if reporter:
                        reporter.advance(weight.numel() * weight.element_size())
                    del weight
                    continue
                if name in parts:
                    fused = parts[name][0]
                    if skip is not None and skip(fused):
                        # Read by the disk tier, part by part: only its shape and dtype here.
                        shape = model.get_parameter(fused).shape
                        _assign(model, fused, torch.empty(shape, dtype=want, device="meta"))
                        continue
                    part = f.get_tensor(hf_name)
                    _load_part(model, parts[name], part, device, want)
                    if reporter:
                        reporter.advance(part.numel() * part.element_size())
                    del part
                    continue
                if skip is not None and skip(name):
                    if name.endswith(".g_idx"):  # a few KB: checked as a loaded layer's is
                        check_group_index(model, name, f.get_tensor(hf_name), path)
                    _assign(model, name, torch.empty(shape, dtype=want, device="meta"))
                    continue
                tensor = f.get_tensor(hf_name).to(device=device, dtype=want)
                _assign(model, name, tensor)
                if reporter:
                    reporter.advance(tensor.numel() * tensor.element_size())
    if reporter:
        reporter.done()
    missing = sorted(set(expected) - seen)
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(_hf_names(missing)))
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(sorted(unexpected)))
    if wrong_shape:
        problems.append("wrongly shaped tensors: " + "; ".join(wrong_shape))
    if wrong_dtype:
        problems.append("tensors of another dtype: " + "; ".join(wrong_dtype))
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    check_packed_layers(model, path)
    if relayout and skip is None:
        assert spec is not None
        to_blocks(model, path, spec)
    model.set_rope(device)
    return model.eval()


def _load_part(
    model: nn.Module,
    where: tuple[str, int, int],
    tensor: torch.Tensor,
    device: torch.device | str,
    dtype: torch.dtype,
) -> None:
    """Copy one stored projection into its rows of the stacked tensor, which the first
    part to arrive allocates. Peak: the stacked tensor and the one part being copied."""
    fused, row, end = where
    stacked: torch.Tensor = model.get_parameter(fused)
    if stacked.is_meta:  # the model was built on the meta device: this is the first part
        stacked = torch.empty(stacked.shape, dtype=dtype, device=device)
        _assign(model, fused, stacked)
    with torch.no_grad():
        stacked[row:end].copy_(tensor)


def _hf_names(names: list[str]) -> list[str]:
    return [n if n.startswith("lm_head") else f"model.{n}" for n in names]


def _stored_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The persistent buffers (a checkpoint stores them; RoPE tables are recomputed)."""
    return [
        (f"{owner}.{name}" if owner else name, buf)
        for owner, module in model.named_modules()
        for name, buf in module._buffers.items()
        if buf is not None and name not in module._non_persistent_buffers_set
    ]


def _is_unused_packed_bias(model: nn.Module, name: str) -> bool:
    owner_name, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return False
    return attr == "bias" and isinstance(owner, PackedLinear) and owner.bias is None


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if attr in owner._buffers:
        owner._buffers[attr] = tensor
    else:
        owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


class _Progress:
    """A one-line byte counter on stderr for loads that take a while."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done_bytes = total, label, 0
        self.last = 0.0

    def advance(self, n: int) -> None:
        self.done_bytes += n
        now = time.monotonic()
        if now - self.last > 0.2:
            self.last = now
            pct = 100 * self.done_bytes / max(self.total, 1)
            gb = self.done_bytes / 1e9
            print(f"\rloading {self.label}: {gb:.2f} GB ({pct:.0f}%)", end="", file=sys.stderr)

    def done(self) -> None:
        print(f"\rloading {self.label}: {self.total / 1e9:.2f} GB (100%)", file=sys.stderr)
