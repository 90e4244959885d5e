"""Checkpoints: a local Hugging Face folder, a hub id, a GGUF file or a model store's
reference → config, weights, tokenizer. `open_checkpoint` reads the metadata only (enough
to plan before anything is loaded); `load` loads the model and its tokenizer, a folder's
weights through modeling/checkpoints/safetensors_model.py and a GGUF file's through
modeling/checkpoints/gguf_model.py.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from modeling.checkpoints.folder_files import (
    DAMAGED,
    CheckpointError,
    indexed_shards,
    read_json_object,
    refuse_irregular,
)
from modeling.checkpoints.gguf_config import config_from_gguf
from modeling.checkpoints.gguf_file import GGUFContents, short_repr
from modeling.checkpoints.gguf_model import (
    check_gguf_tensors,
    is_gguf,
    load_gguf_model,
    open_gguf,
)
from modeling.checkpoints.hub_patterns import CHECKPOINT_FILES, CONFIG_FILES, SKIPPED_FILES
from modeling.checkpoints.model_stores import resolve_store_ref
from modeling.checkpoints.safetensors_model import load_model, weight_files
from modeling.checkpoints.tied_head import stored_head_differs
from modeling.config import ModelConfig, UnsupportedModelError
from modeling.decoder import Transformer
from modeling.models import config_from_hf
from modeling.text.gguf_tokenizer import check_tokenizer_metadata, tokenizer_from_gguf
from modeling.text.model_template import (
    compile_chat_template,
    folder_chat_template,
    tokenizer_config,
)
from modeling.text.tokenizer import Tokenizer
from modeling.text.tokenizer_file import MAX_VOCABULARY
from modeling.weights.quant import (
    UnsupportedQuantizationError,
    laid_out_for,
    on_load_quantization,
)

log = logging.getLogger("specd.checkpoint")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# --dtype / models.dtype: one of DTYPES, or auto (see `dtype_candidates`).
DTYPE_CHOICES = ("auto", *DTYPES)
# What Tokenizer.from_folder reads, each only if it is there.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class ModelNotFoundError(FileNotFoundError):
    """A model reference that is neither a usable folder nor a reachable hub id."""


class NotCachedError(ModelNotFoundError):
    """A hub id (`ref`) that is not in the local Hugging Face cache and cannot be downloaded
    now."""

    def __init__(self, message: str, ref: str, config_only: bool) -> None:
        super().__init__(message)
        self.ref = ref
        self.config_only = config_only

    def naming_also(self, refs: Iterable[str | os.PathLike[str] | None]) -> NotCachedError:
        """This error, naming the others of `refs` (a target and its draft) that are not in
        the cache either: a profile's target and draft, both missing offline, were named
        one at a time (and `plan` and `start` named different ones first)."""
        others = [
            text
            for ref in dict.fromkeys(refs)
            if ref is not None
            and (text := str(ref)) != self.ref
            and not on_this_machine(text)
            and not in_hub_cache(text)
        ]
        if not others:
            return self
        flag = "--config-only " if self.config_only else ""
        pulls = "; ".join(f"nor is {ref!r} (`specd pull {flag}{ref}`)" for ref in others)
        return NotCachedError(f"{self}; {pulls}", self.ref, self.config_only)


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
        refuse_irregular(path / "config.json")
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a folder but has no config.json: not a model folder"
            )
        return path
    text = str(ref)
    if path.suffix.lower() == ".gguf":  # a file meant, never a hub id: say what is wrong
        if not path.exists():
            raise ModelNotFoundError(
                f"model file {path} does not exist: check the path (`specd models` lists "
                "the models on this machine)"
            )
        raise ModelNotFoundError(f"model file {path} is not a regular file")
    if path.exists() or not _hub_id_shaped(text):
        raise ModelNotFoundError(
            f"model {text!r} not found: give a Hugging Face model folder, a .gguf file, a "
            "hub id like 'org/name', or a store's model (ollama:NAME, lmstudio:PUB/REPO; "
            "`specd models` lists them)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = CONFIG_FILES if config_only else CHECKPOINT_FILES
    try:
        return Path(
            snapshot_download(repo_id=text, allow_patterns=patterns, ignore_patterns=SKIPPED_FILES)
        )
    except LocalEntryNotFoundError as exc:
        pull = f"specd pull --config-only {text}" if config_only else f"specd pull {text}"
        raise NotCachedError(
            f"model {text!r} is not in the local Hugging Face cache and cannot be downloaded "
            f"now (offline, or the hub is unreachable): run `{pull}` where the hub "
            f"is reachable, or point --model at a local folder",
            text,
            config_only,
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"model {text!r} could not be fetched from the hub: {first}"
        ) from exc


def in_hub_cache(ref: str) -> bool:
    """Whether the hub id `ref` has a snapshot in the local Hugging Face cache (nothing is
    downloaded to find out)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot_download(repo_id=ref, allow_patterns=CONFIG_FILES, local_files_only=True)
    except LocalEntryNotFoundError:
        return False
    except (OSError, ValueError):
        return True  # (not known to be missing: the error `resolve` gives says what is wrong)
    return True


