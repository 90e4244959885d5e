"""Host tiers on the CPU path: exact arena sizes (what the plan predicts is what the tier
allocates), the disk tier's reader thread (read-ahead, one copy per byte from the header's
offsets, errors that name the layer and file), and the streamer's bounded timing
bookkeeping."""

from __future__ import annotations

import shutil
import struct
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from daemon.footprint import footprint
from daemon.memory_plan import OffloadOptions, plan_request
from modeling.config import ModelConfig
from modeling.decoder import Transformer
from offload import machine
from offload.arena import PAGE, HostArena, arena_bytes
from offload.layout import FlatLayout
from offload.machine import PeakMemory
from offload.plan import MemoryBudget
from offload.planning import make_plan
from offload.slots import MAX_TIMED_COPIES, CopyTimes
from offload.storage import DiskStorage, LayerReadError, RamStorage, read_header
from scripts.real_shapes import full_config
from tests.test_stream import one_pass, passes, reference_logits, streamed_model

__all__ = ["reference_logits"]  # the fixture, shared with test_stream


SHAPES = {
    "Llama-3.1-8B": full_config("llama-3.1-8b"),
    "Llama-3.1-70B": full_config("llama-3.1-70b"),
}


def meta_layer(config: ModelConfig) -> nn.Module:
    with torch.device("meta"):
        return Transformer(config).to(torch.bfloat16).layers[0]  # type: ignore[index]


def gpu_budget(gpu: float, ram: float) -> MemoryBudget:
    return MemoryBudget("cuda", int(gpu), "configured", int(ram), "configured", 25e9, "configured")


