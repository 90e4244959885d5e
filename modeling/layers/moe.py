"""The mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss): pre-norm attention as in the shared
decoder layer, then instead of one gated MLP a router and `experts` of them, each token
sent through its top k.

Routing is the reference's, exactly: the router's logits (in the model dtype), their
softmax in fp32 over all experts, the k largest (torch.topk, so ties fall as they do in
transformers), renormalised to sum 1 where the config says (`MoEConfig.normalize`), then
each chosen expert's output times its weight added to the token's, experts in ascending
order (the order the reference adds them in, so sums round alike). Qwen3-MoE rounds the
weights to the model dtype before they scale an expert's output; Mixtral scales in fp32
and rounds the product (`weights_in_model_dtype`).

Each expert is its own gated MLP module (`experts.<e>`: gate/up stacked when dense, as a
checkpoint's `experts.<e>.gate_proj` and `up_proj` are stacked for the shared MLP), so a
checkpoint's per-expert tensors load by name, packed formats pack per expert, and an
expert is a unit that can live elsewhere than its layer.

gpt-oss routes otherwise (`MoEConfig.softmax_topk`): its router has a bias, the k largest
logits are taken and the softmax is over those k alone, in the model dtype. Its experts
(`ClampedExpert`) have biases and a clamped SwiGLU: gate clamped above at the limit, up to
[-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar, Protocol

import torch
from torch import nn

from modeling.architecture import Architecture, LayerActivations
from modeling.config import ModelConfig
from modeling.layers.decoder_layer import DecoderLayer, layer_parameters, layer_phases
from modeling.layers.mlp import MLP
from modeling.layers.norms import norm_bytes
from modeling.weights.gguf_modules import GGUFLinear
from modeling.weights.packed import PackedLinear
from modeling.weights.projections import FusedLinear, linear, projection


class ExpertSource(Protocol):
    """Where a layer's routed experts are when they are not its own modules (offload/experts.py:
    a device cache filled as routed, or host RAM): `prepare` names the experts a layer pass
    will ask for (distinct), then `expert` gives each, one at a time, ready to compute (on
    the device, or on the CPU where they are computed there)."""

    def prepare(self, layer: int, wanted: Sequence[int]) -> None: ...

    def expert(self, layer: int, index: int) -> nn.Module: ...


def _device_of(module: nn.Module) -> torch.device:
    for parameter in module.parameters():
        return parameter.device
    for buffer in module.buffers():
        return buffer.device
    raise ValueError("an expert with no tensors")


class ClampedExpert(nn.Module):
    """gpt-oss's expert: gate and up with their biases (stacked when dense, as the shared
    MLP's; packed, each its own), down with its bias, and the clamped SwiGLU between (see
    the module)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None and moe.swiglu_limit is not None
        d, f = cfg.hidden_size, moe.intermediate_size
        self.limit, self.alpha = moe.swiglu_limit, moe.swiglu_alpha
        self.gate_up_proj: FusedLinear | None = None
        self.gate_proj: nn.Linear | PackedLinear | None = None
        self.up_proj: nn.Linear | PackedLinear | None = None
        if moe.expert_blocks is not None:  # packed where the rest is dense (MXFP4)
            self.gate_proj = GGUFLinear(d, f, True, moe.expert_blocks)
            self.up_proj = GGUFLinear(d, f, True, moe.expert_blocks)
        elif cfg.quantization is None:
            self.gate_up_proj = FusedLinear(d, [("gate_proj", f), ("up_proj", f)], True)
        else:
            self.gate_proj = projection(cfg, d, f, True)
            self.up_proj = projection(cfg, d, f, True)
        self.down_proj: nn.Linear | PackedLinear = (
            GGUFLinear(f, d, True, moe.expert_blocks)
            if moe.expert_blocks is not None
            else projection(cfg, f, d, True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = linear(self.gate_up_proj, x).chunk(2, dim=-1)  # (T, f) views each
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            gate, up = linear(self.gate_proj, x), linear(self.up_proj, x)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return linear(self.down_proj, (up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class SparseMoE(nn.Module):
    """Router (`gate`, dense: [experts, hidden]) and `experts` gated MLPs; or, once placed by
    routing (`source` set, `experts` emptied), the experts `source` gives."""

    def __init__(self, cfg: ModelConfig, weights_in_model_dtype: bool = True) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "a mixture-of-experts block needs the config's `moe`"
        self.top_k, self.normalize = moe.top_k, moe.normalize
        self.softmax_topk = moe.softmax_topk
        self.weights_in_model_dtype = weights_in_model_dtype
        self.gate = nn.Linear(cfg.hidden_size, moe.experts, bias=moe.router_bias)
        self.experts = nn.ModuleList(
            ClampedExpert(cfg) if moe.swiglu_limit is not None else MLP(cfg, moe.intermediate_size)
            for _ in range(moe.experts)
        )
        self.source: ExpertSource | None = None
        self.layer = 0  # this block's layer, for `source`
        # Qwen2-MoE: a shared expert every token goes through, its output scaled by
        # sigmoid(gate(x)) and added after the routed ones (resident with its layer)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size is not None:
            self.shared_expert = MLP(cfg, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, k) chosen experts and their weights (fp32; gpt-oss's in the model dtype) for
        tokens x (T, hidden)."""
        logits = linear(self.gate, x)  # (T, E) in the model dtype, as the reference's
        if self.softmax_topk:  # gpt-oss: the softmax of the k largest logits alone
            top, chosen = torch.topk(logits, self.top_k, dim=-1)  # (T, k) each
            return chosen, torch.softmax(top, dim=-1, dtype=top.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (T, E)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (T, k) each
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)  # (T, k), (T, k)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)  # (T, hidden)
        # The (token, slot) picks grouped by expert with one sort, in the order a search of
        # `chosen` for each expert gives them, and the group sizes read in one host sync
        # (a sync per expert woken was 129 a layer, 6,200 a tree pass at 48 layers).
        k = chosen.shape[-1]
        picks = chosen.flatten()  # (T * k,)
        order = torch.argsort(picks, stable=True)  # (T * k,) by expert, then token, slot
        sizes = torch.bincount(picks, minlength=len(self.experts)).tolist()
        wanted = [e for e, n in enumerate(sizes) if n]  # ascending, as the reference adds
        source = self.source
        if source is not None:
            source.prepare(self.layer, wanted)
        start = 0
        for e, n in enumerate(sizes):
            if not n:
                continue
            group = order[start : start + n]  # (n,): a token picks e once
            start += n
            tokens, slots = group // k, group % k
            expert = self.experts[e] if source is None else source.expert(self.layer, e)
            rows = x[tokens]  # (n, hidden)
            where = _device_of(expert)
            if where != x.device:  # an expert computed on the CPU: its rows go there and back
                y = expert(rows.to(where)).to(x.device)
            else:
                y = expert(rows)
            y = y * weights[tokens, slots, None]  # (n, hidden)
            out.index_add_(0, tokens, y.to(x.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(linear(self.shared_expert_gate, x))  # (T, 1)
            out = out + gate * self.shared_expert(x)
        return out


class MoEDecoderLayer(DecoderLayer):
    """x + attention(norm(x)), then x + experts(norm(x)): the shared block
    (modeling/layers/decoder_layer.py) with a `SparseMoE` for its MLP."""

    def __init__(self, cfg: ModelConfig, index: int = 0, weights_in_model_dtype: bool = True):
        super().__init__(cfg, index, SparseMoE(cfg, weights_in_model_dtype))


def moe_layer_parameters(cfg: ModelConfig) -> int:
    """Exact parameters of a `MoEDecoderLayer`: the shared block's attention and norms, the
    router, and every expert's gate, up and down projections."""
    moe = cfg.moe
    assert moe is not None
    d, f = cfg.hidden_size, moe.intermediate_size
    attention_and_norms = layer_parameters(replace(cfg, intermediate_size=0, mlp_bias=False))
    biased = cfg.mlp_bias or moe.swiglu_limit is not None  # (gpt-oss's experts have biases)
    expert = 3 * d * f + ((2 * f + d) if biased else 0)
    router = moe.experts * d + (moe.experts if moe.router_bias else 0)
    shared = 0
    if moe.shared_intermediate_size is not None:  # its gated MLP and its gate
        shared = 3 * d * moe.shared_intermediate_size + d
    return attention_and_norms + router + moe.experts * expert + shared


def moe_layer_activations(cfg: ModelConfig, itemsize: int, copy: int) -> LayerActivations:
    """`MoEDecoderLayer`'s peak per token: the shared block's attention phases, and the
    experts' phase: x, the residual, the norm's output and the accumulated output; the
    router's logits (model dtype), softmax (fp32), top-k weights and indices; one expert's
    gathered rows, its gate/up and act(gate) (all a pass's tokens may pick one expert) and
    its weighted output."""
    moe = cfg.moe
    assert moe is not None
    d, f, e, k = cfg.hidden_size, moe.intermediate_size, moe.experts, moe.top_k
    attention = layer_phases(replace(cfg, intermediate_size=f), itemsize, copy)
    router = itemsize * e + 4 * e + k * (4 + 8 + 4)
    experts = itemsize * (4 * d + d + 3 * f + d) + router + copy * 2 * f
    if moe.shared_intermediate_size is not None:  # the shared expert's gate/up, act, output
        fs = moe.shared_intermediate_size
        experts += itemsize * (3 * fs + 2 * d) + copy * 2 * fs
    hd = cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    return LayerActivations(
        layer=max(*attention, experts, itemsize * d + norm_bytes(d, itemsize)),
        attention=itemsize * (2 * d + 3 * q + 3 * kv),
    )


class MoEArchitecture(Architecture):
    """An architecture whose every layer is a `MoEDecoderLayer` (Qwen3-MoE, Qwen2-MoE,
    Mixtral, gpt-oss): its block, exact parameters and activations; `weights_in_model_dtype` as
    `SparseMoE` takes it."""

    weights_in_model_dtype: ClassVar[bool] = True

    def block(self, cfg: ModelConfig, index: int) -> nn.Module:
        return MoEDecoderLayer(cfg, index, weights_in_model_dtype=self.weights_in_model_dtype)

    def layer_parameters(self, cfg: ModelConfig, index: int) -> int:
        return moe_layer_parameters(cfg)

    def layer_activations(self, cfg: ModelConfig, itemsize: int, copy: int) -> LayerActivations:
        return moe_layer_activations(cfg, itemsize, copy)