def on_this_machine(ref: str | os.PathLike[str]) -> bool:
    """Whether `ref` names a model on this machine (a folder, a GGUF file, a model store's
    reference), or can only mean one (a path), rather than a hub id, whose files resolving
    may download."""
    if resolve_store_ref(str(ref)) is not None or Path(ref).expanduser().exists():
        return True
    return not _hub_id_shaped(str(ref))


def _hub_id_shaped(text: str) -> bool:
    """'org/name': what `resolve` asks the hub for (a path or a .gguf file never is)."""
    return (
        Path(text).suffix.lower() != ".gguf"
        and not text.startswith((".", "/", "~"))
        and text.count("/") == 1
    )


def open_checkpoint(
    ref: str | os.PathLike[str],
    quantize: str | None = None,
    config_only: bool = False,
    verify: bool = True,
    compare_head: bool = True,
) -> Checkpoint:
    """Resolve and read the metadata only (config and generation defaults): cheap enough for
    planning before anything is loaded. `quantize` ("int8" | "int4"): a full-precision
    checkpoint's projections are to be quantized as they load (`on_load_quantization`);
    the config then describes the packed model, so the plan counts packed bytes.
    `config_only`: a hub id needs only its config files in the cache (see `resolve`).
    `verify`: the chat template and (GGUF) the tensor infos are checked as loading would,
    so `specd plan` refuses what loading would; False where the model is about to load
    (which checks them as it goes) or for a scan of many candidates (a 128-expert
    mixture's tensor infos take a second or two). `compare_head`: a config that ties the
    head beside a checkpoint that stores one is checked against it (`stored_head_differs`
    reads both: seconds at a 262k vocabulary); False where neither a plan nor a load
    follows (`specd models`, a scan of draft candidates, a check before start-up)."""
    store = resolve_store_ref(str(ref))  # read its manifest once
    path = store.path if store is not None else resolve(ref, config_only)
    if is_gguf(path):
        stop = store.stop if store is not None else []
        return _open_gguf_checkpoint(path, quantize, stop, verify)
    config_path, gen_path = path / "config.json", path / "generation_config.json"
    refuse_irregular(config_path, gen_path)  # a hub snapshot's too, not checked by resolve
    config = config_from_hf(read_json_object(config_path), source=str(config_path))
    _check_token_ids(config_path, "bos_token_id", config.bos_token_id, config)
    _check_token_ids(config_path, "eos_token_id", list(config.eos_token_ids), config)
    if quantize is not None:
        if config.quantization is not None:
            raise UnsupportedQuantizationError(
                f"{config_path}: --quantize {quantize}: the checkpoint is already quantized "
                f"({config.quantization.label}); it loads as it is, without --quantize"
            )
        config = replace(config, quantization=on_load_quantization(quantize))
    if compare_head and stored_head_differs(path, config):  # (where the weights are here)
        log.warning(
            "%s: tie_word_embeddings is true, but the checkpoint stores an lm_head.weight of "
            "its own with other values: the stored head is used (as transformers does); set "
            "tie_word_embeddings to false to say so",
            config_path,
        )
        config = replace(config, tie_word_embeddings=False)
    defaults = _generation_defaults(gen_path, config) if gen_path.is_file() else {}
    if verify:  # (its template compiles as loading compiles it: milliseconds)
        template, source = folder_chat_template(path, tokenizer_config(path))
        if template is not None:
            compile_chat_template(template, source)
        indexed_shards(path)  # (where there is an index: its shard names, not the shards)
    return Checkpoint(path=path, config=config, generation_defaults=defaults)