def test_arena_slices_are_disjoint_views_of_one_page_aligned_allocation() -> None:
    arena = HostArena(1000, 5)
    assert arena.nbytes == arena_bytes(1000, 5) == PAGE * ((5000 + PAGE - 1) // PAGE)
    assert arena.flat.data_ptr() % PAGE == 0
    for k in range(5):
        arena.view(k).fill_(k + 1)
    for k in range(5):
        view = arena.view(k)
        assert view.numel() == 1000 and view.data_ptr() == arena.flat.data_ptr() + 1000 * k
        assert torch.all(view == k + 1)
    assert not arena.pin(torch.device("cpu")) and not arena.pinned  # nothing pinned on a CPU
    with pytest.raises(IndexError):
        arena.view(5)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("ram", [64e9, 160e9, 512e9])
def test_plan_host_bytes_equal_what_the_tier_allocates(name: str, ram: float) -> None:
    config = SHAPES[name]
    layout = FlatLayout.of(meta_layer(config))
    f = footprint(config, torch.bfloat16, name)
    assert f.layer_bytes == layout.nbytes  # the plan sizes layers as the streamer lays them out
    request = plan_request(f, None, 8192, OffloadOptions(offload="stream", resident_layers=4))
    plan = make_plan(request, gpu_budget(80e9, ram))
    if plan.host_tier == "ram":
        # RamStorage allocates one arena slice per streamed layer (arithmetic only: no 100 GiB
        # allocation in a test).
        assert plan.host_bytes == arena_bytes(layout.nbytes, plan.streamed_layers)
    else:
        # The streamer's staging: one slice per slot, really allocated (never touched), and
        # a reader's scratch (a piece of a cast: the file's dtype may not be the run's).
        staging = HostArena(layout.nbytes, plan.slots).nbytes
        assert plan.host_bytes == staging + f.disk_scratch_bytes
    # Exact, page-rounded once; not a power of two per layer.
    count = plan.streamed_layers if plan.host_tier == "ram" else plan.slots
    scratch = 0 if plan.host_tier == "ram" else f.disk_scratch_bytes
    assert 0 <= plan.host_bytes - scratch - count * layout.nbytes < PAGE


def test_a_70b_target_on_a_160gb_machine_streams_from_ram(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 160 GB machine with 150 GB available, budgeted as `--ram-budget auto` does (minus
    # its reserve), with a 24 GB card.
    memory = SimpleNamespace(total=160 * 10**9, available=150 * 10**9)
    monkeypatch.setattr(machine.psutil, "virtual_memory", lambda: memory)
    budget = machine.detect_budget("cpu", "24GB", "auto", "25GB/s", measure=False)
    f = footprint(SHAPES["Llama-3.1-70B"], torch.bfloat16, "70B")
    plan = make_plan(plan_request(f, None, 8192, OffloadOptions()), budget)
    assert plan.streamed_layers > 70 and plan.host_tier == "ram"
    assert plan.host_bytes == arena_bytes(f.layer_bytes, plan.streamed_layers) <= budget.ram_bytes
    # What pinning each layer through PyTorch's caching host allocator would have needed:
    # more than the budget, which used to push this target to the disk tier.
    rounded = plan.streamed_layers * (1 << (f.layer_bytes - 1).bit_length())
    assert rounded > budget.ram_bytes


def test_ram_storage_host_bytes_is_its_arena(stories_target: Path) -> None:
    _, streamer, _ = streamed_model(stories_target, [1], 2, "ram")
    assert isinstance(streamer.storage, RamStorage) and streamer.staging is None
    assert streamer.host_bytes == arena_bytes(streamer.layout.nbytes, 4)
    assert streamer.stats()["host_bytes"] == streamer.host_bytes
    assert streamer.stats()["host_pinned"] == 0  # a CPU device pins nothing


def test_disk_tier_reads_on_the_reader_thread_and_reads_ahead(
    stories_target: Path, reference_logits: list[torch.Tensor]
) -> None:
    model, streamer, _ = streamed_model(stories_target, [], 2, "disk")
    storage = streamer.storage
    assert isinstance(storage, DiskStorage)
    assert streamer.staging is not None
    assert streamer.host_bytes == arena_bytes(streamer.layout.nbytes, 2)
    for ref, out in zip(reference_logits, passes(model), strict=True):
        assert torch.equal(ref, out)
    threads = {t.ident: t.name for t in threading.enumerate()}
    assert threading.get_ident() not in storage.read_threads
    assert len(storage.read_threads) == 1
    (reader,) = storage.read_threads
    assert threads[reader].startswith("specd-disk-read")

    # The wrap-around read the next pass's first layers in the background, unasked: a pass
    # reads the rest, then (wrapping around) the first two again for the pass after.
    streamer.wait_reads()
    storage.read_log.clear()
    one_pass(model)
    streamer.wait_reads()
    assert list(storage.read_log) == [2, 3, 4, 0, 1]

    streamer.close()  # reads finished, reader stopped, files released
    assert storage.read_log[-1] == 1
    with pytest.raises(RuntimeError, match="shutdown"):
        storage.fetch(0, streamer.slots[0].staging)


def test_a_reader_error_surfaces_on_the_compute_thread_naming_layer_and_file(
    stories_target: Path, reference_logits: list[torch.Tensor], tmp_path: Path
) -> None:
    copy = tmp_path / "stories"
    shutil.copytree(stories_target, copy)
    model, _, _ = streamed_model(copy, [], 2, "disk")
    weights = copy / "model.safetensors"
    intact = weights.read_bytes()
    (length,) = struct.unpack("<Q", intact[:8])
    weights.write_bytes(intact[: 8 + length])  # header only: every tensor read comes up short
    with pytest.raises(LayerReadError, match=r"layer 0 .*model\.safetensors") as err:
        one_pass(model)
    assert isinstance(err.value.__cause__, EOFError)
    # The file is readable again: the next pass reads afresh, not the stale failure.
    weights.write_bytes(intact)
    assert torch.equal(passes(model)[0], reference_logits[0])


class Wide(nn.Module):
    """A layer big enough (32 MiB) that a second host copy would show in the peak RSS."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.up = nn.Linear(1024, 4096, bias=False, dtype=dtype)
        self.down = nn.Linear(4096, 1024, bias=False, dtype=dtype)


def wide_checkpoint(tmp_path: Path, dtype: torch.dtype) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    layer = Wide(dtype)
    tensors = {f"model.layers.0.{n}": p.detach().clone() for n, p in layer.named_parameters()}
    path = tmp_path / "wide.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_disk_read_is_one_copy_from_the_header_offsets(tmp_path: Path) -> None:
    path, tensors = wide_checkpoint(tmp_path, torch.float32)
    layout = FlatLayout.of(Wide(torch.float32).to("meta"))
    names = [e.name for e in layout.tensors]
    storage = DiskStorage(layout, {0: {n: (path, f"model.layers.0.{n}") for n in names}})
    staging = HostArena(layout.nbytes, 1).view(0)
    staging.fill_(0)  # touched: resident before the measurement
    with PeakMemory("cpu") as peak:
        storage.fetch(0, staging).result()  # the first read: thread start and file open too
    if peak.bytes is None:
        pytest.skip("no /proc peak-RSS probe on this system")
    # Read straight from the file into staging: no layer-sized intermediate tensor and no
    # mapping of the file's pages into the process (safetensors' get_tensor, then copy_,
    # adds the layer's 32 MiB here).
    assert peak.bytes < layout.nbytes // 8, peak.bytes
    # The staging bytes are the file's bytes at the offsets its header gives.
    header = read_header(path)
    raw = path.read_bytes()
    for entry in layout.tensors:
        src = header[f"model.layers.0.{entry.name}"]
        got = staging[entry.offset : entry.offset + entry.nbytes]
        assert bytes(got.numpy()) == raw[src.start : src.end]
        assert torch.equal(got.view(entry.dtype).view(entry.shape), tensors[src.key])
    storage.close()


def test_disk_read_casts_when_the_file_dtype_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's tensors in another dtype than the run's are read in pieces and cast into
    place (a bounded scratch), with positioned reads: a file cut short under the tier is an
    error naming it (read through a memory map, it was a SIGBUS that killed the daemon)."""
    from offload import storage as storage_module

    monkeypatch.setattr(storage_module, "CAST_CHUNK_BYTES", 5000)  # (pieces not whole rows)
    path, tensors = wide_checkpoint(tmp_path, torch.bfloat16)
    layout = FlatLayout.of(Wide(torch.float32).to("meta"))
    names = [e.name for e in layout.tensors]
    storage = DiskStorage(layout, {0: {n: (path, f"model.layers.0.{n}") for n in names}})
    staging = HostArena(layout.nbytes, 1).view(0)
    storage.fetch(0, staging).result()
    for name, view in layout.views(staging).items():
        assert torch.equal(view, tensors[f"model.layers.0.{name}"].float())
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(LayerReadError, match=r"wide\.safetensors"):
        storage.fetch(0, staging).result()
    storage.close()


def test_disk_tier_refuses_a_file_whose_shapes_differ(tmp_path: Path) -> None:
    path, _ = wide_checkpoint(tmp_path, torch.float32)
    layout = FlatLayout.of(nn.Linear(1024, 2048, bias=False).to("meta"))
    with pytest.raises(ValueError, match=r"wide\.safetensors holds model\.layers\.0\.up\.weight"):
        DiskStorage(layout, {0: {"weight": (path, "model.layers.0.up.weight")}})


class LateEvent:
    """A fake CUDA timing event that completes `lag` copies after it was recorded."""

    clock = 0

    def __init__(self, lag: int, t: float) -> None:
        self.due = LateEvent.clock + lag
        self.t = t
        self.synchronized = False

    def query(self) -> bool:
        return LateEvent.clock >= self.due or self.synchronized

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end_event: LateEvent) -> float:
        return (end_event.t - self.t) * 1000.0


def test_copy_times_hold_a_bounded_number_of_events_and_lose_no_time() -> None:
    times = CopyTimes()
    folded = 0.0
    for k in range(10_000):
        LateEvent.clock = k
        lag = k % 13  # some copies finish quickly, some lag far behind
        folded += times.add(LateEvent(lag, 0.0), LateEvent(lag, 0.001))
        assert len(times.pending) <= MAX_TIMED_COPIES
    folded += times.fold(wait=True)
    assert not times.pending
    assert folded == pytest.approx(10_000 * 0.001)


def test_streamer_bookkeeping_stays_bounded_over_many_passes(stories_target: Path) -> None:
    model, streamer, _ = streamed_model(stories_target, [], 2)
    for _ in range(200):
        one_pass(model)
        assert streamer.timed_copies_pending() <= len(streamer.slots) * MAX_TIMED_COPIES
    assert streamer.counters.copies == 200 * 5 + 2
    assert streamer.counters.copy_seconds > 0


def test_a_weight_file_that_cannot_be_read_is_a_503_naming_it() -> None:
    """A streamed layer the disk tier cannot read (the file cut short, made unreadable,
    under a running daemon) fails its generation as a 503 naming the file, not the 500
    of a bug; the daemon serves on, and once the file is whole a request succeeds."""
    from daemon.http.streaming import _failure

    error = LayerReadError("disk tier: reading layer 3 (mlp.up_proj.blocks) from /m.gguf failed")
    answer = _failure(error)
    assert (answer.status, answer.code) == (503, "model_file_unreadable")
    assert "/m.gguf" in answer.message and "layer 3" in answer.message
