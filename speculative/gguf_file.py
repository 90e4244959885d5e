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
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES

# Value types 0-12 (gguf.GGUFValueType) but string (8) and array (9): their struct codes.
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"
}  # fmt: skip
_STRUCTS = {t: struct.Struct("<" + code) for t, code in _SCALARS.items()}
_DTYPES = {t: np.dtype("<" + code) for t, code in _SCALARS.items()}
_UINT32, _STRING, _ARRAY, _UINT64 = 4, 8, 9, 10
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
_MAX_NESTING = 16  # arrays of arrays; deeper is a corrupt (or hostile) file


class GGUFFormatError(ValueError):
    """A file that is not a GGUF this reader can read; the message names the file and what
    to do."""


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
    GGUFFormatError when the file is not a GGUF v2/v3 little-endian file or is cut short."""
    size = path.stat().st_size
    if size < 4:
        raise GGUFFormatError(f"{path}: not a GGUF file ({size} bytes): give a .gguf model")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return _Reader(path, data).contents()


class _Reader:
    def __init__(self, path: Path, data: np.memmap) -> None:
        self.path, self.data, self.buf = path, data, data.data
        self.size, self.pos = len(data), 0

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.path}: {what}")

    def take(self, n: int, what: str) -> int:
        """Where the next `n` bytes start; past them after."""
        start, self.pos = self.pos, self.pos + n
        if self.pos > self.size:
            raise self.past_end(start, n, what)
        return start

    def past_end(self, start: int, n: int, what: str) -> GGUFFormatError:
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

    def count(self, n: int, item_bytes: int, what: str) -> int:
        if n * item_bytes > self.size - self.pos:
            raise self.fail(
                f"truncated or corrupt: {what} at byte {self.pos} claims {n} items but "
                f"{self.size - self.pos} bytes follow; download it again"
            )
        return n

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
            n = self.count(self.scalar(_UINT64, what), dtype.itemsize, what)
            start = self.take(n * dtype.itemsize, what)
            return np.frombuffer(self.buf, dtype, n, start).tolist()
        if item_type == _STRING:
            return self.strings(self.count(self.scalar(_UINT64, what), 8, what), what)
        if depth >= _MAX_NESTING:  # an array of arrays
            raise self.fail(f"{what} nests arrays over {_MAX_NESTING} deep: the file is corrupt")
        n = self.count(self.scalar(_UINT64, what), 12, what)  # 12: an empty array's bytes
        return [self.value(_ARRAY, what, depth + 1) for _ in range(n)]

    def unknown_type(self, value_type: int, what: str) -> GGUFFormatError:
        return self.fail(f"{what} has unknown value type {value_type}: the file is corrupt")

    def strings(self, n: int, what: str) -> list[str]:
        # The hot loop (a vocabulary and its merges: ~400k strings), so kept to locals.
        buf, pos, size = self.buf, self.pos, self.size
        out: list[str] = []
        append = out.append
        try:
            for _ in range(n):
                end = pos + 8 + int.from_bytes(buf[pos : pos + 8], "little")
                if end > size:
                    raise self.past_end(pos, end - pos, f"{what}[{len(out)}]")
                append(str(buf[pos + 8 : end], "utf-8"))
                pos = end
        except UnicodeDecodeError as exc:
            raise self.fail(
                f"{what}[{len(out)}] is not UTF-8 ({exc}): the file is corrupt"
            ) from None
        self.pos = pos
        return out

    def contents(self) -> GGUFContents:
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
        n_entries = self.count(self.scalar(_UINT64, "the metadata count"), 13, "the metadata")
        metadata: dict[str, Any] = {}
        for i in range(n_entries):
            key = self.string(f"metadata key {i}")
            if key in metadata:
                raise self.fail(f"metadata key {key!r} appears twice: the file is corrupt")
            metadata[key] = self.value(self.scalar(_UINT32, key), key)
        infos: dict[str, tuple[tuple[int, ...], int, int]] = {}
        for i in range(self.count(n_tensors, 24, "the tensor table")):
            name = self.string(f"tensor name {i}")
            if name in infos:
                raise self.fail(f"tensor {name} appears twice: the file is corrupt")
            n_dims = self.scalar(_UINT32, name)
            if n_dims > _MAX_DIMS:
                raise self.fail(f"tensor {name} has {n_dims} dimensions: the file is corrupt")
            ne = struct.unpack_from(f"<{n_dims}Q", self.buf, self.take(8 * n_dims, name))
            infos[name] = (ne, self.scalar(_UINT32, name), self.scalar(_UINT64, name))
        alignment = metadata.get("general.alignment", 32)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise self.fail(f"general.alignment {alignment!r} is not a power of two")
        data_offset = -(-self.pos // alignment) * alignment
        return GGUFContents(
            path=self.path,
            version=version,
            metadata=metadata,
            tensors=[self.tensor(name, *info, data_offset) for name, info in infos.items()],
            alignment=alignment,
            data_offset=data_offset,
            data=self.data,
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
