"""Checkpoints: a local Hugging Face folder or a hub id → config, weights, tokenizer.

Weights are read tensor by tensor from memory-mapped safetensors into a model built on the
meta device, so loading never holds a second full copy of the weights.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from speculative.config import ModelConfig, UnsupportedModelError
from speculative.gguf_file import GGUFContents
from speculative.gguf_model import config_from_gguf, is_gguf, load_gguf_model, open_gguf
from speculative.gguf_tokenizer import tokenizer_from_gguf
from speculative.model import Transformer, rope_inv_freq
from speculative.model_stores import resolve_store_ref
from speculative.packed import CompressedLinear, PackedLinear
from speculative.projections import fused_parts
from speculative.quant import (
    UnsupportedQuantizationError,
    on_load_quantization,
)
from speculative.tokenizer import Tokenizer

log = logging.getLogger("specd.checkpoint")

# The safetensors names of the dtypes packed tensors are stored in.
_SAFETENSORS_NAMES = {
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# --dtype / models.dtype: one of DTYPES, or auto (see `dtype_candidates`).
DTYPE_CHOICES = ("auto", *DTYPES)
_WEIGHT_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
# What planning reads: a plan needs no weights (`specd plan`, `specd pull --config-only`).
CONFIG_FILES = ["config.json", "generation_config.json"]
# Buffers some exporters store that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ModelNotFoundError(FileNotFoundError):
    """A model reference that is neither a usable folder nor a reachable hub id."""


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match its config (missing, unexpected, wrong shape)."""


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    generation_defaults: dict[str, Any]
    # A GGUF file's header, read once (its tensors mapped); not part of the identity.
    gguf: GGUFContents | None = field(default=None, compare=False, repr=False)

    def weight_files(self) -> list[Path]:
        return weight_files(self.path)


