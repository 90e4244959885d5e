"""scripts/bench_offload.py's accelerate comparison computes the model it claims to: its
`cpu_offload` wiring is checked on the CPU (accelerate's hooks move weights to an
execution device, which may be the CPU), since the GPU run is the only other place it runs."""

from __future__ import annotations

import torch

from scripts.bench_offload import accelerate_offloaded, random_model


def test_accelerate_offloaded_model_computes_the_same_logits() -> None:
    reference = random_model("small", 2, torch.float32)
    offloaded = accelerate_offloaded("small", 2, torch.float32, torch.device("cpu"))
    # Offloaded for real: between passes the layer weights are not materialised.
    assert offloaded.layers[0].mlp.gate_up_proj.weight.device.type == "meta"
    ids, positions = torch.arange(5), torch.arange(5)
    want = reference(ids, positions, reference.new_cache(8))
    got = offloaded(ids, positions, offloaded.new_cache(8))
    assert torch.equal(want, got)
    assert offloaded.layers[0].mlp.gate_up_proj.weight.device.type == "meta"