def _generation_defaults(file: Path, config: ModelConfig) -> dict[str, Any]:
    """generation_config.json, its `eos_token_id` (the one key read: one id or a list of
    them) checked to be ids of the model's vocabulary."""
    defaults = read_json_object(file)
    _check_token_ids(file, "eos_token_id", defaults.get("eos_token_id"), config)
    return defaults


def _check_token_ids(file: Path, key: str, value: Any, config: ModelConfig) -> None:
    """A CheckpointError naming `file` and `key` unless `value` is None, a token id of the
    model's vocabulary (a row of its embedding) or a list of them."""
    ids = value if isinstance(value, list) else [value] if value is not None else []
    if not all(type(i) is int and 0 <= i < config.vocab_size for i in ids):
        raise CheckpointError(
            f"{file}: {key} is {short_repr(value)}; it must be a token id below the model's "
            f"vocab_size {config.vocab_size}, or a list of them: {DAMAGED}"
        )


def _open_gguf_checkpoint(
    path: Path, quantize: str | None, stop: list[str], verify: bool = True
) -> Checkpoint:
    """A GGUF file's config from its metadata (modeling/checkpoints/gguf_config.py). `stop`: a model
    store's default stop strings (Ollama's params); those that are tokens of the
    vocabulary end a generation as its end-of-sequence tokens do."""
    if quantize is not None:
        raise UnsupportedQuantizationError(
            f"{path}: --quantize {quantize}: a GGUF file loads as it is stored, without --quantize"
        )
    contents = open_gguf(path)
    config = config_from_gguf(contents)
    # The tokenizer's keys too, though nothing here tokenizes: a plan refuses a file that
    # generation would, and the store's stop strings below are looked up in its tokens.
    check_tokenizer_metadata(contents.metadata, str(path))
    template = contents.metadata.get("tokenizer.chat_template")
    if verify and isinstance(template, str):  # (milliseconds; its type was checked above)
        compile_chat_template(template, f"{path}: tokenizer.chat_template")
    if verify:  # (no byte read: 55 ms for SmolLM2, ~2 s for a 128-expert mixture's layout)
        check_gguf_tensors(contents, config)
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
    caller decides that). A config without a known dtype is taken as fp32.

    A quantized GGUF file has no dtype of its own (its config's bf16 is what its blocks are
    decoded to on CUDA), so the reasons name the tensor types it stores instead; a float
    GGUF's dtype is its tensors', as a folder's is config.json's."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype {requested!r} is not one of {', '.join(DTYPE_CHOICES)}")
        return [(requested, "as requested")]
    stored = dtype_key(config.torch_dtype)
    if stored is None:
        return [("fp32", "auto: config.json names no dtype fp32, bf16 or fp16, so fp32")]
    own = f"auto: the checkpoint's dtype ({config.torch_dtype})"
    stored_as = f"the checkpoint is {stored}"
    packed = config.quantization
    if packed is not None and packed.method == "gguf":
        kinds = ", ".join(kind for kind, _ in packed.type_bytes) or packed.file_type
        stored_as = f"the GGUF file's layers are {kinds}"
        own = f"auto: {stored} for the GGUF file's {kinds} layers"
    if device_type != "cpu" or stored == "fp32":
        return [(stored, f"{own} on {device_type.upper()}")]
    return [
        ("fp32", f"auto: fp32 on the CPU, where the model fits in fp32 ({stored_as})"),
        (stored, f"{own}: in fp32 the model does not fit in the CPU's RAM budget"),
    ]


