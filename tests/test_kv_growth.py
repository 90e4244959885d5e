"""A KV cache that doubles never needs its old and new storage in full at once: on a CPU
the new storage's unwritten pages are the system's zero pages, on a GPU with no room for
both the entries go through host memory (the plan counts one full cache; the last
doubling held 1.5 times it, a real-shape audit found)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import modeling.kv_cache as kv_cache
from modeling.config import ModelConfig
from modeling.kv_cache import KVCache
from speculative.batching import is_out_of_memory

ROOT = Path(__file__).resolve().parents[1]
FIELDS = dict(
    model_type="llama", vocab_size=32, hidden_size=256, intermediate_size=64, num_layers=4,
    num_heads=8, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
    max_position_embeddings=32768,
)  # fmt: skip
CONFIG = ModelConfig(**FIELDS)  # type: ignore[arg-type]

GROW = """
import sys, torch
sys.path.insert(0, {root!r})
from modeling.config import ModelConfig
from modeling.kv_cache import KVCache
from speculative.batching import is_out_of_memory

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

config = ModelConfig(**{config!r})
torch.ones(1)  # torch's own start-up, before the baseline
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident size starts again from now
base = status("VmRSS:")
cache = KVCache(config, 16384, dtype=torch.float32)
while cache.length < 16384:
    start = cache.reserve(1024)
    cache.k[:, :, start : start + 1024] = 1.0
    cache.v[:, :, start : start + 1024] = 1.0
    cache.commit_append(1024)
peak = status("VmHWM:") - base
fresh = KVCache(config, 16384, dtype=torch.float32, initial=16384)  # all of it unwritten
before = status("VmRSS:")
assert float(fresh.k.sum()) == 0.0 and float(fresh.v.sum()) == 0.0  # read, every page
read = status("VmRSS:") - before
print(peak * 1024 / cache.nbytes, read * 1024 / fresh.nbytes)
"""


def test_growing_on_a_cpu_peaks_near_the_full_cache() -> None:
    """256 MiB of keys and values grown 1,024 slots at a time from 512 to 16,384: the
    process's peak grows by about the full cache (1.5 times it when every new storage was
    written with zeros); and storage never written costs nothing when read (a compiled
    pass attends over all of it: a shared mapping committed every page a read touched)."""
    script = GROW.format(root=str(ROOT), config=FIELDS)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    ratio, read = (float(x) for x in out.stdout.split())
    assert 0.9 < ratio < 1.2, f"peak {ratio:.2f}x the full cache"
    assert read < 0.1, f"reading unwritten storage committed {read:.2f}x of it"


def _filled(cache: KVCache, n: int) -> None:
    start = cache.reserve(n)
    values = torch.arange(n, dtype=cache.k.dtype)[None, None, :, None]
    cache.k[:, :, start : start + n] = values
    cache.v[:, :, start : start + n] = -values
    cache.commit_append(n)


def test_growing_through_host_memory_keeps_every_entry(monkeypatch) -> None:
    """The GPU's way where the device has no room for the new storage beside the old (the
    entries copied out, the old storage freed, the new one made and filled), run on a CPU:
    every entry where it was, the rest zero; and where even then there is no room, the
    cache is left as it was and the error raised."""
    monkeypatch.setattr(kv_cache, "stages_through_host", lambda device: True)
    made = kv_cache.zeros
    refused = []

    def room_once_freed(shape, dtype, device):  # type: ignore[no-untyped-def]
        if shape[2] > 1024 and not refused:  # beside the old storage: no room
            refused.append(shape)
            raise torch.OutOfMemoryError("no room")
        return made(shape, dtype, device)

    monkeypatch.setattr(kv_cache, "zeros", room_once_freed)
    cache = KVCache(CONFIG, 4096, dtype=torch.float32, initial=1024)
    _filled(cache, 1000)
    _filled(cache, 100)  # grows to 2,048, through the host
    assert refused and cache.allocated == 2048 and cache.length == 1100
    expected = torch.cat((torch.arange(1000.0), torch.arange(100.0)))
    assert torch.equal(cache.k[0, 0, :1100, 0], expected)
    assert torch.equal(cache.v[3, 7, :1100, 5], -expected)
    assert not cache.k[:, :, 1100:].any() and not cache.v[:, :, 1100:].any()

    def no_room(shape, dtype, device):  # type: ignore[no-untyped-def]
        if shape[2] > 2048:
            raise torch.OutOfMemoryError("no room")
        return made(shape, dtype, device)

    monkeypatch.setattr(kv_cache, "zeros", no_room)
    with pytest.raises(torch.OutOfMemoryError):
        cache.reserve(1000)
    assert cache.allocated == 2048 and cache.length == 1100
    assert torch.equal(cache.k[0, 0, :1100, 0], expected)

    def none_at_all(shape, dtype, device):  # type: ignore[no-untyped-def]
        raise torch.OutOfMemoryError("no room")  # (another took the room meanwhile)

    monkeypatch.setattr(kv_cache, "zeros", none_at_all)
    with pytest.raises(kv_cache.CacheLostError) as lost:
        cache.reserve(1000)
    assert not is_out_of_memory(lost.value)  # its sequence ends; no pass is run again
    with pytest.raises(kv_cache.CacheLostError):  # (it had no storage: an AttributeError)
        cache.reserve(1)


def test_no_memory_for_a_cpu_cache_is_a_memory_error(monkeypatch) -> None:
    """The mapping's ENOMEM is a MemoryError, which the engine treats as out of memory
    (relief, then the pass again), as torch's own allocation error was."""
    import errno
    import mmap

    def enomem(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", enomem)
    with pytest.raises(MemoryError):
        kv_cache.zeros((4, 8, 1024, 128), torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_growing_on_a_full_gpu_never_holds_both_storages() -> None:
    """Grown from 8,192 to 16,384 slots (128 MiB to 256 MiB) on a device limited so that the
    new storage does not fit beside the old: it goes through host memory, and the device's
    peak stays within the new storage; every entry kept."""
    cache = KVCache(CONFIG, 16384, dtype=torch.float32, device="cuda", initial=8192)
    _filled(cache, 8192)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    old = cache.nbytes
    total = torch.cuda.get_device_properties(0).total_memory
    room = torch.cuda.memory_reserved() + 2 * old - old // 2  # new (2 old) beside old: no
    torch.cuda.set_per_process_memory_fraction(room / total)
    try:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _filled(cache, 1024)
        peak = torch.cuda.max_memory_allocated() - before
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert cache.allocated == 16384
    assert peak <= cache.nbytes - old + 2**20, (peak, cache.nbytes, old)
    assert torch.equal(cache.k[0, 0, 8192:9216, 0].cpu(), torch.arange(1024.0))
    assert torch.equal(cache.k[0, 0, :8192, 0].cpu(), torch.arange(8192.0))
