"""GGUF files (llama.cpp's format) read in a fraction of a second: header, metadata, tensor
infos, and a zero-copy view of each tensor's bytes in a memory map.

gguf-py's `GGUFReader` builds a numpy view per metadata array element: seconds (12 s here,
24 s measured elsewhere) for a Llama 3 vocabulary, 128k tokens and 280k merges. Here a string
array is one tight loop over a memoryview and a numeric array one `numpy.frombuffer`: ~0.3 s.

The layout (ggml's docs/gguf.md), little-endian; a string is a u64 byte length and UTF-8:
    "GGUF", u32 version, u64 tensor count, u64 metadata count
    per metadata entry: string key, u32 value type, value
        (an array: u32 item type, u64 count, the items)
    per tensor: string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset
    padding to `general.alignment` (default 32), then the data section the offsets count from.

Every file is taken as hostile: a count is checked against the bytes that follow it and
against a bound for what it counts before anything is allocated or looped over per item,
since a sparse file has all the bytes it claims at no cost to whoever made it. The bounds
(docs/models.md, "Hostile model files") are far above any real model's: a header is about
10 MB with a Llama 3 vocabulary, the largest array a vocabulary (262,144 tokens in Gemma
3), and Llama 3.1 405B has 1,138 tensors.
"""

from __future__ import annotations

import itertools
import os
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES

from modeling.checkpoints.regular import open_regular

# Value types 0-12 (gguf.GGUFValueType) but string (8) and array (9): their struct codes.
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"
}  # fmt: skip
_STRUCTS = {t: struct.Struct("<" + code) for t, code in _SCALARS.items()}
_DTYPES = {t: np.dtype("<" + code) for t, code in _SCALARS.items()}
_UINT32, _STRING, _ARRAY, _UINT64 = 4, 8, 9, 10
_INTEGERS = frozenset(_SCALARS) - {6, 7, 12}  # not the floats and the bool
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
_MAX_NESTING = 16  # arrays of arrays; deeper is a corrupt (or hostile) file
MAX_TENSORS = 2**16  # tensor infos in one file
MAX_METADATA = 2**16  # metadata keys in one file (real files: 20-60)
MAX_ARRAY_LENGTH = 2**22  # items in one array: 16x the largest real vocabulary
MAX_ARRAY_ITEMS = 2**23  # items in all the file's arrays together, nested ones included
# Arrays held in arrays, in all: no model's metadata has any (its arrays are of numbers or
# strings), and each costs a Python call to read: 8 million empty ones in an 8 KB sparse
# file took 26 s and 0.9 GB, at every start while it sat in a model store.
MAX_NESTED_ARRAYS = 2**16
MAX_HEADER_BYTES = 2**27  # the metadata and the tensor table: 128 MiB
CORRUPT_FILE = "the file is corrupt: download or convert the model again"


class GGUFFormatError(ValueError):
    """A file that is not a GGUF this reader can read; the message names the file and what
    to do."""


def short_repr(value: Any) -> str:
    """A metadata value for an error message, kept to one short line: a hostile file's may
    be a list of millions of items or a string of megabytes."""
    if isinstance(value, list):
        return f"a list of {len(value):,} items"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}... (a {type(value).__name__})"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # elements per dimension, innermost (a row) first, as in the file
    ggml_type: int  # gguf.GGMLQuantizationType
    offset: int  # absolute, in the file
    n_bytes: int


