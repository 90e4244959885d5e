"""Tiny random checkpoints in real Hugging Face layout, for tests and benchmarks.

The folders are written by `transformers` itself (config.json, safetensors, generation
config), so their layout is exactly what users have; the tokenizer is a real
`tokenizer.json` built with `tokenizers`. transformers is a test/bench dependency only.

    python scripts/tiny_models.py OUT_DIR --family qwen3 --vocab 512
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    "llama3": {
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"model_type": "mistral", "sliding_window": None},
    # Ministral 3: Mistral's block, YaRN (mscale and mscale_all_dim 1: no factor on cos and
    # sin) and Llama 4's attention temperature from the original context on (8 here, 16,384
    # in the real ones), so the parity passes cross three of its steps
    "ministral3": {
        "model_type": "ministral3",
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    },
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "phi3": {"model_type": "phi3", "pad_token_id": 0},
    # Phi-4-mini's partial rotary (3/4 of each head turns) and Phi-3-mini's window
    "phi3-partial": {
        "model_type": "phi3",
        "pad_token_id": 0,
        "partial_rotary_factor": 0.75,
        "sliding_window": 7,
    },
    # Mixtures of experts: 4 experts of 32, 2 per token (Qwen3-30B-A3B: 128 of 768, 8)
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    # Qwen2-MoE: Qwen2's attention, 4 experts of 32, 2 a token, unnormalised, and a shared
    # expert of 48 behind a sigmoid gate
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": False,
    },
    "mixtral": {
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
    # gpt-oss: 4 experts of 32 (biases, clamped SwiGLU), 2 a token, softmax over the chosen
    # logits; attention sinks and biases; sliding (window 6) and full layers alternating;
    # YaRN without truncation (gpt-oss-20b: 32 experts of 2880, 4 a token, window 128)
    "gpt_oss": {
        "model_type": "gpt_oss",
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 6,
        "swiglu_limit": 7.0,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
        },
    },
    # Layer 0 local (window 6, its own RoPE base), layer 1 global (linear factor 2)
    "gemma3": {
        "model_type": "gemma3_text",
        "head_dim": 16,
        "sliding_window": 6,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    },
    # What a GGUF file can say of Gemma 3 (llama.cpp fixes the rest): every sixth layer
    # global, a local base of 10,000, scores scaled by head_dim (here transformers'
    # default 256, which its GGUF loader assumes)
    "gemma3-gguf": {
        "model_type": "gemma3_text",
        "head_dim": 256,
        "num_hidden_layers": 6,
        "sliding_window": 6,
        "query_pre_attn_scalar": 256,
        "tie_word_embeddings": True,
    },
}

_CORPUS = (
    "Once upon a time there was a little robot who loved to count. "
    "One, two, three! The robot counted stars, cats and café tables. "
    "Naïve dragons say 你好 and 😀 to everyone they meet. "
    "def add(a, b):\n    return a + b\n"
) * 4


def build_tokenizer(vocab_size: int):  # type: ignore[no-untyped-def]
    """A real tokenizer with exactly `vocab_size` entries (ids 0..2 are <unk>, <s>, </s>).
    Small vocabularies get a character-level word tokenizer; larger ones a byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"]
    if vocab_size < 300:
        letters = [chr(ord("a") + i) if i < 26 else f"t{i}" for i in range(vocab_size - 3)]
        vocab = {tok: i for i, tok in enumerate(specials + letters)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    else:
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([_CORPUS], trainer=trainer)
        # Pad with unused tokens if the corpus is too small to reach the size: in the BPE's
        # own vocabulary, as a real one holds them (added tokens, matched whole in any text,
        # are a few hundred in real files, and bounded: modeling/text/tokenizer_file.py).
        missing = vocab_size - tok.get_vocab_size()
        if missing > 0:
            spec = json.loads(tok.to_str())
            first = tok.get_vocab_size()
            spec["model"]["vocab"].update({f"<extra_{i}>": first + i for i in range(missing)})
            tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def make_checkpoint(
    path: str | Path,
    family: str = "llama",
    *,
    vocab_size: int = 320,
    tokenizer_size: int | None = None,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = False,
    init_std: float = 0.2,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    chat_template: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random checkpoint of `family` to `path` and return the path.

    `vocab_size` is the embedding rows; the tokenizer has `tokenizer_size` entries (default
    the same): fewer gives Qwen2.5-style padding rows, more a checkpoint that does not cover
    its tokenizer. `init_std` well above the usual 0.02 gives peaked, model-like next-token distributions;
    `max_shard_size` (e.g. "20KB") writes sharded safetensors with an index."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-6,
    )
    fields.update(spec)
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # norms at 1 make every family look alike; vary them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith((".bias", "_bias")):
                p.copy_(0.1 * torch.randn_like(p))
    kwargs: dict[str, Any] = {}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    build_tokenizer(tokenizer_size or vocab_size).save(str(path / "tokenizer.json"))
    tok_config: dict[str, Any] = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "model_max_length": max_position_embeddings,
    }
    if chat_template:
        tok_config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument("out")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    ap.add_argument("--vocab", type=int, default=320, help="embedding rows")
    ap.add_argument("--tokenizer-size", type=int, default=None, help="default: --vocab")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = make_checkpoint(
        args.out,
        args.family,
        vocab_size=args.vocab,
        tokenizer_size=args.tokenizer_size,
        num_layers=args.layers,
        hidden_size=args.hidden,
        tie_word_embeddings=args.tie,
        seed=args.seed,
    )
    print(out)


if __name__ == "__main__":
    main()