def resolve(ref: str | os.PathLike[str], config_only: bool = False) -> Path:
    """A local folder, or a hub id downloaded into (or found in) the huggingface_hub cache.
    `HF_HUB_OFFLINE=1` is honoured: only the cache is consulted. `config_only`: only the
    config files are fetched (enough to plan for a download not made yet)."""
    store = resolve_store_ref(str(ref))  # ollama:NAME[:TAG], lmstudio:PUBLISHER/REPO[/FILE]
    if store is not None:
        return store.path
    path = Path(ref).expanduser()
    if is_gguf(path):
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a folder but has no config.json: not a model folder"
            )
        return path
    text = str(ref)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ModelNotFoundError(
            f"model {text!r} not found: give a Hugging Face model folder or a hub id like 'org/name'"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = CONFIG_FILES if config_only else _WEIGHT_PATTERNS
    try:
        return Path(snapshot_download(repo_id=text, allow_patterns=patterns))
    except LocalEntryNotFoundError as exc:
        pull = f"specd pull --config-only {text}" if config_only else f"specd pull {text}"
        raise ModelNotFoundError(
            f"model {text!r} is not in the local Hugging Face cache and cannot be downloaded "
            f"now (offline, or the hub is unreachable): run `{pull}` where the hub "
            f"is reachable, or point --model at a local folder"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"model {text!r} could not be fetched from the hub: {first}"
        ) from exc


def open_checkpoint(
    ref: str | os.PathLike[str], quantize: str | None = None, config_only: bool = False
) -> Checkpoint:
    """Resolve and read the metadata only (config and generation defaults): cheap enough for
    planning before anything is loaded. `quantize` ("int8" | "int4"): a full-precision
    checkpoint's projections are to be quantized as they load (`on_load_quantization`);
    the config then describes the packed model, so the plan counts packed bytes.
    `config_only`: a hub id needs only its config files in the cache (see `resolve`)."""
    store = resolve_store_ref(str(ref))  # read its manifest once
    path = store.path if store is not None else resolve(ref, config_only)
    if is_gguf(path):
        return _open_gguf_checkpoint(path, quantize, store.stop if store is not None else [])
    config_path = path / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelNotFoundError(f"{config_path}: cannot read config ({exc})") from exc
    config = ModelConfig.from_hf(raw, source=str(config_path))
    if quantize is not None:
        if config.quantization is not None:
            raise UnsupportedQuantizationError(
                f"{config_path}: --quantize {quantize}: the checkpoint is already quantized "
                f"({config.quantization.label}); it loads as it is, without --quantize"
            )
        config = replace(config, quantization=on_load_quantization(quantize))
    gen_path = path / "generation_config.json"
    defaults = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return Checkpoint(path=path, config=config, generation_defaults=defaults)


def _open_gguf_checkpoint(path: Path, quantize: str | None, stop: list[str]) -> Checkpoint:
    """A GGUF file's config from its metadata (speculative/gguf_model.py). `stop`: a model
    store's default stop strings (Ollama's params); those that are tokens of the
    vocabulary end a generation as its end-of-sequence tokens do."""
    if quantize is not None:
        raise UnsupportedQuantizationError(
            f"{path}: --quantize {quantize}: a GGUF file loads as it is stored, without --quantize"
        )
    contents = open_gguf(path)
    config = config_from_gguf(contents)
    tokens = (contents.metadata.get("tokenizer.ggml.tokens") or []) if stop else []
    vocabulary = {t: i for i, t in enumerate(tokens)}
    stops = [vocabulary[s] for s in stop if s in vocabulary]
    if len(stops) < len(stop):
        log.warning(
            "%s: the model store's stop strings %s are not tokens of the vocabulary; "
            "give them as a request's stop to use them",
            path, [s for s in stop if s not in vocabulary],
        )  # fmt: skip
    return Checkpoint(path, config, {"eos_token_id": stops}, gguf=contents)


def dtype_key(name: str | None) -> str | None:
    """'bfloat16' or 'torch.bfloat16' (as config.json and torch spell it) → 'bf16'; None
    for anything that is not one of DTYPES."""
    if not name:
        return None
    name = name.removeprefix("torch.")
    return next((key for key, dtype in DTYPES.items() if str(dtype) == f"torch.{name}"), None)


def dtype_candidates(
    requested: str, config: ModelConfig, device_type: str
) -> list[tuple[str, str]]:
    """The dtypes to try, best first, each with the reason it is chosen.

    A given dtype is the only candidate. `auto` is the checkpoint's own dtype (config.json's
    `torch_dtype`, or `dtype` in newer exports) on CUDA: widening bf16 weights to fp32
    doubles memory and transfers for no gain in what the checkpoint can express. On a CPU,
    where bf16 matmuls are slow and fp32 is what the reference computes, fp32 comes first
    and the checkpoint's dtype second, for when the model does not fit in RAM in fp32 (the
    caller decides that). A config without a known dtype is taken as fp32."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype {requested!r} is not one of {', '.join(DTYPE_CHOICES)}")
        return [(requested, "as requested")]
    stored = dtype_key(config.torch_dtype)
    if stored is None:
        return [("fp32", "auto: config.json names no dtype fp32, bf16 or fp16, so fp32")]
    own = f"auto: the checkpoint's dtype (config.json: {config.torch_dtype})"
    if device_type != "cpu" or stored == "fp32":
        return [(stored, f"{own} on {device_type.upper()}")]
    return [
        (
            "fp32",
            f"auto: fp32 on the CPU, where the model fits in fp32 (the checkpoint is {stored})",
        ),
        (stored, f"{own}: in fp32 the model does not fit in the CPU's RAM budget"),
    ]


def weight_files(path: Path) -> list[Path]:
    if is_gguf(path):
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {', '.join(missing)}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" (found {', '.join(bins)}: convert to safetensors)" if bins else ""
        if ggufs:
            hint = f" (found {', '.join(ggufs)}: give --model the .gguf file itself)"
        raise CheckpointError(f"{path}: no *.safetensors weights{hint}")
    return files


def _hf_name_to_ours(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def load_model(
    checkpoint: Checkpoint,
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
    cfg = checkpoint.config
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name: p.shape for name, p in model.named_parameters()}  # tied: embed only
    # Dense q/k/v and gate/up are stored apart and held stacked: each stored part is
    # expected in its own shape and copied into its rows of the stacked tensor.
    parts = fused_parts(model)
    for part, (fused, row, end) in parts.items():
        expected.pop(fused, None)
        expected[part] = torch.Size((end - row, *model.get_parameter(fused).shape[1:]))
    # Packed projections' stored tensors (speculative/packed.py) are buffers kept in the
    # dtype the format stores them in; parameters take the compute dtype.
    stored = dict(_stored_buffers(model))
    expected.update({name: b.shape for name, b in stored.items()})
    # `--quantize`: the file holds full-precision projections, each packed as it is read.
    quantized_on_load: dict[str, CompressedLinear] = {}
    if cfg.quantization is not None and cfg.quantization.on_load:
        if skip is not None:
            raise CheckpointError(
                f"{checkpoint.path}: layers quantized on load live in RAM; the disk tier "
                "streams a checkpoint's own bytes (use a pre-quantized GPTQ, AWQ or "
                "compressed-tensors checkpoint to stream 4-bit layers from disk)"
            )
        for owner, module in model.named_modules():
            if isinstance(module, CompressedLinear):
                quantized_on_load[f"{owner}.weight"] = module
                for attr in ("weight_packed", "weight_scale", "weight_shape"):
                    del expected[f"{owner}.{attr}"], stored[f"{owner}.{attr}"]
                expected[f"{owner}.weight"] = torch.Size((module.out_features, module.in_features))
    tied = cfg.tie_word_embeddings
    files = weight_files(checkpoint.path)
    total = sum(f.stat().st_size for f in files)
    show = progress if progress is not None else (sys.stderr.isatty() and total > 256 * 2**20)
    reporter = _Progress(total, checkpoint.path.name) if show else None

    seen: set[str] = set()
    unexpected: list[str] = []
    wrong_shape: list[str] = []
    wrong_dtype: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = _hf_name_to_ours(hf_name)
                if name.endswith(_IGNORED_SUFFIXES):
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
        problems.append("packed tensors of another dtype: " + "; ".join(wrong_dtype))
    if problems:
        raise CheckpointError(f"{checkpoint.path}: " + "; ".join(problems))
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope).to(device)
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


def load(
    ref: str | os.PathLike[str] | Checkpoint,
    dtype: str | torch.dtype = "fp32",
    device: torch.device | str = "cpu",
    skip: Callable[[str], bool] | None = None,
    quantize: str | None = None,
) -> tuple[Transformer, Tokenizer, Checkpoint]:
    """Everything needed to generate from one model reference (see `load_model` for `skip`,
    `open_checkpoint` for `quantize`). A Checkpoint already opened (to plan) is used as it
    is, quantization included (its `quantize` was given to open_checkpoint; giving one here
    too is an error): resolving a hub id again costs the hub's round trips."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if isinstance(ref, Checkpoint):
        if quantize is not None:  # it was read when the checkpoint was opened
            raise ValueError("quantize goes to open_checkpoint, not to load(Checkpoint)")
        ckpt = ref
    else:
        ckpt = open_checkpoint(ref, quantize)
    if is_gguf(ckpt.path):
        if skip is not None:
            raise CheckpointError(
                f"{ckpt.path}: the disk tier does not read GGUF files yet; give the layers "
                "room in RAM (--ram-budget)"
            )
        contents = ckpt.gguf or open_gguf(ckpt.path)
        tokenizer = tokenizer_from_gguf(contents.metadata, str(ckpt.path))
        stops = ckpt.generation_defaults.get("eos_token_id") or []  # a store's stop tokens
        tokenizer.eos_token_ids = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *stops]))
        return load_gguf_model(contents, ckpt.config, dtype, device), tokenizer, ckpt
    tokenizer = Tokenizer.from_folder(ckpt.path, ckpt.config, ckpt.generation_defaults)
    model = load_model(ckpt, dtype=dtype, device=device, skip=skip)
    return model, tokenizer, ckpt


__all__ = [
    "DTYPES",
    "DTYPE_CHOICES",
    "Checkpoint",
    "CheckpointError",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "dtype_candidates",
    "dtype_key",
    "load",
    "load_model",
    "open_checkpoint",
    "resolve",
]
