"""The substitute draft (SubSpec): the target itself, made cheap to run, as its own draft.

Every decoder layer the target streams gets a resident copy whose projections are
quantized to a few bits by HQQ (modeling/weights/hqq.py, calibration-free); a layer the target
keeps resident is its own substitute. Embedding, final norm and head are the target's
tensors, shared, not copied, and so is the KV cache: the substitute attends over the
target's verified rows for the committed prefix and writes rows only for its own
speculative tokens, in the target's cache past the committed length, which the target's
verification pass then overwrites (the strategies truncate back first). So the draft needs
no prefill, no cache of its own, no second download and no tokenizer match, and it agrees
with the target far more often than a small model of the family does.

The substitute is built from the target's layers as they are loaded, one layer at a time
(a packed target's projections are rebuilt dense one at a time to be re-quantized), so the
target is never in RAM twice.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import cast

import torch
from torch import nn

from modeling.config import ModelConfig
from modeling.decoder import Transformer
from modeling.models import architecture
from modeling.weights import hqq
from modeling.weights.hqq import HQQLinear
from modeling.weights.packed import PackedLinear
from modeling.weights.projections import FusedLinear
from modeling.weights.quant import QuantizationSpec

SUBSTITUTE = "substitute"  # --draft substitute
SUBSTITUTE_BITS = (8, 4, 3, 2)  # what `auto` tries, most first


def substitute_spec(bits: int) -> QuantizationSpec:
    if bits not in SUBSTITUTE_BITS:
        raise ValueError(f"substitute bits {bits} is not one of {SUBSTITUTE_BITS}")
    return QuantizationSpec("hqq", bits, hqq.GROUP, False, torch.float16, on_load=True)


# Packed formats whose layers a substitute of the same bits takes as they are.
SHAREABLE = ("gptq", "awq", "compressed-tensors")


def shares_packed(target: ModelConfig, bits: int) -> bool:
    """Whether a `bits` substitute of `target` is the target's own packed layers: a GPTQ,
    AWQ or compressed-tensors target (as stored or `--quantize`d) of exactly those bits.
    Quantizing its dequantized weights again to the same bits could only lose."""
    q = target.quantization
    return q is not None and q.method in SHAREABLE and q.bits == bits


def substitute_bits_for(target: ModelConfig) -> tuple[int, ...]:
    """The bits `auto` tries for `target`, most first: a packed target's substitute has
    no more bits than the target (more would copy what the target holds, at more bytes)."""
    q = target.quantization
    if q is None or q.method not in SHAREABLE:
        return SUBSTITUTE_BITS
    return tuple(b for b in SUBSTITUTE_BITS if b <= q.bits)


def substitute_config(target: ModelConfig, bits: int) -> ModelConfig:
    """The substitute's architecture: the target's, its projections HQQ-packed, or the
    target's own where it shares them (`shares_packed`)."""
    if shares_packed(target, bits):
        return target
    moe = target.moe
    if moe is not None and moe.expert_blocks is not None:  # gpt-oss's MXFP4 experts: HQQ too
        moe = replace(moe, expert_blocks=None)
    return replace(target, quantization=substitute_spec(bits), moe=moe)


def build_peak_bytes(target: ModelConfig, weight_itemsize: int) -> int:
    """The most bytes building a substitute layer holds on its device at once besides the
    layer itself: one projection's weight copied there (`weight_itemsize` bytes a value:
    the target's dtype, or 4 for a packed target's rebuilt fp32 weight) and one block of
    its quantization's temporaries (`hqq.build_bytes`)."""
    d, f, hd = target.hidden_size, target.intermediate_size, target.head_dim
    shapes = [
        (d, target.num_heads * hd), (d, target.num_kv_heads * hd),
        (target.num_heads * hd, d), (d, f), (f, d),
    ]  # fmt: skip
    return max(i * o * weight_itemsize + hqq.build_bytes(i, o) for i, o in shapes)


