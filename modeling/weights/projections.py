"""The decoder's projections: how one is built (dense or packed as config.json says) and
applied, and the dense ones the model holds stacked (`FusedLinear`: q/k/v, gate/up) with the
mapping between their stacked rows and the separate tensors a checkpoint stores.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from modeling.config import ModelConfig
from modeling.weights.packed import PackedLinear


def linear(module: nn.Linear | PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` without nn.Module's call machinery (hooks are never used here), which at
    decode sizes costs as much as the matmul itself. Reads the tensors at call time, so a
    streamer that rebinds them keeps working. A packed projection's weight is rebuilt in
    the compute dtype for this call only, or computed from its blocks where a kernel does
    (`PackedLinear.product`)."""
    if isinstance(module, PackedLinear):
        return module.product(x)
    return F.linear(x, module.weight, module.bias)


def stacked(
    modules: Sequence[nn.Linear | PackedLinear | None], x: torch.Tensor
) -> torch.Tensor | None:
    """The products of x by several projections of it (a packed layer's q/k/v, its gate/up)
    side by side, (..., their outputs summed), where their format computes them in one call
    (`PackedLinear.stacked_product`: GGUF blocks on the CPU kernels, one call where there
    were three); None otherwise: each is then applied with `linear`, to the same values."""
    first = modules[0]
    if isinstance(first, PackedLinear):
        return first.stacked_product(modules[1:], x)
    return None


def projection(cfg: ModelConfig, n_in: int, n_out: int, bias: bool) -> nn.Linear | PackedLinear:
    """A decoder projection: packed as config.json's quantization_config says, else plain."""
    if cfg.quantization is not None:
        return cfg.quantization.linear(n_in, n_out, bias)
    return nn.Linear(n_in, n_out, bias=bias)


# Projections of one input that a checkpoint stores apart and the model holds stacked along
# the output, one matmul for all (`FusedLinear`): fused name → the stored parts, in order.
FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class FusedLinear(nn.Linear):
    """Several dense projections of the same input stacked along the output ([sum(rows),
    in]): one kernel where there were several, each part's output a view of the result.
    Packed projections are never fused: fusing gate/up would double the rebuild scratch
    (the largest projection's weight) and GPTQ/AWQ interleave outputs within words, so the
    disk tier could not read their parts as consecutive bytes."""

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]], bias: bool) -> None:
        super().__init__(in_features, sum(rows for _, rows in parts), bias=bias)
        self.parts = tuple(parts)  # (stored name, output rows), in stacking order

    def extra_repr(self) -> str:
        return super().extra_repr() + ", parts=" + "+".join(f"{n}:{r}" for n, r in self.parts)


def stored_names(name: str) -> list[str]:
    """The names a checkpoint stores tensor `name` under, rows stacked in this order:
    "layers.3.self_attn.qkv_proj.weight" → [...q_proj.weight, ...k_proj.weight,
    ...v_proj.weight]; any other name is stored as itself."""
    owner, _, attr = name.rpartition(".")
    parent, _, module = owner.rpartition(".")
    parts = FUSED_PROJECTIONS.get(module)
    if parts is None:
        return [name]
    prefix = f"{parent}." if parent else ""
    return [f"{prefix}{part}.{attr}" for part in parts]


def stored_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` under the names a checkpoint stores (inverse of loading): each
    stacked tensor as its parts, copies of their rows (a file holds no shared storage)."""
    state = model.state_dict()
    for part, (fused, row, end) in fused_parts(model).items():
        state[part] = state[fused][row:end].clone()
    for fused in {fused for fused, _, _ in fused_parts(model).values()}:
        del state[fused]
    return state


def fused_parts(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Every stored tensor that is part of a fused projection of `model` → (the fused
    tensor's name, first row, end row) inside it."""
    out: dict[str, tuple[str, int, int]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FusedLinear):
            continue
        attrs = ("weight", "bias") if module.bias is not None else ("weight",)
        for attr in attrs:
            row = 0
            for stored, (_, rows) in zip(stored_names(f"{name}.{attr}"), module.parts, strict=True):
                out[stored] = (f"{name}.{attr}", row, row + rows)
                row += rows
    return out


@torch.no_grad()
def dequantize_projections(owner: nn.Module, dtype: torch.dtype) -> None:
    """Replace `owner`'s packed projections by plain ones holding their rebuilt weights in
    `dtype`, q/k/v and gate/up stacked as a dense checkpoint's are (`FusedLinear`): each
    part is rebuilt straight into its rows, so the peak is what is dense so far plus the
    shared rebuild scratch, never a part twice."""
    for fused, names in FUSED_PROJECTIONS.items():
        parts = [getattr(owner, name, None) for name in names]
        packed = [p for p in parts if isinstance(p, PackedLinear)]
        if len(packed) == len(names):
            setattr(owner, fused, _rebuilt_stacked(names, packed, dtype))
            for name in names:
                setattr(owner, name, None)
    for name, child in list(owner.named_children()):
        if isinstance(child, PackedLinear):
            setattr(owner, name, _rebuilt(child, dtype))


def _rebuilt(packed: PackedLinear, dtype: torch.dtype) -> nn.Linear:
    with torch.device("meta"):  # no throwaway weight: it is set just below
        dense = nn.Linear(packed.in_features, packed.out_features, bias=False)
    # A copy: the rebuilt weight lives in the shared scratch.
    dense.weight = nn.Parameter(packed.dequantize(dtype).clone(), requires_grad=False)
    dense.bias = packed.bias  # type: ignore[assignment]  # None or the packed one's
    return dense


def _rebuilt_stacked(
    names: Sequence[str], parts: list[PackedLinear], dtype: torch.dtype
) -> FusedLinear:
    bias = parts[0].bias is not None
    with torch.device("meta"):  # no throwaway weight: it is set just below
        module = FusedLinear(
            parts[0].in_features,
            [(n, p.out_features) for n, p in zip(names, parts, strict=True)],
            bias,
        )
    device = next(parts[0].buffers()).device
    weight = torch.empty(module.out_features, module.in_features, dtype=dtype, device=device)
    row = 0
    for part in parts:
        weight[row : row + part.out_features].copy_(part.dequantize(dtype))
        row += part.out_features
    module.weight = nn.Parameter(weight, requires_grad=False)
    if bias:
        stacked = torch.cat([p.bias for p in parts])  # type: ignore[misc]
        module.bias = nn.Parameter(stacked, requires_grad=False)
    return module
