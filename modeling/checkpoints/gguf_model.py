"""GGUF files (llama.cpp's format; what Ollama and LM Studio keep): recognized, opened, and
their tensors loaded into our decoder as they are stored.

The header is read by modeling/checkpoints/gguf_file.py over a memory map (gguf-py's reader parses
every metadata string in Python: seconds for a 128k vocabulary); each tensor is copied
from the map into the model as it loads. Quantized projections stay in their blocks
(`GGUFLinear`, rebuilt per pass like the other packed formats), and so does an untied
quantized embedding (`GGUFEmbedding`); a file whose projections are all float (F32, F16,
BF16) loads as a dense model. The output matrix (and a tied embedding) is decoded once, at
load, into the compute dtype. Llama's converter permutes the rows of q and k for
llama.cpp's rotary layout (pairs of adjacent values); they are put back in Hugging Face's
order (halves), whole rows, so the blocks need no decoding for it.

A file is taken as hostile: its config is built and checked from the metadata by
modeling/checkpoints/gguf_config.py, and here a tensor's shape is checked before its bytes are copied.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from math import prod
from pathlib import Path

import numpy as np
import torch
from torch import nn

from modeling.architecture import Architecture
from modeling.checkpoints.gguf_file import (
    GGUFContents,
    GGUFFormatError,
    TensorInfo,
    open_regular,
    read_gguf,
)
from modeling.config import ModelConfig
from modeling.decoder import Transformer
from modeling.models import architecture
from modeling.weights import cpu_kernels
from modeling.weights.gguf_blocks import dequantize
from modeling.weights.gguf_modules import GGUFEmbedding, GGUFLinear
from modeling.weights.projections import fused_parts
from modeling.weights.quant import EMBEDDING

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
    """The file's header read (modeling/checkpoints/gguf_file.py; its tensors stay in the memory
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


def our_name(name: str, arch: Architecture) -> str | None:
    """A GGUF tensor name → ours, by `arch`'s name maps; None for one it does not have."""
    return arch.gguf_name(name)


def gguf_parts(
    info: TensorInfo, arch: Architecture, experts: int
) -> list[tuple[str | None, int, int, tuple[int, ...]]]:
    """The tensors of ours that the GGUF tensor `info` holds, each as (our name, None for
    one `arch` does not have; its first and end row among the stored rows; its shape as
    the file would list it alone): the tensor itself, or for a stacked expert tensor
    (ne = [columns, rows, experts]) one slice per expert, `experts` of them (a stack of
    another count is not ours: nothing is looped over on a file's word)."""
    expert = arch.gguf_expert(info.name)
    if expert is None:
        return [(our_name(info.name, arch), 0, prod(info.ne[1:]), info.ne)]
    layer, part, attr = expert
    dims = 3 if attr == "weight" else 2  # a bias: [rows, experts], one row of values each
    if len(info.ne) != dims or info.ne[-1] != experts:
        return [(None, 0, 0, info.ne)]
    rows = info.ne[1] if attr == "weight" else 1
    return [
        (f"layers.{layer}.mlp.experts.{e}.{part}.{attr}", e * rows, (e + 1) * rows,
         info.ne[: dims - 1])
        for e in range(experts)
    ]  # fmt: skip


def check_gguf_tensors(contents: GGUFContents, cfg: ModelConfig) -> None:
    """GGUFError for what `load_gguf_model` would refuse in the file's tensors (missing or
    unexpected ones, a shape or type the metadata does not give), from their infos alone:
    no byte is read. `specd plan` refuses a file as loading would."""
    _tensors(contents, cfg, torch.float32, "meta", check_only=True)


def load_gguf_model(
    contents: GGUFContents,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    skip: Callable[[str], bool] | None = None,
) -> Transformer:
    """The decoder of `cfg` with every tensor of the GGUF file at `path` in place: float
    tensors in `dtype`, quantized projections as their blocks. Missing or unexpected
    tensors, or a shape that does not match the metadata, are a GGUFError. A tensor
    `skip(name)` names (ours; a layer the disk tier reads, `gguf_disk_sources`) is checked
    and left on the meta device in its shape and dtype, its bytes unread."""
    return _tensors(contents, cfg, dtype, device, skip=skip)


