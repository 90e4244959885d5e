"""The gated MLP every architecture here uses: down(act(gate(x)) * up(x)), SwiGLU with
SiLU (Llama, Qwen, Mistral) or GeGLU with tanh GELU (Gemma), gate and up stacked when
dense (or as the checkpoint stores them, Phi-3's `gate_up_proj`). The activation is
config.json's `hidden_act` (`ACTIVATIONS`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from modeling.config import ModelConfig
from modeling.weights.packed import PackedLinear
from modeling.weights.projections import FusedLinear, linear, projection, stacked


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: the gate/up width where it is not the config's (an expert's)."""
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.in_place = cfg.hidden_act == "silu"  # Llama's, bit for bit as it always ran
        d, f = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_up_proj: nn.Linear | PackedLinear | None = None
        self.gate_proj: nn.Linear | PackedLinear | None = None
        self.up_proj: nn.Linear | PackedLinear | None = None
        if cfg.stored_fused:  # stored as one (Phi-3), gate's rows first: kept as stored
            self.gate_up_proj = projection(cfg, d, 2 * f, cfg.mlp_bias)
        elif cfg.quantization is None:
            self.gate_up_proj = FusedLinear(d, [("gate_proj", f), ("up_proj", f)], cfg.mlp_bias)
        else:
            self.gate_proj = projection(cfg, d, f, cfg.mlp_bias)
            self.up_proj = projection(cfg, d, f, cfg.mlp_bias)
        self.down_proj = projection(cfg, f, d, cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up: torch.Tensor | None
        if self.gate_up_proj is not None:
            gate_up = linear(self.gate_up_proj, x)
        else:  # packed: one kernel call where the format has one, else two products
            gate_up = stacked((self.gate_proj, self.up_proj), x)
        if gate_up is not None:
            gate, up = gate_up.chunk(2, dim=-1)  # (T, f) views each
            # In place: the peak stays gate/up and act(gate), 3f per token, as unfused.
            return linear(self.down_proj, self.act(gate).mul_(up))
        assert self.gate_proj is not None and self.up_proj is not None
        return linear(self.down_proj, self.act(linear(self.gate_proj, x)) * linear(self.up_proj, x))
