"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with biases and a learned sink logit per
head (a softmax column with no value), sliding (window 128) and full layers alternating,
YaRN without truncation; in every layer a mixture of experts routed by gpt-oss's rule
(the router has a bias; the softmax is over the k largest logits only) whose experts have
biases and a clamped SwiGLU (modeling/layers/moe.py's `ClampedExpert`).

Checkpoints as transformers keeps them hold each layer's experts stacked:
`mlp.experts.gate_up_proj` (experts, hidden, 2 x ff) with gate and up interleaved column by
column, `down_proj` (experts, ff, hidden), and their biases; they are split into one
expert each as they load (`hf_stack_shape`, `hf_unstack`: gate and up apart, as the
shared MLP's are stored), so that an expert can live apart from its layer (`--experts
stream|cpu`). The router is `mlp.router`. OpenAI's own release stores the experts as MXFP4
(`quantization_config` mxfp4: `*_blocks`, two codes a byte, and `*_scales`, by output row);
each expert's are re-laid, losslessly, as ggml's MXFP4 blocks (`hf_join`) and kept packed,
one `GGUFLinear` each, the rest of the model dense.

GGUF files (`general.architecture` gpt-oss, Ollama's `gpt-oss:20b`) hold the experts as
llama.cpp's converter writes them: gate and up apart (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`, MXFP4 blocks kept packed per expert and decoded per pass), their biases
stacked as [rows, experts], the router `ffn_gate_inp` with its bias, the sinks
`attn_sinks`; llama.cpp routes it by its fixed rule (any `expert_gating_func` ignored) and
applies YaRN as the model defines it, untruncated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from modeling.architecture import GGUF_EXPERTS, GGUFKeys
from modeling.config import ModelConfig, MoEConfig, UnsupportedModelError
from modeling.config_readers import (
    LAYER_TYPES,
    attention_widths,
    bos_id,
    dtype_name,
    eos_ids,
    flag,
    given_layer_types,
    integer,
    number,
    routed_experts,
    whole_head_rope,
)
from modeling.layers.moe import MoEArchitecture
from modeling.weights.quant import parse_quantization

_GGUF_SINKS = re.compile(r"blk\.(\d{1,9})\.attn_sinks\.weight")
_STACKED = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?"
)
MXFP4 = 39  # ggml's type of OpenAI's MXFP4 blocks


