"""Real-shaped random-weight models: the layer shapes and vocabularies of the models specd is
for (Llama-3.1-8B/70B, Qwen2.5-72B and their drafts), with as few layers as asked.

Everything that grows with the vocabulary (logits, draws, the prefix cache) or the width
(activations, KV) is then exercised at its real size, in seconds instead of hours of
downloads. Weights are random and built on the fly, never committed:

    config = model_config("llama-3.1-70b", layers=1)           # speculative ModelConfig
    model = build_model(config, torch.bfloat16, "cuda")        # random Transformer
    write_folder(config, "/tmp/x")  # Hugging Face layout + a tokenizer.json of that vocab

`hidden_scale` shrinks the width for CPU runs (same vocabulary, same head counts, head
dimension and intermediate size scaled), so a 128k-vocabulary tree round fits a laptop.

    python scripts/real_shapes.py OUT_DIR --preset llama-3.2-1b --layers 1 --hidden-scale 0.05
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's packages first, also when run as a script

from modeling.config import ModelConfig, RopeConfig  # noqa: E402
from modeling.decoder import Transformer  # noqa: E402
from modeling.weights.projections import stored_state  # noqa: E402

_LLAMA31_ROPE = RopeConfig(
    theta=500000.0,
    kind="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
_LLAMA32_ROPE = replace(_LLAMA31_ROPE, factor=32.0)
_QWEN25_ROPE = RopeConfig(theta=1000000.0, original_max_position_embeddings=32768)


@dataclass(frozen=True)
class Shape:
    """The published config.json figures of one model that size its memory."""

    model_type: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope: RopeConfig
    num_layers: int  # the real model's depth (presets are built with fewer)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    rms_norm_eps: float = 1e-5
    bos_token_id: int = 1
    eos_token_id: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# fmt: off
PRESETS: dict[str, Shape] = {
    "llama-3.1-8b": Shape("llama", 4096, 32, 8, 14336, 128256, 131072, _LLAMA31_ROPE, 32),
    "llama-3.1-70b": Shape("llama", 8192, 64, 8, 28672, 128256, 131072, _LLAMA31_ROPE, 80),
    "qwen2.5-72b": Shape(
        "qwen2", 8192, 64, 8, 29568, 152064, 32768, _QWEN25_ROPE, 80,
        qkv_bias=True, rms_norm_eps=1e-6,
    ),
    "qwen2.5-14b": Shape(
        "qwen2", 5120, 40, 8, 13824, 152064, 32768, _QWEN25_ROPE, 48,
        qkv_bias=True, rms_norm_eps=1e-6,
    ),
    "qwen2.5-32b": Shape(
        "qwen2", 5120, 40, 8, 27648, 152064, 32768, _QWEN25_ROPE, 64,
    ),
    "llama-3.2-1b": Shape(
        "llama", 2048, 32, 8, 8192, 128256, 131072, _LLAMA32_ROPE, 16, tie_word_embeddings=True
    ),
    "qwen2.5-0.5b": Shape(
        "qwen2", 896, 14, 2, 4864, 151936, 32768, _QWEN25_ROPE, 24,
        tie_word_embeddings=True, qkv_bias=True, rms_norm_eps=1e-6,
    ),
}
# fmt: on

# Target → the draft it is served with (the same tokenizer family).
PAIRS: dict[str, str] = {
    "llama-3.1-8b": "llama-3.2-1b",
    "llama-3.1-70b": "llama-3.2-1b",
    "qwen2.5-72b": "qwen2.5-0.5b",
}


def model_config(preset: str, layers: int = 1, hidden_scale: float = 1.0) -> ModelConfig:
    """The preset's ModelConfig with `layers` decoder layers. `hidden_scale` < 1 keeps the
    vocabulary and the head counts (so GQA grouping and per-head attention are real) and
    scales the head dimension (kept even for RoPE) and the MLP width."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if not 0 < hidden_scale <= 1:
        raise ValueError(f"hidden_scale must be in (0, 1], got {hidden_scale}")
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    s = PRESETS[preset]
    head_dim = max(2, 2 * round(s.head_dim * hidden_scale / 2))
    intermediate = max(8, math.ceil(s.intermediate_size * hidden_scale))
    return ModelConfig(
        model_type=s.model_type,
        vocab_size=s.vocab_size,
        hidden_size=s.num_heads * head_dim,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=s.rms_norm_eps,
        max_position_embeddings=s.max_position_embeddings,
        rope=s.rope,
        tie_word_embeddings=s.tie_word_embeddings,
        qkv_bias=s.qkv_bias,
        bos_token_id=s.bos_token_id,
        eos_token_ids=(s.eos_token_id,),
    )


def full_config(preset: str) -> ModelConfig:
    """The preset at its real depth and width, as its published checkpoint declares it
    (bf16): what plans for the real model are made from (nothing is ever built from it)."""
    config = model_config(preset, layers=PRESETS[preset].num_layers)
    return replace(config, torch_dtype="bfloat16")


@torch.no_grad()
def build_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    init_std: float | None = None,
) -> Transformer:
    """A random Transformer materialised straight on `device` in `dtype` (no fp32 copy on
    the host first, so a full-width 70B layer goes to a GPU without 2x host memory).
    Linear weights ~ N(0, init_std²), init_std defaulting to 1/sqrt(fan-in) so activations
    keep their scale through the layers and logits are peaked enough to look model-like."""
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.normal_(1.0, 0.1, generator=gen)
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.1, generator=gen)
        elif name == "embed_tokens.weight":
            p.normal_(0.0, 1.0, generator=gen)
        else:
            std = init_std if init_std is not None else p.shape[-1] ** -0.5
            p.normal_(0.0, std, generator=gen)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.set_rope(device)
    return model.eval()


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """config.json for `config`, as transformers writes it for these families."""
    rope = config.rope
    raw: dict[str, Any] = {
        "architectures": [
            "Qwen2ForCausalLM" if config.model_type == "qwen2" else "LlamaForCausalLM"
        ],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": rope.theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
    }
    if rope.kind == "llama3":
        raw["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    if config.model_type == "qwen2":
        raw["use_sliding_window"] = False
    if config.torch_dtype is not None:
        raw["torch_dtype"] = config.torch_dtype
    return raw


def write_folder(
    config: ModelConfig, path: str | Path, model: Transformer | None = None, seed: int = 0
) -> Path:
    """A loadable Hugging Face folder: config.json, model.safetensors (random weights, or
    `model`'s), tokenizer.json with exactly `config.vocab_size` entries, tokenizer_config."""
    from safetensors.torch import save_file

    from scripts.tiny_models import build_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model is None:
        model = build_model(config, seed=seed)
    tensors = {}
    for name, tensor in stored_state(model).items():  # q/k/v, gate/up as stored apart
        if name == "inv_freq" or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        hf_name = name if name.startswith("lm_head") else f"model.{name}"
        tensors[hf_name] = tensor.detach().to("cpu").contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(config), indent=2))
    build_tokenizer(config.vocab_size).save(str(path / "tokenizer.json"))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "model_max_length": config.max_position_embeddings,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--hidden-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    config = model_config(args.preset, args.layers, args.hidden_scale)
    print(write_folder(config, args.out, seed=args.seed))


if __name__ == "__main__":
    main()
