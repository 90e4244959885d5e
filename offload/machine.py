"""Measuring the machine a plan is for: free device memory, available RAM and the
host→device copy rate — or the values a user gives to plan for another machine."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import psutil
import torch

from offload.plan import MemoryBudget
from offload.units import parse_rate, parse_size


def measure_bandwidth(device: torch.device | str, size: int = 256 * 2**20) -> tuple[float, str]:
    """Host→device copy rate in bytes/s: pinned RAM → GPU on CUDA, a RAM memcpy on CPU.
    Best of three copies of `size` bytes."""
    device = torch.device(device)
    if device.type == "cuda":
        src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(size, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000.0)
        return size / best, "measured: pinned host→GPU copy"
    size = min(size, 64 * 2**20)
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return size / best, "measured: RAM copy (CPU device)"


# What `measure_cpu_rates` times: one token through a 4,096² matrix in each dtype a
# mixture's experts may be kept in on the host.
CPU_RATE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def measure_cpu_rates(side: int = 4096) -> tuple[tuple[str, float], ...]:
    """The rate (bytes of weights read per second) at which this CPU multiplies one token
    by a `side`² matrix, per dtype in CPU_RATE_DTYPES, best of three: what computing a
    mixture's experts on the CPU costs a decode step (a CPU without bf16 instructions
    multiplies bf16 several times slower than fp32; that is measured, not assumed)."""
    rates = []
    for dtype in CPU_RATE_DTYPES:
        weight = torch.ones(side, side, dtype=dtype)
        x = torch.ones(1, side, dtype=dtype)
        torch.nn.functional.linear(x, weight)  # warm-up
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            best = min(best, time.perf_counter() - t0)
        rates.append((str(dtype).removeprefix("torch."), weight.nbytes / max(best, 1e-9)))
    return tuple(rates)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (Linux's /proc/cpuinfo: `flags` on x86, `Features`
    on ARM; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def gemm_copies_output(dtype: torch.dtype, device_type: str) -> bool:
    """Whether a matrix product in `dtype` on `device_type` holds an fp32 copy of its output
    while it runs, beside the output itself. On a CPU without bf16 instructions (no
    avx512_bf16 or amx_bf16) oneDNN computes a bf16 product through an fp32 output buffer
    it allocates itself: measured at one fp32 output (M×N×4 bytes) for shapes from a
    1,024-row prefill projection to a 256-row head over 128k rows, freed when the product
    returns. An x86 CPU without AVX-512 (an AVX2 desktop) takes no oneDNN bf16 path: its
    product holds only the bf16 output (measured: a 1,024 x 8,192 product peaked at 16.6 MB
    of the output's 16.8 MB). It reads this machine's CPU, also when a plan is made for
    another one; where the flags cannot be read, and on ARM (whose oneDNN path is
    unmeasured), the copy is counted."""
    if device_type != "cpu" or dtype != torch.bfloat16:
        return False
    flags = _cpu_flags()
    if "avx2" in flags and "avx512f" not in flags:
        return False
    return not {"avx512_bf16", "amx_bf16"} & flags


def detect_budget(
    device: torch.device | str,
    device_budget: str | int = "auto",
    ram_budget: str | int = "auto",
    bandwidth: str | float | None = None,
    measure: bool = True,
    cpu_rate: str | float | None = None,
) -> MemoryBudget:
    """Budgets from the user's values, or measured on this machine: free GPU memory minus a
    reserve (CUDA context, allocator slack), available RAM minus a reserve for everything
    else on the machine."""
    device = torch.device(device)
    vm = psutil.virtual_memory()
    ram_reserve = max(2**30, vm.total // 10)
    if ram_budget == "auto":
        ram, ram_source = max(vm.available - ram_reserve, 0), "available RAM minus a reserve"
    else:
        ram, ram_source = parse_size(ram_budget, "--ram-budget"), "configured"
    # A configured device budget plans for a GPU (possibly another machine's).
    kind = "cuda" if device.type == "cuda" or device_budget != "auto" else "cpu"
    if device_budget != "auto":
        dev, dev_source = parse_size(device_budget, "--gpu-budget"), "configured"
    elif kind == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = max(512 * 2**20, total // 20)
        dev, dev_source = max(free - reserve, 0), "free GPU memory minus a reserve"
    else:
        dev, dev_source = ram, "CPU device: available RAM"
    if bandwidth is not None:
        rate: float | None = parse_rate(bandwidth, "--bandwidth")
        rate_source = "configured"
    elif measure:
        rate, rate_source = measure_bandwidth(device)
    else:
        rate, rate_source = None, "not measured"
    # The CPU's rate matters only where experts may compute on it beside a GPU.
    cpu_rates: tuple[tuple[str, float], ...] = ()
    cpu_source = "not measured"
    if cpu_rate is not None:
        given = parse_rate(cpu_rate, "--cpu-rate")
        names = [str(d).removeprefix("torch.") for d in CPU_RATE_DTYPES] + ["packed"]
        cpu_rates, cpu_source = tuple((n, given) for n in names), "configured"
    elif measure and kind == "cuda" and device.type == "cuda":
        cpu_rates, cpu_source = measure_cpu_rates(), "measured: one token through a matrix"
    return MemoryBudget(
        kind, dev, dev_source, ram, ram_source, rate, rate_source, cpu_rates, cpu_source
    )


class PeakMemory:
    """Peak memory a block of code adds, on the device it computes on:

        with PeakMemory(device) as peak:
            model(tokens, positions, cache)
        peak.bytes  # the high-water mark above what was in use when the block began

    CUDA: `torch.cuda.max_memory_allocated`, reset on entry (exact for PyTorch tensors).
    CPU: the process's peak resident set (Linux VmHWM, reset on entry through
    /proc/self/clear_refs) minus the resident set on entry. PyTorch's CPU allocator does not
    cache, and glibc returns large blocks to the system when freed, so this follows what
    tensors really hold; small allocator slack makes it a slight over-estimate, never an
    under-estimate of what was touched. Elsewhere (no /proc) `bytes` is None."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.bytes: int | None = None
        self._base = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif _reset_peak_rss():
            self._base = _status_bytes("VmRSS") or 0
        else:
            self._base = -1
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self._base >= 0:
            peak = _status_bytes("VmHWM")
            self.bytes = None if peak is None else max(peak - self._base, 0)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        return False
    return True


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None