class GptOss(MoEArchitecture):
    name: ClassVar[str] = "gpt_oss"
    model_types: ClassVar[tuple[str, ...]] = ("gpt_oss",)
    gguf_architectures: ClassVar[Mapping[str, str]] = {"gpt-oss": "gpt_oss"}
    gguf_layer_names: ClassVar[Mapping[str, str]] = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.gate",
    }
    gguf_experts: ClassVar[Mapping[str, str]] = GGUF_EXPERTS
    gguf_expert_gating: ClassVar[int | None] = None  # softmax over the chosen, fixed

    def config(self, raw: dict[str, Any], source: str) -> ModelConfig:
        quant = raw.get("quantization_config")
        packed = isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "mxfp4"
        if packed:  # OpenAI's release: the experts MXFP4, the rest bf16
            raw = {k: v for k, v in raw.items() if k != "quantization_config"}
        scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        if isinstance(scaling, dict) and scaling.get("rope_type") == "yarn":
            # gpt-oss's YaRN is untruncated (its config.json says so; a GGUF file does not)
            key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
            raw = {**raw, key: {"truncate": False, **scaling}}
        hidden, heads, kv_heads, head_dim = attention_widths(raw, source)
        rope = whole_head_rope(raw, source, "gpt_oss")
        experts, top_k = routed_experts(raw, source, "num_local_experts")
        layers = integer(raw, "num_hidden_layers", source)
        window = None
        if raw.get("sliding_window") is not None:
            window = integer(raw, "sliding_window", source)
        if window is not None and raw.get("layer_types") is None:
            # transformers' default: even layers slide, odd ones attend to everything
            raw = {**raw, "layer_types": [LAYER_TYPES[(i + 1) % 2] for i in range(layers)]}
        limit = raw.get("swiglu_limit", 7.0)
        alpha = raw.get("swiglu_alpha", 1.702)
        for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise UnsupportedModelError(f"{source}: {key} must be a number above 0")
        bias = flag(raw, "attention_bias", source, True)
        intermediate = integer(raw, "intermediate_size", source)
        return ModelConfig(
            model_type="gpt_oss",
            vocab_size=integer(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number(raw, "rms_norm_eps", source, 1e-5),
            max_position_embeddings=integer(raw, "max_position_embeddings", source, 131072),
            rope=rope,
            tie_word_embeddings=flag(raw, "tie_word_embeddings", source, False),
            qkv_bias=bias,
            o_bias=bias,
            sliding_window=window,
            layer_types=given_layer_types(raw, layers, source) if window is not None else (),
            attention_sinks=True,
            bos_token_id=bos_id(raw, source),
            eos_token_ids=eos_ids(raw, source),
            torch_dtype=dtype_name(raw, source),
            quantization=parse_quantization(raw, source),
            moe=MoEConfig(
                experts=experts,
                top_k=top_k,
                intermediate_size=intermediate,
                normalize=False,
                router_bias=True,
                softmax_topk=True,
                swiglu_limit=float(limit),
                swiglu_alpha=float(alpha),
                expert_blocks=MXFP4 if packed else None,
            ),
        )

    def gguf_name(self, name: str) -> str | None:
        sinks = _GGUF_SINKS.fullmatch(name)
        if sinks is not None:
            return f"layers.{sinks.group(1)}.self_attn.sinks"
        return super().gguf_name(name)

    def gguf_config(self, keys: GGUFKeys, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "num_local_experts": keys.count("expert_count"),
            "num_experts_per_tok": keys.count("expert_used_count"),
            "intermediate_size": keys.count("expert_feed_forward_length"),
            "sliding_window": keys.count("attention.sliding_window"),
        }

    def hf_name(self, stored: str) -> str | None:
        return stored.removeprefix("model.").replace(".mlp.router.", ".mlp.gate.")

    def hf_stack_shape(self, cfg: ModelConfig, stored: str) -> tuple[int, ...] | None:
        stacked = _STACKED.fullmatch(stored)
        if stacked is None or cfg.moe is None:
            return None
        e, d, f = cfg.moe.experts, cfg.hidden_size, cfg.moe.intermediate_size
        part, kind = stacked.group(2), stacked.group(3)
        rows, columns = (2 * f, d) if part == "gate_up_proj" else (d, f)
        if kind in ("_blocks", "_scales"):  # MXFP4: (experts, rows, groups of 32[, 16 bytes])
            if cfg.moe.expert_blocks != MXFP4 or columns % 32:
                return None
            return (e, rows, columns // 32, 16) if kind == "_blocks" else (e, rows, columns // 32)
        if cfg.moe.expert_blocks is not None:
            return (e, rows) if kind == "_bias" else None  # (packed: the weights are blocks)
        return (e, rows) if kind == "_bias" else (e, columns, rows)

    def hf_unstack(self, stored: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        stacked = _STACKED.fullmatch(stored)
        assert stacked is not None
        layer, part, kind = stacked.groups()
        if kind == "_blocks":
            tensor = _ggml_codes(tensor)  # (experts, rows, groups, 16): ggml's nibble order
        attr = {"_bias": "bias", "_blocks": "blocks#codes", "_scales": "blocks#scales"}.get(
            kind, "weight"
        )
        out = []
        for e in range(tensor.shape[0]):
            # (out,) or (out, in) as nn.Linear's; blocks and scales are stored by output row
            value = tensor[e].T if kind is None else tensor[e]
            at = f"layers.{layer}.mlp.experts.{e}"
            if part == "gate_up_proj":  # gate, up interleaved row by row
                out.append((f"{at}.gate_proj.{attr}", value[0::2].contiguous()))
                out.append((f"{at}.up_proj.{attr}", value[1::2].contiguous()))
            else:
                out.append((f"{at}.{part}.{attr}", value.contiguous()))
        return out

    def hf_join(self, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """An MXFP4 projection's blocks from its stored parts: per 32 weights, the scale byte
        then the 16 code bytes, as ggml lays a block out (rows, groups x 17)."""
        if set(parts) != {"codes", "scales"}:
            return None
        codes, scales = parts["codes"], parts["scales"]  # (rows, groups, 16), (rows, groups)
        return torch.cat([scales[..., None], codes], dim=-1).reshape(scales.shape[0], -1)


def _ggml_codes(blocks: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 bytes (each byte two consecutive codes, low nibble first) in ggml's
    order (byte j: code j low, code j + 16 high): the same codes and scale, laid out as
    ggml's MXFP4 blocks are, so they are decoded and multiplied as a GGUF file's."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # (..., 32) in order
    return codes[..., :16] | (codes[..., 16:] << 4)


GPT_OSS = GptOss()
