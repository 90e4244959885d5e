"""The streamer on a real GPU: pinned host buffers, copies on the copy stream, exact logits.
Skipped cleanly without CUDA (`pytest -m gpu` on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.placement import disk_sources
from offload.placement import build_streamer
from speculative.checkpoint import load

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT = [1, 403, 407, 261, 378, 432, 383]


def logits(model, cache_len: int = 32) -> list[torch.Tensor]:
    cache = model.new_cache(cache_len)
    n = len(PROMPT)
    out = [model(torch.tensor(PROMPT), torch.arange(n), cache)]
    out.append(model(torch.tensor([300]), torch.tensor([n]), cache))
    t = 4
    mask = torch.zeros(t, cache.length + t, dtype=torch.bool)
    mask[:, : cache.length] = True
    for i, parent in enumerate([-1, 0, 0, 1]):
        if parent >= 0:
            mask[i] |= mask[parent]
        mask[i, cache.length + i] = True
    positions = cache.length + torch.tensor([0, 1, 1, 2])
    out.append(model(torch.tensor([5, 6, 7, 8]), positions, cache, mask=mask))
    return [x.cpu() for x in out]


@pytest.mark.parametrize(("tier", "slots", "resident"), [("ram", 2, []), ("disk", 3, [0])])
def test_streamed_logits_on_gpu_equal_resident(
    stories_target: Path, tier: str, slots: int, resident: list[int]
) -> None:
    reference, _, _ = load(stories_target, "fp32", "cuda")
    model, _, ckpt = load(stories_target, "fp32", "cpu")
    layers = list(model.layers)
    streamed = [i for i in range(len(layers)) if i not in resident]
    names = [n for n, _ in layers[0].named_parameters()]
    sources = disk_sources(ckpt, streamed, names) if tier == "disk" else None
    streamer = build_streamer(layers, resident, "cuda", slots, tier, sources)
    model.set_layers(streamer)
    model.to("cuda")
    for want, got in zip(logits(reference), logits(model), strict=True):
        assert torch.equal(want, got)

    # Host buffers (or staging) are pinned: the copies are real asynchronous DMA.
    if tier == "ram":
        assert all(b.is_pinned() for b in streamer.storage.buffers.values())
    else:
        assert all(s.staging is not None and s.staging.is_pinned() for s in streamer.slots)
    # The copies ran on the dedicated stream, timed by events recorded there.
    assert streamer.copy_stream is not None
    assert streamer.copy_stream != torch.cuda.current_stream()
    assert all(s.ready is not None for s in streamer.slots)
    stats = streamer.stats()
    assert stats["stream_seconds"] > 0 and stats["stream_gbps"] > 0
    # Slot buffers live on the GPU; nothing else of the streamed layers does.
    assert all(b.device.type == "cuda" for b in streamer.device_buffers())
    assert len(streamer.device_buffers()) == slots


# About 10 ms of spinning on an H100/H200 (~2 GHz): far longer than any copy or layer here,
# so a missing stream dependency shows up as wrong logits instead of passing by luck.
SPIN_CYCLES = 20_000_000


class SlowCompute:
    """Yields the streamer's layers with a spin kernel queued on the compute stream before
    each one: the copy into a slot must wait for the (late) compute that reads it."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __iter__(self):
        for layer in self.inner:
            torch.cuda._sleep(SPIN_CYCLES)
            yield layer

    def __len__(self) -> int:
        return len(self.inner)


@pytest.mark.parametrize(("tier", "slow"), [("ram", "compute"), ("ram", "copy"), ("disk", "copy")])
def test_stream_dependencies_hold_when_one_stream_lags(
    stories_target: Path, tier: str, slow: str
) -> None:
    """Slow compute: slots are not overwritten before their layer ran (the `released` wait).
    Slow copies: layers do not run before their copy landed (the `ready` wait), and the disk
    tier does not refill a staging buffer a pending copy still reads."""
    reference, _, _ = load(stories_target, "fp32", "cuda")
    model, _, ckpt = load(stories_target, "fp32", "cpu")
    layers = list(model.layers)
    streamed = list(range(len(layers)))
    names = [n for n, _ in layers[0].named_parameters()]
    sources = disk_sources(ckpt, streamed, names) if tier == "disk" else None
    streamer = build_streamer(layers, [], "cuda", 2, tier, sources)
    model.to("cuda")
    if slow == "compute":
        model.set_layers(SlowCompute(streamer))
    else:
        fill = streamer.storage.host_buffer

        def late_fill(layer: int, staging: torch.Tensor | None) -> torch.Tensor:
            with torch.cuda.stream(streamer.copy_stream):
                torch.cuda._sleep(SPIN_CYCLES)  # queued ahead of this layer's copy
            return fill(layer, staging)

        streamer.storage.host_buffer = late_fill  # type: ignore[method-assign]
        model.set_layers(streamer)
    for want, got in zip(logits(reference), logits(model), strict=True):
        assert torch.equal(want, got)
    assert streamer.counters.copies > len(streamed)  # slots were reused within passes