@dataclass
class GGUFContents:
    path: Path
    version: int
    metadata: dict[str, Any]  # str, int, float, bool, or a list of them (arrays nest)
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int  # where the data section starts, aligned
    data: np.memmap = field(repr=False)  # the whole file; tensor views keep it mapped
    tensors_by_name: dict[str, TensorInfo] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.tensors_by_name = {info.name: info for info in self.tensors}

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes in the file, not copied: uint8, (rows, row bytes), where rows
        is prod(ne[1:]) and a row holds ne[0] elements in ggml blocks."""
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]  # type: ignore[index]
        row_bytes = (info.ne[0] if info.ne else 1) // block * type_size
        view = self.data[info.offset : info.offset + info.n_bytes].view(np.ndarray)
        return view.reshape(prod(info.ne[1:]), row_bytes)  # (rows, row_bytes)


def read_gguf(path: Path) -> GGUFContents:
    """Everything in the GGUF file at `path` but the tensor data, which stays in the map.
    GGUFFormatError when the file is not a GGUF v2/v3 little-endian file, is cut short, or
    claims more than the bounds above allow."""
    return _Reader(path, _map(path)).contents()


def read_file_type(path: Path) -> int | None:
    """`general.file_type` of the GGUF file at `path` (None when it does not say), the rest
    of the metadata skipped in the map, no value built: a quantized file keeps the key after
    the tokenizer's arrays, which gguf.GGUFReader builds entry by entry (24 s for a Llama 3
    vocabulary, against under 0.1 s here). GGUFFormatError as read_gguf."""
    reader = _Reader(path, _map(path))
    for i in range(reader.header()[1]):
        key = reader.string(f"metadata key {i}")
        value_type = reader.scalar(_UINT32, key)
        if key == "general.file_type" and value_type in _INTEGERS:
            return int(reader.scalar(value_type, key))
        reader.skip(value_type, key)
    return None


def _map(path: Path) -> np.memmap:
    try:
        fd = open_regular(path)
    except OSError as exc:
        raise GGUFFormatError(f"{path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        size = os.fstat(fd).st_size
        if size < 4:
            raise GGUFFormatError(f"{path}: not a GGUF file ({size} bytes): give a .gguf model")
        return np.memmap(file, dtype=np.uint8, mode="r")


class _Reader:
    def __init__(self, path: Path, data: np.memmap) -> None:
        self.path, self.data, self.buf = path, data, data.data
        self.size, self.pos = len(data), 0
        self.items = 0  # array items read so far (MAX_ARRAY_ITEMS)
        self.nested = 0  # arrays read inside arrays so far (MAX_NESTED_ARRAYS)

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {what}")

    def take(self, n: int, what: str) -> int:
        """Where the next `n` bytes start; past them after. Only the header is read this
        way, so past MAX_HEADER_BYTES is refused too."""
        start, self.pos = self.pos, self.pos + n
        if self.pos > min(self.size, MAX_HEADER_BYTES):
            raise self.past_end(start, n, what)
        return start

    def past_end(self, start: int, n: int, what: str) -> GGUFFormatError:
        """`what` does not end in the file, or not within the header's bound."""
        if start + n <= self.size:
            return self.fail(
                f"{what} at byte {start} takes {n:,} bytes, past {MAX_HEADER_BYTES:,} bytes "
                f"into the file: specd reads headers of at most that size (a real one is "
                f"about 10 MB at most); {CORRUPT_FILE}"
            )
        return self.fail(
            f"truncated: {what} at byte {start} needs {n} bytes but the file has {self.size} "
            f"bytes; download it again"
        )

    def scalar(self, value_type: int, what: str) -> Any:
        unpack = _STRUCTS[value_type]
        return unpack.unpack_from(self.buf, self.take(unpack.size, what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(_UINT64, what)
        start = self.take(n, what)
        try:
            return str(self.buf[start : self.pos], "utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not UTF-8 ({exc}): the file is corrupt") from None

    def count(self, n: int, item_bytes: int, what: str, bound: int, of: str) -> int:
        """`n` items of at least `item_bytes` each, checked against what follows in the
        file and against `bound` (`of`: what the bound is for) before any is read."""
        if n * item_bytes > self.size - self.pos:
            raise self.fail(
                f"truncated or corrupt: {what} at byte {self.pos} claims {n} items but "
                f"{self.size - self.pos} bytes follow; download it again"
            )
        if n > bound:
            raise self.fail(
                f"{what} claims {n:,} {of}; specd reads at most {bound:,}: {CORRUPT_FILE}"
            )
        return n

    def array_length(self, what: str, item_bytes: int) -> int:
        n = self.count(
            self.scalar(_UINT64, what), item_bytes, what, MAX_ARRAY_LENGTH,
            "items (a real model's largest array, its vocabulary, has at most 262,144)",
        )  # fmt: skip
        self.items = self.tally(
            self.items + n, MAX_ARRAY_ITEMS, what, "the items of the file's arrays",
            "a real model has under a million",
        )  # fmt: skip
        return n

    def tally(self, total: int, bound: int, what: str, counted: str, real: str) -> int:
        """`total`, what `what` brings the file's `counted` to, refused past `bound`."""
        if total > bound:
            raise self.fail(
                f"{what} brings {counted} to {total:,}; specd reads at most {bound:,} "
                f"({real}): {CORRUPT_FILE}"
            )
        return total

    def value(self, value_type: int, what: str, depth: int = 0) -> Any:
        if value_type in _STRUCTS:
            return self.scalar(value_type, what)
        if value_type == _STRING:
            return self.string(what)
        if value_type != _ARRAY:
            raise self.unknown_type(value_type, what)
        item_type = self.scalar(_UINT32, what)
        if item_type not in _STRUCTS and item_type not in (_STRING, _ARRAY):
            raise self.unknown_type(item_type, what)
        if item_type in _DTYPES:
            dtype = _DTYPES[item_type]
            n = self.array_length(what, dtype.itemsize)
            start = self.take(n * dtype.itemsize, what)
            return np.frombuffer(self.buf, dtype, n, start).tolist()
        if item_type == _STRING:
            return self.strings(self.array_length(what, 8), what)
        if depth >= _MAX_NESTING:  # an array of arrays
            raise self.fail(f"{what} nests arrays over {_MAX_NESTING} deep: the file is corrupt")
        n = self.nested_length(what)
        return [self.value(_ARRAY, what, depth + 1) for _ in range(n)]

    def nested_length(self, what: str) -> int:
        """The length of an array of arrays, counted against MAX_NESTED_ARRAYS."""
        n = self.array_length(what, 12)  # 12: an empty array's bytes
        self.nested = self.tally(
            self.nested + n, MAX_NESTED_ARRAYS, what, "the arrays held in arrays",
            "a real model has none",
        )  # fmt: skip
        return n

    def skip(self, value_type: int, what: str, depth: int = 0) -> None:
        """Past a value, building nothing: `value`'s checks, without its items."""
        if value_type in _STRUCTS:
            self.take(_STRUCTS[value_type].size, what)
        elif value_type == _STRING:
            self.take(self.scalar(_UINT64, what), what)
        elif value_type != _ARRAY:
            raise self.unknown_type(value_type, what)
        elif (item_type := self.scalar(_UINT32, what)) in _STRUCTS:
            size = _STRUCTS[item_type].size
            self.take(self.array_length(what, size) * size, what)
        elif item_type == _STRING:  # a vocabulary: kept to locals, as in `strings`
            n = self.array_length(what, 8)
            buf, pos, limit = self.buf, self.pos, min(self.size, MAX_HEADER_BYTES)
            for i in range(n):
                end = pos + 8 + int.from_bytes(buf[pos : pos + 8], "little")
                if end > limit:
                    raise self.past_end(pos, end - pos, f"{what}[{i}]")
                pos = end
            self.pos = pos
        elif item_type != _ARRAY:
            raise self.unknown_type(item_type, what)
        elif depth >= _MAX_NESTING:
            raise self.fail(f"{what} nests arrays over {_MAX_NESTING} deep: the file is corrupt")
        else:
            for _ in range(self.nested_length(what)):
                self.skip(_ARRAY, what, depth + 1)

    def unknown_type(self, value_type: int, what: str) -> GGUFFormatError:
        return self.fail(f"{what} has unknown value type {value_type}: the file is corrupt")

    def strings(self, n: int, what: str) -> list[str]:
        # The hot loop (a vocabulary and its merges: ~400k strings), so kept to locals.
        buf, pos, limit = self.buf, self.pos, min(self.size, MAX_HEADER_BYTES)
        out: list[str] = []
        append = out.append
        try:
            for _ in range(n):
                end = pos + 8 + int.from_bytes(buf[pos : pos + 8], "little")
                if end > limit:
                    raise self.past_end(pos, end - pos, f"{what}[{len(out)}]")
                append(str(buf[pos + 8 : end], "utf-8"))
                pos = end
        except UnicodeDecodeError as exc:
            raise self.fail(
                f"{what}[{len(out)}] is not UTF-8 ({exc}): the file is corrupt"
            ) from None
        self.pos = pos
        return out

    def header(self) -> tuple[int, int, int]:
        """(version, metadata count, tensor count), checked; the metadata comes next."""
        if bytes(self.buf[:4]) != b"GGUF":
            raise self.fail("not a GGUF file (its first bytes are not 'GGUF'): give a .gguf model")
        self.pos = 4
        version = self.scalar(_UINT32, "the version")
        if version & 0xFFFF == 0 and version:  # a small version read in the wrong byte order
            raise self.fail(
                "a big-endian GGUF file, which specd does not read: convert the model again "
                "with llama.cpp's convert_hf_to_gguf.py without --bigendian"
            )
        if version == 1:
            raise self.fail(
                "GGUF version 1 (llama.cpp before August 2023) is not supported: download or "
                "convert the model again as GGUF version 3"
            )
        if version not in (2, 3):
            raise self.fail(f"unknown GGUF version {version} (this reader knows 2 and 3)")
        n_tensors = self.scalar(_UINT64, "the tensor count")
        n_entries = self.count(
            self.scalar(_UINT64, "the metadata count"), 13, "the metadata", MAX_METADATA,
            "keys (a real model has 20-60)",
        )  # fmt: skip
        return version, n_entries, n_tensors

    def contents(self) -> GGUFContents:
        version, n_entries, n_tensors = self.header()
        metadata: dict[str, Any] = {}
        for i in range(n_entries):
            key = self.string(f"metadata key {i}")
            if key in metadata:
                raise self.fail(f"metadata key {key!r} appears twice: the file is corrupt")
            metadata[key] = self.value(self.scalar(_UINT32, key), key)
        infos: dict[str, tuple[tuple[int, ...], int, int]] = {}
        n_tensors = self.count(
            n_tensors, 24, "the tensor table", MAX_TENSORS, "tensors (Llama 3.1 405B has 1,138)"
        )
        for i in range(n_tensors):
            name = self.string(f"tensor name {i}")
            if name in infos:
                raise self.fail(f"tensor {name} appears twice: the file is corrupt")
            n_dims = self.scalar(_UINT32, name)
            if n_dims > _MAX_DIMS:
                raise self.fail(f"tensor {name} has {n_dims} dimensions: the file is corrupt")
            ne = struct.unpack_from(f"<{n_dims}Q", self.buf, self.take(8 * n_dims, name))
            if 0 in ne:
                raise self.fail(f"tensor {name} has a dimension of 0 ({list(ne)}): {CORRUPT_FILE}")
            infos[name] = (ne, self.scalar(_UINT32, name), self.scalar(_UINT64, name))
        alignment = metadata.get("general.alignment", 32)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment {alignment!r} is not a power of two")
        data_offset = -(-self.pos // alignment) * alignment
        tensors = [self.tensor(name, *info, data_offset) for name, info in infos.items()]
        self.check_layout(tensors, alignment, data_offset)
        return GGUFContents(
            path=self.path,
            version=version,
            metadata=metadata,
            tensors=tensors,
            alignment=alignment,
            data_offset=data_offset,
            data=self.data,
        )

    def check_layout(self, tensors: list[TensorInfo], alignment: int, data_offset: int) -> None:
        """Each tensor's data starts on the file's alignment and no two overlap, as
        llama.cpp requires (it refuses any other layout): a misaligned offset reads blocks
        out of step, and overlapping tensors read one another's bytes as weights, NaN
        scales included, and the model answers token 0 forever."""
        for info in tensors:
            if (info.offset - data_offset) % alignment:
                raise self.fail(
                    f"tensor {info.name}'s offset {info.offset - data_offset} is not a multiple "
                    f"of general.alignment {alignment}: {CORRUPT_FILE}"
                )
        ordered = sorted(tensors, key=lambda t: t.offset)
        for before, after in itertools.pairwise(ordered):
            if after.offset < before.offset + before.n_bytes:
                raise self.fail(
                    f"tensors {before.name} and {after.name} overlap in the file: {CORRUPT_FILE}"
                )

    def tensor(
        self, name: str, ne: tuple[int, ...], ggml_type: int, offset: int, data_offset: int
    ) -> TensorInfo:
        sizes = GGML_QUANT_SIZES.get(ggml_type)  # type: ignore[call-overload]
        if sizes is None:
            raise self.fail(f"tensor {name} has ggml type {ggml_type}, unknown to gguf: update it")
        block, type_size = sizes
        if ne and ne[0] % block:
            raise self.fail(f"tensor {name}: a row of {ne[0]} is not whole blocks of {block}")
        n_bytes = prod(ne) // block * type_size
        start = data_offset + offset
        if start + n_bytes > self.size:
            raise self.fail(
                f"truncated: tensor {name} ends at byte {start + n_bytes} but the file has "
                f"{self.size} bytes; download it again"
            )
        return TensorInfo(name, tuple(ne), ggml_type, start, n_bytes)
