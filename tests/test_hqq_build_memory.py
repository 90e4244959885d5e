"""Building a substitute projection (`HQQLinear.quantize_from`) holds one block of rows'
temporaries at a time, whatever the projection's size: measured in a child process
(tests/peak_probe.py) against `hqq.build_bytes`, the figure the memory plan reserves.
Quantizing the whole projection at once held its codes as int64 (8 bytes a weight) and
their padded and shifted copies: 1.9 GB each for a 70B's down projection."""

from __future__ import annotations

import json

import torch

import modeling.weights.hqq as hqq
from modeling.weights.hqq import HQQLinear, block_rows, build_bytes
from tests.peak_probe import needs_proc, run_child

# Projections of several blocks each, in bf16 as a target holds them; the child makes the
# blocks an eighth of their size (512k weights) so that this runs in seconds.
SHAPES = [(1024, 2048), (512, 5504), (2048, 1024)]
CHILD_BLOCK_WEIGHTS = 1 << 19


def measure(out: int, inputs: int) -> dict:
    from offload.machine import PeakMemory

    weight = torch.randn(out, inputs, generator=torch.Generator().manual_seed(0)).bfloat16()
    layer = HQQLinear(inputs, out, False, 4, 64)
    with PeakMemory("cpu") as peak:
        layer.quantize_from(weight)
    result = sum(b.numel() * b.element_size() for b in layer.buffers())
    return {"shape": [out, inputs], "measured": peak.bytes, "result": result,
            "planned": build_bytes(inputs, out), "blocks": -(-out // block_rows(inputs))}  # fmt: skip


@needs_proc
def test_the_build_holds_one_block_at_a_time() -> None:
    for row in run_child(__file__):
        assert row["blocks"] > 1, row  # the projection is more than one block
        assert row["measured"] <= row["planned"] + row["result"], row
        assert row["planned"] + row["result"] <= 1.25 * row["measured"], row


if __name__ == "__main__":
    torch.set_num_threads(1)
    hqq.BLOCK_WEIGHTS = CHILD_BLOCK_WEIGHTS
    # PyTorch's first use of these kernels sets things up once (~10 MB): not the build's.
    HQQLinear(2048, 64, False, 4, 64).quantize_from(torch.randn(64, 2048).bfloat16())
    print(json.dumps([measure(*shape) for shape in SHAPES]))
