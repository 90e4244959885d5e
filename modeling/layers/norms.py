"""RMS normalisation, as the references compute it: normalised in fp32 and scaled in the
model dtype (Llama), or scaled by `offset + weight` in fp32 (the `(1 + w)` norms of Gemma,
`offset=1.0`)."""

from __future__ import annotations

import torch
from torch import nn

from modeling.weights import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype is torch.float32 and not torch.compiler.is_compiling():
            # A few rows (a decode step's two per layer): one call of the CPU kernels, the
            # same operations summed in another order; None where they do not take x.
            y = cpu_kernels.rms_norm(x, self.weight, self.eps, self.offset)
            if y is not None:
                return y
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            # Scaled in fp32 before the cast, as Gemma's reference does.
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        # Normalise in fp32, scale in the model dtype, as Llama's reference does.
        return self.weight * x32.to(dtype)


def norm_bytes(n: int, itemsize: int) -> int:
    """`RMSNorm`'s peak bytes over `n` values in a model dtype of `itemsize` bytes: the fp32
    input and x²; then the normalised fp32, its cast and the weighted output (the casts
    are no copies in fp32)."""
    fp32_copy = 4 if itemsize != 4 else 0
    to_dtype = itemsize if itemsize != 4 else 0
    return max(fp32_copy + 4, 4 + to_dtype + itemsize) * n
