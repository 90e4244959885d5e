"""Dequantizing packed projections (`dequantize_projections`, what `dequantize_layers` does
when the plan keeps the layers dense) holds each part once: its peak is the dense weights it
makes plus the shared rebuild scratch the plan counts, measured in a child process
(tests/peak_probe.py). Stacking rebuilt parts with a concatenation held every q/k/v and
gate/up part twice."""

from __future__ import annotations

import json

import torch
from torch import nn

from modeling.weights.packed import RebuildScratch
from modeling.weights.projections import FusedLinear, dequantize_projections
from modeling.weights.quant import on_load_quantization
from tests.peak_probe import needs_proc, run_child

# An MLP of a real 8B's width at a quarter scale: gate/up stacked are 2 x 29 MB in fp32.
HIDDEN, INTERMEDIATE = 1024, 3584


def measure() -> dict:
    from offload.machine import PeakMemory

    torch.manual_seed(0)
    spec = on_load_quantization("int8")
    scratch = RebuildScratch()
    owner = nn.Module()
    shapes = {"gate_proj": (HIDDEN, INTERMEDIATE), "up_proj": (HIDDEN, INTERMEDIATE)}
    shapes["down_proj"] = (INTERMEDIATE, HIDDEN)
    planned_scratch = 0
    for name, (n_in, n_out) in shapes.items():
        packed = spec.linear(n_in, n_out, False)
        packed.quantize_from(torch.randn(n_out, n_in))
        packed.scratch = scratch
        planned_scratch = max(planned_scratch, packed.rebuild_bytes(torch.float32))
        setattr(owner, name, packed)
    with PeakMemory("cpu") as peak:
        dequantize_projections(owner, torch.float32)
    assert isinstance(owner.gate_up_proj, FusedLinear)  # type: ignore[attr-defined]
    dense = sum(p.numel() * p.element_size() for p in owner.parameters())
    return {"measured": peak.bytes, "dense": dense, "scratch": planned_scratch}


@needs_proc
def test_dequantizing_holds_each_part_once() -> None:
    (row,) = run_child(__file__)
    assert row["measured"] <= 1.05 * (row["dense"] + row["scratch"]), row


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps([measure()]))
