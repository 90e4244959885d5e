"""Host tiers: where streamed layers wait between target passes.

- `RamStorage` (tier "ram"): every streamed layer packed once into its slice of one host
  arena (offload/arena.py), page-locked when the compute device is a GPU so that each
  host→device copy is a single DMA, with no per-layer allocator rounding.
- `DiskStorage` (tier "disk"): nothing kept in RAM; each time a layer is needed its bytes are
  read from the safetensors files into the slot's staging buffer, on a reader thread of its
  own, straight from the file at the offsets the file's header gives (one copy per byte; a
  cast when the file's dtype is not the run's, read in pieces of CAST_CHUNK_BYTES), by
  positioned reads of files opened as the tier is made (never a memory map: a file cut
  short is an error, not a SIGBUS). Slower (bounded by the disk), but RAM holds
  only the staging buffers.

Both hand the streamer a `Future` of the layer's flat host bytes laid out by the same
`FlatLayout`: already resolved for RAM, resolved by the reader thread for disk.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
from torch import nn

from offload.arena import HostArena
from offload.layout import FlatLayout, TensorSlot


class CompletionEvent(Protocol):
    """What a tier waits on before overwriting a staging buffer (a CUDA event)."""

    def synchronize(self) -> None: ...


class LayerStorage(Protocol):
    tier: str  # "ram" | "disk"
    layout: FlatLayout
    needs_staging: bool  # True: `fetch` fills the staging buffer it is given

    def fetch(
        self, layer: int, staging: torch.Tensor | None, after: CompletionEvent | None = None
    ) -> Future[torch.Tensor]:
        """Layer `layer`'s flat bytes in host memory, ready to copy to the device. `after`:
        the last copy out of `staging`, which must finish before `staging` is overwritten."""
        ...

    @property
    def host_bytes(self) -> int:
        """RAM this tier holds (not counting staging)."""
        ...

    @property
    def pinned(self) -> bool:
        """Whether the host bytes it hands out are page-locked (real asynchronous DMA)."""
        ...

    def close(self) -> None: ...


class RamStorage:
    tier = "ram"
    needs_staging = False

    def __init__(self, layout: FlatLayout, layers: Sequence[int]) -> None:
        """Room for `layers` (their indices), one arena slice each, allocated once."""
        self.layout = layout
        self.arena = HostArena(layout.nbytes, len(layers))
        self._slice = {layer: k for k, layer in enumerate(layers)}
        self.buffers: dict[int, torch.Tensor] = {}

    def add(self, index: int, module: nn.Module) -> None:
        """Pack layer `index` into its arena slice. The module is not kept: the caller can
        free it right after (packing one layer at a time bounds peak RAM)."""
        flat = self.arena.view(self._slice[index])
        self.layout.pack(module, flat)
        self.buffers[index] = flat

    def fill(self, index: int, source: DiskStorage) -> None:
        """Read layer `index` from the disk tier into its arena slice."""
        flat = self.arena.view(self._slice[index])
        source.read(index, flat)
        self.buffers[index] = flat

    def pin(self, device: torch.device) -> bool:
        """Page-lock the packed layers for `device` (after packing: registering first would
        commit every page of the arena while the loaded model still holds its copy)."""
        return self.arena.pin(device)

    def fetch(
        self, layer: int, staging: torch.Tensor | None, after: CompletionEvent | None = None
    ) -> Future[torch.Tensor]:
        done: Future[torch.Tensor] = Future()
        done.set_result(self.buffers[layer])
        return done

    @property
    def host_bytes(self) -> int:
        return self.arena.nbytes

    @property
    def pinned(self) -> bool:
        return self.arena.pinned

    def close(self) -> None:
        """Unpin the arena and drop this tier's views of it: its memory is freed once
        nothing else holds a view (a slot's copy in flight, a caller's tensor)."""
        self.arena.close()
        self.buffers.clear()


class TensorReader(Protocol):
    """A tensor whose stored form is not the layer's (a GGUF file's: rows reordered,
    blocks in a room, float tensors decoded; modeling/checkpoints/gguf_disk.py): it reads
    its bytes through `read` and converts them itself."""

    @property
    def path(self) -> Path: ...
    @property
    def key(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...  # in the layout tensor's dtype
    @property
    def start(self) -> int: ...  # the file's bytes it reads
    @property
    def end(self) -> int: ...

    def read_into(self, dest: torch.Tensor, read: Callable[[Path, int, memoryview], None]) -> None:
        """Fill `dest` (its view of the staging buffer: `shape`, the layout's dtype)."""
        ...


# Where one tensor of a layer is stored: a (safetensors file, key), or a list of them whose
# tensors are stacked along the first dimension (a model may hold as one tensor what a
# checkpoint stores as several: their bytes are consecutive in the layout's tensor), or
# readers that convert what they read (stacked the same way).
TensorSource = tuple[Path, str] | list[tuple[Path, str]] | Sequence[TensorReader]
# layer index → {tensor name in the layer (as in the layout) → its source}
TensorSources = Mapping[int, Mapping[str, TensorSource]]

# safetensors dtype names (the format's spec) → torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class FileTensor:
    """Where one tensor's bytes are in a safetensors file."""

    path: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


# A cast read's piece (a file's tensor in another dtype than the run's): its scratch.
CAST_CHUNK_BYTES = 16 << 20
# The longest safetensors header read (the safetensors library's own bound).
MAX_HEADER_BYTES = 100_000_000


def read_header(path: Path) -> dict[str, FileTensor]:
    """A safetensors file's tensor index: an 8-byte little-endian header length, then a JSON
    header of {key: {dtype, shape, data_offsets}} with offsets relative to the data that
    follows the header. A file that is no regular file, or whose header is longer than
    safetensors' own bound, is a ValueError naming it."""
    with _open_regular(path) as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: a header of {length:,} bytes (at most {MAX_HEADER_BYTES:,})")
        header = json.loads(f.read(length))
    base = 8 + length
    out: dict[str, FileTensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out[key] = FileTensor(
            path, key, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), base + start,
            base + end,
        )  # fmt: skip
    return out


class LayerReadError(RuntimeError):
    """Reading a streamed layer from the weight files failed (raised on the compute thread,
    where the layer was needed; the reader thread's error is its cause)."""


class DiskStorage:
    tier = "disk"
    needs_staging = True
    pinned = False  # the staging buffers belong to the streamer, which pins them

    def __init__(self, layout: FlatLayout, sources: TensorSources) -> None:
        self.layout = layout
        wanted = {e.name for e in layout.tensors}
        for index, names in sources.items():
            missing = wanted - set(names)
            if missing:
                raise ValueError(
                    f"disk tier: layer {index} has no file source for {sorted(missing)[:3]}"
                )
        headers: dict[Path, dict[str, FileTensor]] = {}
        # Per layer: each layout tensor with the file tensors stacked into it, in order.
        self.plan: dict[int, list[tuple[TensorSlot, list[FileTensor | TensorReader]]]] = {}
        for index, names in sources.items():
            reads = []
            for entry in layout.tensors:
                source = names[entry.name]
                parts: Sequence[Any] = source if isinstance(source, list) else [source]
                srcs: list[FileTensor | TensorReader] = []
                for part in parts:
                    if not isinstance(part, tuple):  # a reader: no header to look in
                        srcs.append(part)
                        continue
                    path, key = part
                    if path not in headers:
                        headers[path] = read_header(path)
                    src = headers[path].get(key)
                    if src is None:
                        raise ValueError(f"disk tier: {path} has no tensor {key} (layer {index})")
                    srcs.append(src)
                stacked = (sum(s.shape[0] for s in srcs), *srcs[0].shape[1:]) if srcs else ()
                if any(s.shape[1:] != srcs[0].shape[1:] for s in srcs) or stacked != entry.shape:
                    held = " + ".join(f"{s.key} with shape {list(s.shape)}" for s in srcs)
                    raise ValueError(
                        f"disk tier: {srcs[0].path} holds {held}, the model expects "
                        f"{list(entry.shape)} for {entry.name} (layer {index})"
                    )
                reads.append((entry, srcs))
            self.plan[index] = reads
        # One reader: reads of one disk do not get faster in parallel, and FIFO order means
        # a staging buffer's reads land in the order they were asked for.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="specd-disk-read")
        self._files: dict[Path, BinaryIO] = {}
        self._lock = threading.Lock()  # `read` may also be called directly (tests, tools)
        # Every file is opened now, as the tier is made: the files read are the ones whose
        # headers were read, whatever is put at their paths later (opened at the first
        # read, a file renamed over one read wrong offsets for good, and a FIFO hung the
        # engine, SIGTERM and all).
        try:
            for path in {part.path for reads in self.plan.values() for _, s in reads for part in s}:
                self._file(path)
        except BaseException:
            self.close()
            raise
        self.read_threads: set[int] = set()  # idents of the threads that did reads
        self.read_log: deque[int] = deque(maxlen=4096)  # layers in the order they were read

    def fetch(
        self, layer: int, staging: torch.Tensor | None, after: CompletionEvent | None = None
    ) -> Future[torch.Tensor]:
        if staging is None:
            raise ValueError("the disk tier reads through a staging buffer; none was given")
        return self._reader.submit(self.read, layer, staging, after)

    def read(
        self, layer: int, staging: torch.Tensor, after: CompletionEvent | None = None
    ) -> torch.Tensor:
        """Fill `staging` with layer `layer` (on the calling thread)."""
        if after is not None:
            after.synchronize()  # the device is done copying the staging's previous layer
        with self._lock:
            self.read_threads.add(threading.get_ident())
            for entry, srcs in self.plan[layer]:
                offset = entry.offset
                for src in srcs:  # stacked parts: consecutive bytes of the layout's tensor
                    nbytes = math.prod(src.shape) * entry.dtype.itemsize
                    dest = staging[offset : offset + nbytes]  # uint8 view
                    offset += nbytes
                    try:
                        self._read_tensor(src, dest, entry)
                    except Exception as e:  # re-raised with the layer and file named
                        raise LayerReadError(
                            f"disk tier: reading layer {layer} ({entry.name}) from {src.path} "
                            f"[{src.key}, bytes {src.start}..{src.end}] failed: "
                            f"{type(e).__name__}: {e}"
                        ) from e
            self.read_log.append(layer)
        return staging

    def _read_tensor(
        self, src: FileTensor | TensorReader, dest: torch.Tensor, entry: TensorSlot
    ) -> None:
        """Read `src` into `dest` (its bytes of the layout tensor `entry`)."""
        if not isinstance(src, FileTensor):
            src.read_into(dest.view(entry.dtype).view(src.shape), self._read_bytes)
        elif src.dtype == entry.dtype:
            # Same dtype: the file's bytes are the layout's bytes. readinto a view of the
            # staging tensor: the kernel copies from the page cache straight into staging,
            # the only host copy of each byte.
            if src.end - src.start != dest.numel():
                raise ValueError(f"{src.end - src.start} bytes in the file for {dest.numel()}")
            _read_exactly(self._file(src.path), src.start, dest.numpy().data)
        else:
            # A cast is unavoidable: read in pieces of CAST_CHUNK_BYTES (positioned reads: a
            # memory map of a file cut short under the daemon was a SIGBUS), each cast into
            # its place by one copy_.
            item = src.dtype.itemsize
            values = dest.view(entry.dtype).view(-1)  # (the tensor's values, in order)
            if (src.end - src.start) != values.numel() * item:
                raise ValueError(f"{src.end - src.start} bytes in the file for {values.numel()}")
            step = max(1, CAST_CHUNK_BYTES // item)
            piece = torch.empty(min(step, values.numel()) * item, dtype=torch.uint8)
            for first in range(0, values.numel(), step):
                n = min(step, values.numel() - first)
                raw = piece[: n * item]
                _read_exactly(self._file(src.path), src.start + first * item, raw.numpy().data)
                values[first : first + n].copy_(raw.view(src.dtype))

    def _read_bytes(self, path: Path, start: int, into: memoryview) -> None:
        _read_exactly(self._file(path), start, into)

    def _file(self, path: Path) -> BinaryIO:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = _open_regular(path)
        return f

    @property
    def host_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Finish queued reads and release the files."""
        self._reader.shutdown(wait=True)
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def _open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading, refused unless it is a regular file: opened without
    blocking (a FIFO put where a weight file was would wait for a writer for good, with
    the engine waiting on it) and checked once open (ValueError naming it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"disk tier: {path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb", buffering=0)


def _read_exactly(f: BinaryIO, offset: int, into: memoryview) -> None:
    f.seek(offset)
    done = 0
    while done < len(into):  # one read() returns at most ~2 GiB on Linux
        got = f.readinto(into[done:])  # type: ignore[attr-defined]
        if not got:
            raise EOFError(f"the file ends {len(into) - done} bytes short of the tensor")
        done += got


def tensor_files(files: Sequence[Path]) -> dict[str, Path]:
    """Which safetensors file holds each checkpoint key (headers only, no tensor data)."""
    where: dict[str, Path] = {}
    for path in files:
        for key in read_header(path):
            where[key] = path
    return where