def dense_projections(layer: nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name relative to the layer, [out, in] weight, bias) of each projection of a target
    layer, the stored names (q_proj, not qkv_proj): stacked ones split into their parts,
    packed ones rebuilt dense (in fp32, one at a time)."""
    for name, module in layer.named_modules():
        if isinstance(module, FusedLinear):
            owner = name.rpartition(".")[0]
            row = 0
            for part, rows in module.parts:
                bias = module.bias[row : row + rows] if module.bias is not None else None
                yield f"{owner}.{part}" if owner else part, module.weight[row : row + rows], bias
                row += rows
        elif isinstance(module, PackedLinear):
            yield name, module.dequantize(torch.float32), module.bias
        elif isinstance(module, nn.Linear):
            yield name, module.weight, module.bias


def quantized_layer(
    config: ModelConfig, index: int, dense: nn.Module, device: torch.device, dtype: torch.dtype
) -> nn.Module:
    """A substitute layer for the target's `dense` (CPU) layer: its projections HQQ-packed
    on `device` (one projection's weight is copied there at a time: a GPU optimises it in
    a fraction of the CPU's time), the rest copied (norms, attention sinks, a mixture's
    router: a few kilobytes a layer)."""
    with torch.device(device):
        layer = architecture(config).block(config, index)
    _quantize_into(layer, dense, device)
    return layer.to(device=device, dtype=dtype)


def _quantize_into(module: nn.Module, dense: nn.Module, device: torch.device) -> None:
    """`module` (the substitute's, on `device`) made from the target's `dense`: each of its
    HQQ projections quantized from the dense one of the same name, every other parameter
    copied by name (a router stays exact: which experts a draft token reads is the
    target's choice, at its few kilobytes)."""
    modules = dict(module.named_modules())
    quantized: set[str] = set()
    for name, weight, bias in dense_projections(dense):
        target = modules[name]
        if not isinstance(target, HQQLinear):
            continue  # kept as the target's: copied with the other parameters below
        target.quantize_from(weight.detach().to(device))
        if bias is not None and target.bias is not None:
            target.bias.data.copy_(bias.detach())
        quantized.add(name)
    theirs = dict(dense.named_parameters())
    for name, param in module.named_parameters():
        owner = name.rpartition(".")[0]
        if owner in quantized:
            continue
        if name not in theirs or theirs[name].shape != param.shape:
            raise ValueError(f"the substitute's {name} has no counterpart in the target's layer")
        param.data.copy_(theirs[name].detach())


def routed_copies_layer(
    config: ModelConfig,
    index: int,
    dense: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    quantize: bool = True,
) -> nn.Module:
    """The substitute layer of a mixture's layer whose routed experts live in host RAM
    (`--experts stream|cpu`): the target's own attention, norms, router and shared expert
    (resident on the device: shared, as a resident layer is its own substitute) around
    HQQ copies of every routed expert on `device`, resident, so a draft pass moves no
    expert. `quantize` False leaves the copies empty (a stored substitute is read into
    them: daemon/substitute_cache.py)."""
    with torch.device("meta"):
        layer = architecture(config).block(config, index)
    theirs = dense.get_submodule("mlp")
    moe = layer.get_submodule("mlp")
    for name, child in dense.named_children():
        if name != "mlp":
            setattr(layer, name, child)
    for name, child in theirs.named_children():
        if name != "experts":
            setattr(moe, name, child)
    copies = nn.ModuleList()
    their_experts = cast(nn.ModuleList, theirs.get_submodule("experts"))
    for expert, own in zip(cast(nn.ModuleList, moe.experts), their_experts, strict=True):
        expert = expert.to_empty(device=device)
        if quantize:
            _quantize_into(expert, own, device)
        copies.append(expert.to(dtype=dtype))
    moe.experts = copies
    return layer


# Makes a substitute layer: (its index, the target's dense layer) → the quantized layer.
LayerMaker = Callable[[int, nn.Module], nn.Module]


def empty_layer(
    config: ModelConfig, index: int, device: torch.device, dtype: torch.dtype
) -> nn.Module:
    """Substitute layer `index` of `config` (HQQ-packed) with nothing in it yet, on
    `device`: what a stored substitute's tensors are loaded into."""
    with torch.device(device):
        layer = architecture(config).block(config, index)
    return layer.to(dtype=dtype)


def build_substitute(
    target: Transformer,
    bits: int,
    layers: Sequence[nn.Module],
    quantize: Callable[[int], bool],
    device: torch.device,
    progress: Callable[[int, int], None] | None = None,
    make: LayerMaker | None = None,
) -> Transformer:
    """The substitute for `target`, from its `layers` (every decoder layer, as loaded on
    the CPU, before placement): layer i is quantized where `quantize(i)` (by `make`,
    default `quantized_layer`; the daemon's loads a stored one when it has it), else it
    is the target's own module (which placement puts on the device). Embedding, norm,
    head and the RoPE table are the target's. `progress(done, total)` after each layer."""
    config = substitute_config(target.config, bits)
    if make is None and shares_packed(target.config, bits):
        make = lambda i, layer: copy.deepcopy(layer).to(device)  # noqa: E731 (as stored)
    with torch.device("meta"):
        substitute = Transformer(config)
    substitute.embed_tokens = target.embed_tokens
    substitute.norm = target.norm
    substitute.lm_head = target.lm_head
    substitute.share_rope(target)
    substitute.vocab_width = target.vocab_width
    # One rebuild scratch for both (a packed target's and the substitute's projections):
    # the two never run a pass at once, and the plan counts the larger once.
    substitute.rebuild_scratch = target.rebuild_scratch
    built = nn.ModuleList()
    total = len(layers)
    for i, layer in enumerate(layers):
        if quantize(i):
            new = (
                make(i, layer)
                if make is not None
                else quantized_layer(config, i, layer, device, target.dtype)
            )
            for module in new.modules():
                if isinstance(module, PackedLinear):
                    module.scratch = substitute.rebuild_scratch
            built.append(new)
        else:
            built.append(layer)
        if progress is not None:
            progress(i + 1, total)
    substitute.set_layers(built)
    return substitute


def share_placed(substitute: Transformer, target: Transformer) -> None:
    """After `target` is placed: the substitute's RoPE table is the target's again (moving a
    module replaces its buffers; its shared embedding, norm and head moved in place)."""
    substitute.share_rope(target)