def load(
    ref: str | os.PathLike[str] | Checkpoint,
    dtype: str | torch.dtype = "fp32",
    device: torch.device | str = "cpu",
    skip: Callable[[str], bool] | None = None,
    quantize: str | None = None,
    computes_on: torch.device | str | None = None,
) -> tuple[Transformer, Tokenizer, Checkpoint]:
    """Everything needed to generate from one model reference (see `load_model` for `skip`,
    `open_checkpoint` for `quantize`). A Checkpoint already opened (to plan) is used as it
    is, quantization included (its `quantize` was given to open_checkpoint; giving one here
    too is an error): resolving a hub id again costs the hub's round trips. `computes_on`:
    where the model will compute, when that is not `device` (a streamed target loads into
    RAM for a GPU): `--quantize`'s layout follows it (`laid_out_for`)."""
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
        contents = ckpt.gguf or open_gguf(ckpt.path)
        tokenizer = load_tokenizer(ckpt)
        return load_gguf_model(contents, ckpt.config, dtype, device, skip), tokenizer, ckpt
    tokenizer = load_tokenizer(ckpt)
    spec = laid_out_for(ckpt.config.quantization, dtype, computes_on or device)
    config = replace(ckpt.config, quantization=spec)
    model = load_model(ckpt.path, config, dtype=dtype, device=device, skip=skip)
    return model, tokenizer, ckpt


def has_tokenizer(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint's tokenizer is at hand: a GGUF file's always is; a folder's
    where it holds tokenizer.json (a folder of config.json alone is planned without)."""
    return is_gguf(ckpt.path) or (ckpt.path / "tokenizer.json").is_file()


def load_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    """The checkpoint's tokenizer alone (no weights): a GGUF file's from its metadata, with a
    store's stop tokens; a folder's from its tokenizer files."""
    if is_gguf(ckpt.path):
        contents = ckpt.gguf or open_gguf(ckpt.path)
        tokenizer = tokenizer_from_gguf(contents.metadata, str(ckpt.path))
        stops = ckpt.generation_defaults.get("eos_token_id") or []  # a store's stop tokens
        tokenizer.eos_token_ids = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *stops]))
        source = f"{ckpt.path}: tokenizer.ggml.tokens"  # (their count bounded as they are read)
    else:
        refuse_irregular(*(ckpt.path / name for name in TOKENIZER_FILES))
        tokenizer = Tokenizer.from_folder(ckpt.path, ckpt.config, ckpt.generation_defaults)
        source = str(ckpt.path / "tokenizer.json")
        count = tokenizer.vocab_size  # (counted by the library: no dict built yet)
        if not 0 < count <= MAX_VOCABULARY:
            raise CheckpointError(
                f"{source}: the vocabulary holds {count:,} tokens; specd reads vocabularies "
                f"of 1 to {MAX_VOCABULARY:,} (the largest real one has 262,144): {DAMAGED}"
            )
    _check_embeddings_cover(tokenizer, ckpt.config, source)
    return tokenizer


def _check_embeddings_cover(tokenizer: Tokenizer, config: ModelConfig, source: str) -> None:
    """Every id the tokenizer can produce must have a row of the embedding (config's
    vocab_size, which the weights are checked against): a token past it would index out of
    the table at the first prompt that holds it, in the middle of a request."""
    rows, count = config.vocab_size, tokenizer.vocab_size
    if count > rows:  # (counted without the id → token dict: 1.5 GB for 3M tokens)
        raise CheckpointError(
            f"{source}: the tokenizer holds {count:,} tokens but the model has {rows:,} "
            f"embedding rows: the tokenizer is not this model's; {DAMAGED}"
        )
    need = tokenizer.id_limit
    if need > rows:
        raise CheckpointError(
            f"{source}: the tokenizer produces ids up to {need - 1:,} but the model has "
            f"{rows:,} embedding rows: the tokenizer is not this model's; {DAMAGED}"
        )


__all__ = [
    "DTYPES",
    "DTYPE_CHOICES",
    "Checkpoint",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "dtype_candidates",
    "dtype_key",
    "has_tokenizer",
    "load",
    "load_tokenizer",
    "on_this_machine",
    "open_checkpoint",
    "resolve",
]