def _tensors(
    contents: GGUFContents,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    check_only: bool = False,
    skip: Callable[[str], bool] | None = None,
) -> Transformer:
    """`load_gguf_model`; `check_only`: its checks alone (the model stays on meta)."""
    path = contents.path
    arch = architecture(cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    parts = fused_parts(model)
    fused = {where[0] for where in parts.values()}
    expected = {n for n, _ in model.named_parameters() if n not in fused} | set(parts)
    expected |= {n for n, _ in model.named_buffers() if n.endswith(".blocks")}
    seen: set[str] = set()
    problems: list[str] = []
    factors = None
    spec = cfg.quantization
    # The output matrix (the embedding, tied) stays its blocks where the CPU kernels compute
    # it: a 49k x 576 Q4_1 head reads 18 MB a token instead of its 113 MB as fp32.
    packed_head = keeps_head_packed(cfg, dtype, device)
    for info in contents.tensors:
        if info.name == ROPE_FACTORS:
            if info.ggml_type != 0 or info.ne != ((cfg.head_dim + 1) // 2,):
                problems.append(f"{info.name}: {info.ne} of type {info.ggml_type}, not F32 [hd/2]")
                continue
            # (a few dozen floats, read at open: zero or NaN divisors made every logit NaN
            # at the first pass, which named neither the file nor the tensor)
            values = contents.tensor_bytes(info).view(np.float32)
            if not (np.isfinite(values).all() and (values > 0).all()):
                problems.append(f"{info.name}: holds a value that is not a finite number above 0")
                continue
            if check_only:
                continue
            factors = torch.from_numpy(values.copy()).reshape(-1)  # (hd/2,)
            continue
        if info.name in arch.gguf_config_tensors:
            continue  # read into the config (modeling/checkpoints/gguf_config.py)
        kind = info.ggml_type
        experts = cfg.moe.experts if cfg.moe is not None else 0
        for name, first, end, ne in gguf_parts(info, arch, experts):
            if name is None:
                problems.append(f"unexpected tensor {info.name}")
                continue
            # The shape is checked before the bytes are copied: a hostile file's tensor may
            # be far larger than the model its metadata describes.
            stored = contents.tensor_bytes(info)[first:end]  # (rows, row bytes), a view
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
            elif (shape := _parameter_shape(model, name, parts)) != tuple(reversed(ne)):
                problems.append(f"{name}: shape {tuple(reversed(ne))}, not {shape}")
                continue
            if check_only or (skip is not None and skip(name)):
                if not check_only and module is None:  # read by the disk tier: its shape here
                    shape = _parameter_shape(model, name, parts)
                    _place(model, name, torch.empty(shape or (), dtype=dtype, device="meta"),
                           parts, problems)  # fmt: skip
                seen.add(packed if module is not None else name)
                continue
            rows = arch.gguf_tensor(cfg, name, torch.from_numpy(stored.copy()), ne)
            head = name == "lm_head.weight" or (name == EMBEDDING and cfg.tie_word_embeddings)
            if module is None and head and packed_head and kind == spec.head_type:  # type: ignore[union-attr]
                # (a head whose type is not the one recorded is decoded: the file lied)
                pack_head(model, rows.to(device), kind, cfg)
                seen.add(name)
                continue
            value = held(cfg, name, rows, kind, ne, module, dtype, device)
            if module is not None:
                module._buffers["blocks"] = value
                seen.add(packed)
                continue
            _place(model, name, value, parts, problems)
            seen.add(name)
    missing = sorted(expected - seen - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing:
        problems.append("missing tensors: " + ", ".join(missing[:8]))
    if problems:
        raise GGUFError(f"{path}: " + "; ".join(problems[:8]))
    if check_only:
        return model
    if cfg.tie_word_embeddings and not isinstance(model.lm_head, GGUFLinear):
        model.lm_head.weight = model.embed_tokens.weight
    model.set_rope(device, factors)  # llama.cpp divides each frequency by its factor
    return model.eval()


def held(
    cfg: ModelConfig,
    name: str,
    rows: torch.Tensor,
    kind: int,
    ne: tuple[int, ...],
    module: nn.Module | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A GGUF tensor's rows (`arch.gguf_tensor`'s order) as the model holds them: a packed
    `module`'s blocks (in the room its widest layer's type needs), or a float tensor
    decoded to `dtype`. The loader's and the disk tier's one conversion."""
    if module is not None:
        blocks = module.get_buffer("blocks")
        if rows.shape[1] != blocks.shape[1]:  # room for another layer's type
            room = torch.zeros(blocks.shape, dtype=torch.uint8)
            room.view(-1)[: rows.numel()].copy_(rows.reshape(-1))
            rows = room
        return rows.to(device)
    # Decoded a chunk at a time in fp32 and rounded once to `dtype`: no fp32 copy of a
    # whole embedding (4.2 GB for a 70B's).
    offset = architecture(cfg).gguf_offset(cfg, name)
    if offset:  # taken off before the value is rounded to `dtype`
        value = (dequantize(rows.to(device), kind, ne[0], torch.float32) - offset).to(dtype)
    else:
        value = dequantize(rows.to(device), kind, ne[0], dtype)
    return value.view(-1) if len(ne) == 1 else value


def keeps_head_packed(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether loading keeps a GGUF model's output matrix as its blocks (`pack_head`): its
    type has a CPU kernel, and the model computes in fp32 on the CPU."""
    spec = cfg.quantization
    return (
        spec is not None
        and spec.method == "gguf"
        and cpu_kernels.computes(spec.head_type, dtype, device)
    )


def pack_head(model: Transformer, rows: torch.Tensor, kind: int, cfg: ModelConfig) -> None:
    """The output matrix as its blocks `rows` (vocab, row_bytes): a `GGUFLinear` head, and
    where the embedding is tied a `GGUFEmbedding` over the same bytes."""
    with torch.device("meta"):  # (their buffers are `rows`: nothing allocated for them)
        head = GGUFLinear(cfg.hidden_size, cfg.vocab_size, False, kind)
        table = GGUFEmbedding(cfg.vocab_size, cfg.hidden_size, kind)
    head._buffers["blocks"] = rows
    model.lm_head = head
    if cfg.tie_word_embeddings:
        table._buffers["blocks"] = rows
        model.embed_tokens = table


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
