"""Model configuration: one typed record (`ModelConfig`) every part of the runtime reads.
The readers of config.json's shared keys (`integer`, `number`, `rope_config`, ...) are
modeling/config_readers.py.

Which architecture a config.json describes, and what it refuses, is its architecture
module's (modeling/models/): `modeling.models.config_from_hf` reads a config through it.
Anything the decoder would compute differently from the reference is refused at load time,
with a message that names the offending key, rather than producing quietly wrong logits
later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modeling.weights.quant import QuantizationSpec

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or option this runtime does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    # YaRN: the ramp's bounds in rotations, whether they are rounded outwards, and the
    # factor on cos and sin (None: from `factor`, and mscale / mscale_all_dim when given)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # The fraction of each head's dimensions that rotate (the rest pass as they are)
    partial_rotary_factor: float = 1.0
    # LongRoPE (Phi-3.5, Phi-4-mini): each frequency's divisor, below and from position
    # original_max_position_embeddings
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts layer (modeling/layers/moe.py): a router over `experts` gated
    MLPs of `intermediate_size` each, `top_k` of them per token, their weights the
    router's softmax over all experts, the top k taken, renormalised to sum 1 where
    `normalize` (Qwen3-MoE's `norm_topk_prob`; always in Mixtral). gpt-oss's differ: its
    router has a bias and takes the softmax over the chosen k logits only (`softmax_topk`,
    in the model dtype), and its experts have biases and a clamped SwiGLU (`swiglu_limit`,
    `swiglu_alpha`: modeling/layers/moe.py's `ClampedExpert`)."""

    experts: int
    top_k: int
    intermediate_size: int
    normalize: bool = True
    router_bias: bool = False
    softmax_topk: bool = False
    swiglu_limit: float | None = None  # None: the model's gated MLP (`MLP`)
    swiglu_alpha: float = 1.702
    # A shared expert every token goes through, scaled by sigmoid(gate(x)) (Qwen2-MoE):
    # its gated MLP's width; None: none
    shared_intermediate_size: int | None = None
    # The ggml type the experts are kept in as blocks where the checkpoint stores them
    # packed and the rest dense (gpt-oss's MXFP4 release); None: as the config says
    expert_blocks: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # active window, or None for full attention
    # Each layer's kind, "full_attention" or "sliding_attention" (transformers' names);
    # empty: every layer slides when `sliding_window` is set (Mistral)
    layer_types: tuple[str, ...] = ()
    # The RoPE of sliding layers where it differs from `rope` (Gemma 3's local base)
    local_rope: RopeConfig | None = None
    hidden_act: str = "silu"
    norm_offset: float = 0.0  # RMSNorm scales by offset + w ((1 + w): Gemma)
    embedding_scale: float | None = None  # the embedding's output times this (Gemma: sqrt(d))
    attention_scale: float | None = None  # on the scores; None: head_dim ** -0.5
    attention_softcap: float | None = None  # Gemma 2's attn_logit_softcapping
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss: `self_attn.sinks`)
    # (beta, floor): Llama 4's attention temperature (Ministral 3): after RoPE each query is
    # scaled by 1 + beta * ln(1 + floor(position / floor)); None: none
    query_scale: tuple[float, int] | None = None
    # The checkpoint stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3)
    stored_fused: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # config.json's quantization_config: its projections are packed (modeling/weights/quant.py,
    # modeling/weights/packed.py)
    quantization: QuantizationSpec | None = None
    # Every layer's MLP is a mixture of experts (Qwen3-MoE, Mixtral); None: dense MLPs
    moe: MoEConfig | None = None
    # Read from a GGUF file (its tensors as llama.cpp's converter wrote them: the disk tier
    # converts some as it reads them, modeling/checkpoints/gguf_disk.py)
    gguf: bool = False

    def layer_window(self, index: int) -> int | None:
        """Layer `index`'s sliding window in positions, None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[index] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_rope(self, index: int) -> RopeConfig:
        """The RoPE layer `index` rotates by: the local one for a sliding layer that has one."""
        if self.local_rope is not None and self.layer_window(index) is not None:
            return self.local_rope
        return self.rope

    @property
    def max_context(self) -> int:
        """The longest context the model was made for (window layers are computed exactly
        by position, so a window no longer limits it)."""
        return self.max_position_embeddings
