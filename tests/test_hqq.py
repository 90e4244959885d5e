"""Half-quadratic quantization (modeling/weights/hqq.py) against a straightforward reference of
the same optimisation, written element by element, and against plain min-max rounding;
the packed layout round trip at every width the substitute draft uses."""

from __future__ import annotations

import math

import pytest
import torch

from modeling.weights import hqq
from modeling.weights.hqq import HQQLinear, optimise_zero, pack, quantize
from modeling.weights.packed import unpack


def reference_zero(w: list[float], scale: float, zero: float, bits: int) -> float:
    """The module's iteration for one group, as scalar Python: codes, error, the l_p
    proximal step, the zero's closed form, stop when the error stops falling."""
    top = 2**bits - 1
    best, best_error, beta = zero, math.inf, hqq.BETA
    for _ in range(hqq.ITERATIONS):
        codes = [min(max(round(x / scale + zero), 0), top) for x in w]
        rebuilt = [(c - zero) * scale for c in codes]
        error = sum(abs(x - r) for x, r in zip(w, rebuilt, strict=True)) / len(w)
        if error >= best_error:
            break
        best, best_error = zero, error
        residual = []
        for x, r in zip(w, rebuilt, strict=True):
            d = x - r
            mag = max(abs(d) - abs(d) ** (hqq.LP_NORM - 1) / beta, 0.0) if d else 0.0
            residual.append(math.copysign(mag, d))
        zero = sum(c - (x - e) / scale for c, x, e in zip(codes, w, residual, strict=True)) / len(w)
        beta *= hqq.KAPPA
    return best


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_zero_point_is_the_references(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(3, 16, generator=gen, dtype=torch.float64)  # 3 groups of 16
    w[0, 5] = 6.0  # an outlier: min-max stretches its group's range
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    got = optimise_zero(w, scale, -lo / scale, bits)
    for g in range(3):
        want = reference_zero(w[g].tolist(), float(scale[g]), float(-lo[g] / scale[g]), bits)
        assert float(got[g]) == pytest.approx(want, abs=1e-9), g


def lp_error(w: torch.Tensor, rebuilt: torch.Tensor) -> float:
    return float((w - rebuilt).abs().pow(hqq.LP_NORM).sum())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_hqq_beats_min_max_rounding_where_it_matters(bits: int) -> None:
    """On heavy-tailed weights (a real model's have outliers), the optimised zero points
    give a smaller l_p error than min-max rounding with the same scales."""
    gen = torch.Generator().manual_seed(10 + bits)
    w = torch.distributions.StudentT(3.0).sample((256, 128)).float()
    codes, scale, zero = quantize(w, bits, 64)
    s, z = scale.float().repeat_interleave(64, 1), zero.float().repeat_interleave(64, 1)
    rebuilt = (codes.float() - z) * s
    lo = w.view(256, 2, 64).amin(-1).repeat_interleave(64, 1)
    plain = torch.round(w / s - lo / s).clamp(0, 2**bits - 1) * s + lo
    assert codes.min() >= 0 and codes.max() <= 2**bits - 1
    assert lp_error(w, rebuilt) < lp_error(w, plain)
    del gen


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("inputs", [64, 192])
def test_packing_round_trips_at_every_width(bits: int, inputs: int) -> None:
    """3 bits pack ten codes a word: 64 and 192 inputs leave the last word part padding."""
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (5, inputs), generator=gen)
    words = pack(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (5, -(-inputs // (32 // bits)))
    assert torch.equal(unpack(words, bits, 1, torch.long)[:, :inputs], codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_a_packed_projection_computes_with_its_dequantized_weight(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    dense = torch.randn(48, 128, generator=gen)
    layer = HQQLinear(128, 48, False, bits, 64)
    layer.quantize_from(dense)
    codes, scale, zero = quantize(dense, bits, 64)
    want = (
        codes.float() - zero.float().repeat_interleave(64, 1)
    ) * scale.float().repeat_interleave(64, 1)
    assert torch.equal(layer.dequantize(torch.float32), want)
    x = torch.randn(3, 128, generator=gen)
    assert torch.allclose(layer(x), x @ want.T)
    # More bits, a closer copy.
    assert float((want - dense).abs().mean()) < 0.6 / 2 ** (bits - 2)
