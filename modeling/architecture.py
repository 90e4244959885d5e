"""The architecture contract: everything the rest of the runtime knows of an architecture,
and all it may ask. An architecture module (modeling/models/<name>.py) makes one
`Architecture` and the registry (modeling/models/__init__.py) finds it by config.json's
`model_type` or a GGUF file's `general.architecture`.

Who reads what:
- the loaders (modeling/checkpoints/): `config` (config.json, or the Hugging Face-style
  record a GGUF file's metadata is read into, with `gguf_config`'s keys of its own),
  `hf_name` (and `hf_stack_shape` / `hf_unstack` for tensors that stack a layer's experts),
  `gguf_name`, `gguf_tensor` and `gguf_offset` (the tensor fix-ups, e.g.
  Llama's q/k un-permute, Gemma's norms);
- the decoder (modeling/decoder.py): `block`;
- the memory plan (daemon/footprint.py through the registry's functions):
  `layer_parameters`, `kv_layout`, `layer_activations`;
- the substitute builder (modeling/substitute.py): `block`.

Nothing outside an architecture module names its classes, so a new architecture is its
module, its registry line and its tests.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from modeling.config import ModelConfig

_GGUF_LAYER = re.compile(r"blk\.(0|[1-9][0-9]*)\.(\w+)\.(weight|bias)")
_GGUF_OUTER = re.compile(r"(\w+)\.weight")

# llama.cpp's stacked expert tensors (after `blk.N.`; ne = [columns, rows, experts]) → the
# projection each expert's slice is in our `mlp.experts.<e>`.
GGUF_EXPERTS: Mapping[str, str] = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}


@dataclass(frozen=True)
class LayerKV:
    """One layer's share of the KV cache: `kv_heads` heads of `head_dim` for keys and as
    many for values, per position it holds; `window`: a sliding window layer's, in
    positions (None: full attention). A window layer's cache is a ring of a fixed size
    (modeling/kv_cache.py's `window_ring_size`), which the plan counts for it instead of
    the context."""

    kv_heads: int
    head_dim: int
    window: int | None = None

    def bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class LayerActivations:
    """What one decoder layer's pass holds per token at its peak, in bytes, as the module's
    code allocates it (daemon/footprint.py sums these with the attention's own working
    set): `layer` over the whole block, `attention` while attention runs (the activations
    alive beside the scores)."""

    layer: int
    attention: int


class GGUFKeys(Protocol):
    """A GGUF file's `{architecture}.*` metadata, each value checked as it is read
    (modeling/checkpoints/gguf_config.py): a missing key without a default, or a value of
    the wrong kind, is an error naming the file (`source`) and the key."""

    source: str
    arch: str  # the file's general.architecture: the keys' prefix

    def count(self, name: str, default: int | None = None, minimum: int = 1) -> int:
        """A whole number of at least `minimum` (a count or a width)."""
        ...

    def number(self, name: str, default: float | None = None) -> float:
        """A finite number of at least 0 (an epsilon, a base)."""
        ...

    def has(self, name: str) -> bool:
        """Whether the file states `{architecture}.{name}`."""
        ...

    def floats(self, tensor: str, length: int) -> list[float] | None:
        """The values of the file's F32 tensor `tensor` of `length` values, finite and above
        0 (RoPE factors); None if the file has no such tensor."""
        ...


class Architecture(ABC):
    """One architecture family. `model_types`: config.json's `model_type` values it runs;
    `gguf_architectures`: GGUF `general.architecture` → the model_type its config is read
    as. `gguf_layer_names` / `gguf_outer_names`: llama.cpp's tensor names (the part after
    `blk.N.`, and outside the layers) → ours; `gguf_experts`: the stacked expert tensors a
    mixture of experts' file holds (`GGUF_EXPERTS`), each split into one tensor per expert
    as it loads (`gguf_expert`)."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    gguf_architectures: ClassVar[Mapping[str, str]] = {}
    gguf_layer_names: ClassVar[Mapping[str, str]] = {}
    gguf_outer_names: ClassVar[Mapping[str, str]] = {
        "token_embd": "embed_tokens",
        "output_norm": "norm",
        "output": "lm_head",
    }
    gguf_experts: ClassVar[Mapping[str, str]] = {}
    # llama.cpp's `expert_gating_func` this architecture routes by, where a file states it
    # (1: softmax over every expert); None: llama.cpp routes it by its own fixed rule and
    # reads no such key (gpt-oss)
    gguf_expert_gating: ClassVar[int | None] = 1
    # `expert_shared_count` a file may state (None: the shared expert's tensors decide)
    gguf_expert_shared: ClassVar[int | None] = 0
    # tensors `gguf_config` reads into the config (LongRoPE's factors), not into the model
    gguf_config_tensors: ClassVar[frozenset[str]] = frozenset()
    # llama.cpp reads its files' `rope.scaling.yarn_log_multiplier` (YaRN's `mscale_all_dim`,
    # Mistral 3's); for the others it ignores the key, and specd refuses one that is not 0
    gguf_yarn_log_multiplier: ClassVar[bool] = False

    @abstractmethod
    def config(self, raw: dict[str, Any], source: str) -> ModelConfig:
        """A config.json record → ModelConfig, refusing (UnsupportedModelError naming the
        key) whatever this module would compute differently from the reference."""

    @abstractmethod
    def block(self, cfg: ModelConfig, index: int) -> nn.Module:
        """Decoder layer `index`, called as `block(x, cos, sin, sequences, index)`."""

    @abstractmethod
    def layer_parameters(self, cfg: ModelConfig, index: int) -> int:
        """Exact parameter count of layer `index`, from the shapes alone."""

    @abstractmethod
    def layer_activations(self, cfg: ModelConfig, itemsize: int, copy: int) -> LayerActivations:
        """A layer pass's peak bytes per token in a model dtype of `itemsize` bytes; `copy`
        is the bytes per value of a packed projection's fp32 buffer while its product runs
        (0 for dense layers)."""

    def kv_layout(self, cfg: ModelConfig) -> tuple[LayerKV, ...]:
        """Each layer's KV shape and window (`ModelConfig.layer_window`); a module whose
        layers differ otherwise says so."""
        return tuple(
            LayerKV(cfg.num_kv_heads, cfg.head_dim, cfg.layer_window(i))
            for i in range(cfg.num_layers)
        )

    def hf_name(self, stored: str) -> str | None:
        """A Hugging Face checkpoint's tensor name → ours (the decoder stack's `model.`
        prefix dropped); None for a tensor the model does not use (a multimodal
        checkpoint's vision tower)."""
        return stored.removeprefix("model.")

    def hf_stack_shape(self, cfg: ModelConfig, stored: str) -> tuple[int, ...] | None:
        """The shape of a checkpoint tensor that holds every expert of a layer at once
        (gpt-oss's `mlp.experts.gate_up_proj`), loaded as one tensor per expert
        (`hf_unstack`); None for any other tensor."""
        return None

    def hf_unstack(self, stored: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A stacked tensor of `hf_stack_shape`'s shape → each expert's tensor by our name,
        in the layout our modules hold it."""
        raise NotImplementedError(f"{self.name} stacks no tensors ({stored})")

    def hf_join(self, parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """One tensor of ours from the parts `hf_unstack` gave under its name + `#part`
        (gpt-oss's MXFP4 codes and scales, stored apart): None while a part is missing."""
        raise NotImplementedError(f"{self.name} joins no tensors")

    def gguf_name(self, name: str) -> str | None:
        """A GGUF tensor name → ours ('blk.3.attn_q.weight' →
        'layers.3.self_attn.q_proj.weight'), None for one this architecture does not have."""
        layer = _GGUF_LAYER.fullmatch(name)
        if layer is not None:
            part = self.gguf_layer_names.get(layer.group(2))
            return f"layers.{layer.group(1)}.{part}.{layer.group(3)}" if part else None
        outer = _GGUF_OUTER.fullmatch(name)
        if outer is not None and outer.group(1) in self.gguf_outer_names:
            return f"{self.gguf_outer_names[outer.group(1)]}.weight"
        return None

    def gguf_expert(self, name: str) -> tuple[int, str, str] | None:
        """A stacked expert tensor's GGUF name → (its layer, the projection each expert's
        slice is: 'gate_proj', 'weight' or 'bias' (gpt-oss's experts have biases, stacked
        as [rows, experts])); None for any other tensor."""
        layer = _GGUF_LAYER.fullmatch(name)
        if layer is None or len(layer.group(1)) > 9:
            return None
        part = self.gguf_experts.get(layer.group(2))
        return None if part is None else (int(layer.group(1)), part, layer.group(3))

    def gguf_config(self, keys: GGUFKeys, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """config.json keys of this architecture's own that a GGUF file states (or that
        llama.cpp fixes for it), over the ones every file has; `tensors`: the file's
        tensor infos by name."""
        return {}

    def gguf_offset(self, cfg: ModelConfig, name: str) -> float:
        """What the converter added to every value of the float tensor `name` (ours),
        taken off in fp32 before the value is rounded to the model's dtype."""
        return 0.0

    def gguf_tensor(
        self, cfg: ModelConfig, name: str, rows: torch.Tensor, ne: tuple[int, ...]
    ) -> torch.Tensor:
        """A GGUF tensor's stored rows (rows, row bytes) (`name` is ours; `ne` its shape as
        the file lists it)
        as our layout wants them: the converter's changes undone, whole rows at a time so
        that quantized blocks need no decoding. As stored unless a module says otherwise."""
        return rows


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo the converter's q/k row order: within each head, rows (2i, 2i+1) go back to
    (i, i + head_dim / 2)."""
    out = rows.shape[0]
    return rows.reshape(heads, out // heads // 2, 2, -1).transpose(1, 2).reshape(out, -1)


# llama.cpp's layer tensor names (after `blk.N.`) → ours, for Llama, Qwen2/3 and their mixtures
# of experts (whose router is `ffn_gate_inp`; their experts are stacked: GGUF_EXPERTS).
GGUF_LAYERS: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}


# A multimodal checkpoint (Gemma 3's, Mistral 3's): keys its top level states for its text
# model too (`text_config` wins where it states them), and what its text model's tensors
# are named under. The vision tower's tensors are not the decoder's.
MULTIMODAL_TOP_LEVEL = (
    "torch_dtype",
    "dtype",
    "quantization_config",
    "eos_token_id",
    "bos_token_id",
)
_MULTIMODAL_ONLY = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def multimodal_text_name(stored: str) -> str | None:
    """A multimodal checkpoint's tensor name → its text model's name of ours (transformers
    4's `language_model.model.` and 5's `model.language_model.` layouts, and a text-only
    checkpoint's `model.`); None for the vision tower and the projector."""
    if stored.startswith(_MULTIMODAL_ONLY):
        return None
    for prefix in ("model.language_model.", "language_model.model.", "language_model."):
        if stored.startswith(prefix):
            return stored.removeprefix(prefix)
    return stored.removeprefix("model.")


def unpermute_qk(
    cfg: ModelConfig, name: str, rows: torch.Tensor, ne: tuple[int, ...]
) -> torch.Tensor:
    """The stored rows of q or k (weight or bias) of a file from llama.cpp's Llama converter
    in Hugging Face's order; any other tensor as stored."""
    if not (".q_proj." in name or ".k_proj." in name):
        return rows
    heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
    if len(ne) == 1:  # a bias: its values are what the rows of q/k are
        return _unpermute(rows.view(ne[0], -1), heads).reshape(1, -1)
    return _unpermute(rows, heads)
