"""Real-shaped random-weight models: the layer shapes and vocabularies of the models specd is
for (Llama-3.1-8B/70B, Qwen2.5-72B, Qwen3-8B/32B, Gemma-3-12B/27B and their drafts), with as
few layers as asked.

Everything that grows with the vocabulary (logits, draws, the prefix cache) or the width
(activations, KV) is then exercised at its real size, in seconds instead of hours of
downloads. Weights are random and built on the fly, never committed:

    config = model_config("llama-3.1-70b", layers=1)           # speculative ModelConfig
    model = build_model(config, torch.bfloat16, "cuda")        # random Transformer
    write_folder(config, "/tmp/x")  # Hugging Face layout + a tokenizer.json of that vocab

`hidden_scale` shrinks the width for CPU runs (same vocabulary, same head counts, head
dimension and intermediate size scaled), so a 128k-vocabulary tree round fits a laptop.

A preset's config goes through specd's own reader (`modeling.models.config_from_hf`) from
the config.json `hf_config` writes for it, so what the architecture module derives (Gemma's
(1 + w) norms, sqrt(hidden) embedding scale, GeGLU, local RoPE; Qwen3's q/k norms) is the
loader's, and a written folder loads to the same config. Gemma 3 keeps its sliding-window
layers: the real pattern (every sixth layer global), except that a preset built with fewer
layers than the pattern ends on the global layer, so two layers are one sliding and one
global.

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
from modeling.models import config_from_hf  # noqa: E402
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
_QWEN3_ROPE = RopeConfig(theta=1000000.0, original_max_position_embeddings=40960)
# Gemma 3's global layers (the 4B and larger with a linear factor of 8); its sliding layers
# rotate by a base of 10,000 (`Gemma3Shape.local_rope_theta`).
_GEMMA3_ROPE = RopeConfig(theta=1000000.0, original_max_position_embeddings=32768)
_GEMMA3_LINEAR_ROPE = RopeConfig(
    theta=1000000.0, kind="linear", factor=8.0, original_max_position_embeddings=131072
)
_GEMMA3_ARCH = ["Gemma3ForCausalLM"]


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
    eos_token_ids: tuple[int, ...] = (2,)
    # config.json's head_dim where it is not hidden_size / num_attention_heads (Qwen3,
    # Gemma 3); None: hidden_size / num_attention_heads
    head_dim: int | None = None
    # Gemma 3 only: its sliding-window layers (`sliding_window` positions, every
    # `global_every`-th layer global), their RoPE base, and the score scale's
    # query_pre_attn_scalar (scores times its -1/2 power, not head_dim's)
    sliding_window: int | None = None
    global_every: int = 6
    local_rope_theta: float = 10000.0
    query_pre_attn_scalar: float | None = None

    def layer_types(self, layers: int) -> tuple[str, ...]:
        """Gemma 3's kind of each of `layers` layers: the real pattern, ending on the global
        layer when there are fewer layers than the pattern (so a short model has both
        kinds); empty for a model without sliding windows."""
        if self.sliding_window is None:
            return ()
        kinds = [
            "full_attention" if (i + 1) % self.global_every == 0 else "sliding_attention"
            for i in range(layers)
        ]
        if layers < self.global_every:
            kinds[-1] = "full_attention"
        return tuple(kinds)


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
    "qwen2.5-32b": Shape(  # (every Qwen2 has q/k/v biases: the loader reads them so)
        "qwen2", 5120, 40, 8, 27648, 152064, 32768, _QWEN25_ROPE, 64, qkv_bias=True,
    ),
    "llama-3.2-1b": Shape(
        "llama", 2048, 32, 8, 8192, 128256, 131072, _LLAMA32_ROPE, 16, tie_word_embeddings=True
    ),
    "qwen2.5-0.5b": Shape(
        "qwen2", 896, 14, 2, 4864, 151936, 32768, _QWEN25_ROPE, 24,
        tie_word_embeddings=True, qkv_bias=True, rms_norm_eps=1e-6,
    ),
    # Qwen3: q/k norms, head_dim 128 whatever the width (the 0.6B's 16 x 128 > 1,024)
    "qwen3-8b": Shape(
        "qwen3", 4096, 32, 8, 12288, 151936, 40960, _QWEN3_ROPE, 36,
        rms_norm_eps=1e-6, bos_token_id=151643, eos_token_ids=(151645,), head_dim=128,
    ),
    "qwen3-32b": Shape(
        "qwen3", 5120, 64, 8, 25600, 151936, 40960, _QWEN3_ROPE, 64,
        rms_norm_eps=1e-6, bos_token_id=151643, eos_token_ids=(151645,), head_dim=128,
    ),
    "qwen3-0.6b": Shape(
        "qwen3", 1024, 16, 8, 3072, 151936, 40960, _QWEN3_ROPE, 28,
        tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=151643,
        eos_token_ids=(151645,), head_dim=128,
    ),
    # Gemma 3 (the text model of the multimodal 12B/27B checkpoints): 262,208 ids in the
    # 12B/27B, 262,144 in the 1B; tied embeddings; 27B's scores by 168 ** -0.5
    "gemma-3-27b": Shape(
        "gemma3_text", 5376, 32, 16, 21504, 262208, 131072, _GEMMA3_LINEAR_ROPE, 62,
        tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=2, eos_token_ids=(1, 106),
        head_dim=128, sliding_window=1024, query_pre_attn_scalar=168,
    ),
    "gemma-3-12b": Shape(
        "gemma3_text", 3840, 16, 8, 15360, 262208, 131072, _GEMMA3_LINEAR_ROPE, 48,
        tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=2, eos_token_ids=(1, 106),
        head_dim=256, sliding_window=1024, query_pre_attn_scalar=256,
    ),
    "gemma-3-1b": Shape(
        "gemma3_text", 1152, 4, 1, 6912, 262144, 32768, _GEMMA3_ROPE, 26,
        tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=2, eos_token_ids=(1, 106),
        head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
    ),
}
# fmt: on

# Target → the draft it is served with (the same tokenizer family).
PAIRS: dict[str, str] = {
    "llama-3.1-8b": "llama-3.2-1b",
    "llama-3.1-70b": "llama-3.2-1b",
    "qwen2.5-72b": "qwen2.5-0.5b",
    "qwen3-8b": "qwen3-0.6b",
    "qwen3-32b": "qwen3-0.6b",
    "gemma-3-12b": "gemma-3-1b",
    "gemma-3-27b": "gemma-3-1b",
}


def _even(width: float) -> int:
    """`width` rounded to an even number of at least 2 (RoPE rotates pairs)."""
    return max(2, 2 * round(width / 2))


def model_config(preset: str, layers: int = 1, hidden_scale: float = 1.0) -> ModelConfig:
    """The preset's ModelConfig with `layers` decoder layers, as specd reads the config.json
    `hf_config` writes for it. `hidden_scale` < 1 keeps the vocabulary and the head counts
    (so GQA grouping and per-head attention are real) and scales the head dimension (kept
    even for RoPE), the hidden size (heads x head dimension, or scaled on its own where the
    model's head_dim is not hidden / heads) and the MLP width."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if not 0 < hidden_scale <= 1:
        raise ValueError(f"hidden_scale must be in (0, 1], got {hidden_scale}")
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    s = PRESETS[preset]
    if s.head_dim is None:  # hidden = heads x head_dim, as the model has it
        head_dim = _even(s.hidden_size / s.num_heads * hidden_scale)
        hidden = s.num_heads * head_dim
    else:  # each scaled on its own, so that they stay apart
        head_dim = _even(s.head_dim * hidden_scale)
        hidden = _even(s.hidden_size * hidden_scale)
    intermediate = max(8, math.ceil(s.intermediate_size * hidden_scale))
    scalar = s.query_pre_attn_scalar
    config = ModelConfig(
        model_type=s.model_type,
        vocab_size=s.vocab_size,
        hidden_size=hidden,
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
        sliding_window=s.sliding_window,
        layer_types=s.layer_types(layers),
        local_rope=RopeConfig(theta=s.local_rope_theta) if s.sliding_window else None,
        attention_scale=None if scalar is None else scalar**-0.5,
        bos_token_id=s.bos_token_id,
        eos_token_ids=s.eos_token_ids,
    )
    # The rest (norms, activations, scales the architecture derives) as the loader reads it.
    return config_from_hf(hf_config(config), f"preset {preset}")


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
        if name.endswith("norm.weight"):  # a scale of about 1 (Gemma's norms add 1 to w)
            p.normal_(1.0 - config.norm_offset, 0.1, generator=gen)
        elif name.endswith(".bias"):
            p.normal_(0.0, 0.1, generator=gen)
        elif name == "embed_tokens.weight":
            # The embedding's output at unit scale, as trained ones are: Gemma multiplies
            # it by sqrt(hidden), which would otherwise swamp the layers' outputs (and with
            # a tied head make every model predict its input token again).
            p.normal_(0.0, 1.0 / (config.embedding_scale or 1.0), generator=gen)
        else:
            std = init_std if init_std is not None else p.shape[-1] ** -0.5
            p.normal_(0.0, std, generator=gen)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.set_rope(device)
    return model.eval()


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """config.json for `config`, as transformers writes it for these families."""
    if config.model_type not in _ARCHITECTURES:
        raise ValueError(
            f"no config.json writer for model_type {config.model_type!r} "
            f"(have {', '.join(_ARCHITECTURES)})"
        )
    rope = config.rope
    raw: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[config.model_type]],
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
    elif rope.kind == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": rope.factor}
    elif rope.kind != "default":
        raise ValueError(f"no config.json writer for rope type {rope.kind!r}")
    if config.model_type in ("qwen2", "qwen3"):
        raw["use_sliding_window"] = False
    if config.model_type == "gemma3_text":
        raw.pop("hidden_act")
        raw["hidden_activation"] = "gelu_pytorch_tanh"
        raw["sliding_window"] = config.sliding_window
        raw["layer_types"] = list(config.layer_types)
        raw["rope_local_base_freq"] = (config.local_rope or RopeConfig()).theta
        # scores times scalar ** -0.5: rounded back to the figure config.json states (an
        # integer in every published one, and transformers' type for it)
        scale = config.attention_scale or config.head_dim**-0.5
        scalar = round(scale**-2, 6)
        raw["query_pre_attn_scalar"] = int(scalar) if scalar.is_integer() else scalar
        raw["attention_bias"] = config.qkv_bias
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
