"""A KV cache that doubles never holds its old and new storage in full at once: on a CPU
the new storage's unwritten pages are the system's zero pages, on a GPU the entries go
through host memory (the plan counts one full cache; the last doubling held 1.5 times it,
a real-shape audit found)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import modeling.kv_cache as kv_cache
from modeling.config import ModelConfig
from modeling.kv_cache import KVCache

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
print(peak * 1024 / cache.nbytes)
"""


def test_growing_on_a_cpu_peaks_near_the_full_cache() -> None:
    """256 MiB of keys and values grown 1,024 slots at a time from 512 to 16,384: the
    process's peak grows by about the full cache (1.5 times it when every new storage was
    written with zeros)."""
    script = GROW.format(root=str(ROOT), config=FIELDS)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    ratio = float(out.stdout.strip())
    assert 0.9 < ratio < 1.2, f"peak {ratio:.2f}x the full cache"


def _filled(cache: KVCache, n: int) -> None:
    start = cache.reserve(n)
    values = torch.arange(n, dtype=cache.k.dtype)[None, None, :, None]
    cache.k[:, :, start : start + n] = values
    cache.v[:, :, start : start + n] = -values
    cache.commit_append(n)


def test_growing_through_host_memory_keeps_every_entry(monkeypatch) -> None:
    """The GPU's way (the entries copied out, the old storage freed, the new one made and
    filled) run on a CPU: every entry where it was, the rest zero; and when the new storage
    cannot be had, the cache is left as it was."""
    monkeypatch.setattr(kv_cache, "stages_through_host", lambda device: True)
    cache = KVCache(CONFIG, 4096, dtype=torch.float32, initial=512)
    _filled(cache, 500)
    _filled(cache, 100)  # grows to 1,024
    assert cache.allocated == 1024 and cache.length == 600
    expected = torch.cat((torch.arange(500.0), torch.arange(100.0)))
    assert torch.equal(cache.k[0, 0, :600, 0], expected)
    assert torch.equal(cache.v[3, 7, :600, 5], -expected)
    assert not cache.k[:, :, 600:].any() and not cache.v[:, :, 600:].any()

    def no_room(shape, dtype, device):  # type: ignore[no-untyped-def]
        if shape[2] > 1024:
            raise torch.OutOfMemoryError("no room")
        return torch.zeros(shape, dtype=dtype, device=device)

    monkeypatch.setattr(kv_cache, "zeros", no_room)
    with pytest.raises(torch.OutOfMemoryError):
        cache.reserve(1000)
    assert cache.allocated == 1024 and cache.length == 600
    assert torch.equal(cache.k[0, 0, :600, 0], expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_growing_on_a_gpu_never_holds_both_storages() -> None:
    """Grown from 8,192 to 16,384 slots (256 MiB in all), the device's peak stays within
    the new storage and a little: the old one went through host memory."""
    cache = KVCache(CONFIG, 16384, dtype=torch.float32, device="cuda", initial=8192)
    _filled(cache, 8192)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _filled(cache, 1024)
    peak = torch.cuda.max_memory_allocated() - before
    assert cache.allocated == 16384
    assert peak < 1.1 * cache.nbytes - cache.nbytes / 2, (peak, cache.nbytes)
