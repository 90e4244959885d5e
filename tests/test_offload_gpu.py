"""The streamer on a real GPU: pinned host buffers, copies on the copy stream, exact logits.
Skipped cleanly without CUDA (`pytest -m gpu` on a GPU machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from daemon.target_loading import disk_sources
from modeling.checkpoints.checkpoint import load
from offload.arena import HostArena, arena_bytes
from offload.placement import build_streamer
from offload.slots import MAX_TIMED_COPIES

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
    sources = disk_sources(ckpt, streamed, names, "fp32") if tier == "disk" else None
    streamer = build_streamer(layers, resident, "cuda", slots, tier, sources)
    model.set_layers(streamer)
    model.to("cuda")
    for want, got in zip(logits(reference), logits(model), strict=True):
        assert torch.equal(want, got)

    # Host buffers (or staging) are slices of one arena page-locked in place
    # (cudaHostRegister): the copies are real asynchronous DMA, with no pinned rounding.
    assert streamer.host_pinned and streamer.stats()["host_pinned"] == 1
    if tier == "ram":
        assert streamer.storage.pinned
        assert all(b.is_pinned() for b in streamer.storage.buffers.values())
        assert streamer.host_bytes == arena_bytes(streamer.layout.nbytes, len(streamed))
    else:
        assert all(s.staging is not None and s.staging.is_pinned() for s in streamer.slots)
        assert streamer.host_bytes == arena_bytes(streamer.layout.nbytes, slots)
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
    sources = disk_sources(ckpt, streamed, names, "fp32") if tier == "disk" else None
    streamer = build_streamer(layers, [], "cuda", 2, tier, sources)
    if slow == "compute":
        model.set_layers(SlowCompute(streamer))
    else:
        # Disk: the sleep is queued by the reader thread, ahead of the copy the compute thread
        # issues once the read is joined.
        name = "read" if tier == "disk" else "fetch"
        fill = getattr(streamer.storage, name)

        def late_fill(layer: int, staging: torch.Tensor | None, after=None):
            with torch.cuda.stream(streamer.copy_stream):
                torch.cuda._sleep(SPIN_CYCLES)  # queued ahead of this layer's copy
            return fill(layer, staging, after)

        setattr(streamer.storage, name, late_fill)
        model.set_layers(streamer)
    model.to("cuda")  # embeddings, norm and head; the streamed layers are on the meta device
    for want, got in zip(logits(reference), logits(model), strict=True):
        assert torch.equal(want, got)
    assert streamer.counters.copies > len(streamed)  # slots were reused within passes


def test_arena_is_page_locked_in_place_and_unlocked_on_close() -> None:
    arena = HostArena(3 * 2**20 + 64, 3)  # not a power of two: nothing rounds it up
    assert arena.pin(torch.device("cuda")) and arena.pinned
    assert all(arena.view(k).is_pinned() for k in range(3))
    data = torch.randint(0, 256, (arena.slice_bytes,), dtype=torch.uint8)
    arena.view(1).copy_(data)
    device = torch.empty(arena.slice_bytes, dtype=torch.uint8, device="cuda")
    device.copy_(arena.view(1), non_blocking=True)
    assert torch.equal(device.cpu(), data)
    arena.close()
    assert not arena.pinned and not arena.view(1).is_pinned()
    assert torch.equal(arena.view(1), data)  # still valid memory, now pageable


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_timing_events_stay_bounded_over_many_passes(stories_target: Path, tier: str) -> None:
    """Each copy is timed by two CUDA events; they are folded into the counters as they
    complete, so a long generation does not accumulate them."""
    model, _, ckpt = load(stories_target, "fp32", "cpu")
    layers = list(model.layers)
    streamed = list(range(len(layers)))
    names = [n for n, _ in layers[0].named_parameters()]
    sources = disk_sources(ckpt, streamed, names, "fp32") if tier == "disk" else None
    streamer = build_streamer(layers, [], "cuda", 2, tier, sources)
    model.set_layers(streamer)
    model.to("cuda")
    cache = model.new_cache(8)
    passes = 300
    for _ in range(passes):  # no host synchronisation: the compute thread may run ahead
        cache.truncate(0)
        model(torch.tensor([1, 2, 3]), torch.arange(3), cache)
        assert streamer.timed_copies_pending() <= len(streamer.slots) * MAX_TIMED_COPIES
    streamer.wait_reads()  # the last wrap-around's reads (disk), so every copy is counted
    stats = streamer.stats()
    assert streamer.timed_copies_pending() == 0
    assert streamer.counters.copies == passes * len(streamed) + 2
    assert stats["stream_seconds"] > 0


def test_a_gguf_read_from_the_disk_tier_on_gpu_computes_what_it_does_in_ram() -> None:
    """A GGUF's layers read from its file at every pass into page-locked staging (their
    q/k rows and norms converted on the way, the other blocks read in place) and copied to
    the GPU: the logits of the same file with every layer on the GPU, bit for bit."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from tests.test_gguf_model import GGUF

    base = {"model": str(GGUF / "llama-rand-256-Q4_K_M.gguf"), "device": "cuda",
            "dtype": "fp32", "context": 64}  # fmt: skip
    disk = Runtime(
        RuntimeOptions(**base, offload="stream", resident_layers=0, host_tier="disk", slots=2)
    )
    assert disk.streamer is not None and disk.streamer.storage.tier == "disk"
    assert all(s.staging is not None and s.staging.is_pinned() for s in disk.streamer.slots)
    plain = Runtime(RuntimeOptions(**base, offload="none"))
    for want, got in zip(logits(plain.target), logits(disk.target), strict=True):
        assert torch.equal(want, got)
