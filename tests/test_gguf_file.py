"""read_gguf against gguf-py's GGUFReader and the reference.json of each of the 13 shared GGUF
files, on a Llama-3-sized tokenizer written by gguf-py's GGUFWriter, and on broken files."""

from __future__ import annotations

import json
import math
import os
import random
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from modeling.checkpoints import gguf_file
from modeling.checkpoints.gguf_file import GGUFFormatError, read_file_type, read_gguf
from tests.conftest import SHARED_MODELS
from tests.test_model_stores import deadline

GGUFS = SHARED_MODELS / "gguf"
FILES = sorted(GGUFS.glob("*.gguf"))
SMALL = GGUFS / "stories260k-Q4_0.gguf"


def test_all_shared_files_are_here() -> None:
    assert len(FILES) == 13


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_matches_gguf_reader_and_reference(path: Path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, value in fields.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert ours.version == theirs.fields["GGUF.version"].contents() == 3
    assert len(ours.tensors) == len(theirs.tensors)
    for info, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert ours.tensors_by_name[info.name] is info
        assert (info.name, info.ggml_type, info.offset) == (
            tensor.name,
            tensor.tensor_type,
            tensor.data_offset,
        )
        assert info.ne == tuple(tensor.shape.tolist()) and info.n_bytes == tensor.n_bytes
        view = ours.tensor_bytes(info)
        assert view.dtype == np.uint8 and view.shape[0] == math.prod(info.ne[1:])  # (rows, …)
        assert view.size == info.n_bytes
        assert view.tobytes() == tensor.data.tobytes(), info.name
        assert not view.flags.writeable and not view.flags.owndata  # a view into the map

    reference = json.loads(path.with_suffix(".reference.json").read_text())
    assert ours.version == reference["gguf_version"]
    assert ours.data_offset == reference["tensor_data_offset"]
    listed = [
        {
            "name": t.name,
            "type": gguf.GGMLQuantizationType(t.ggml_type).name,
            "ne": list(t.ne),
            "bytes": t.n_bytes,
            "file_offset": t.offset,
        }
        for t in ours.tensors
    ]
    assert listed == reference["tensors"]


def _llama3_sized(path: Path) -> dict[str, list]:
    """A GGUF with a Llama 3 sized byte-level tokenizer (128,256 tokens, 280,147 merges)."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzĠĊéü日本語0123456789"
    tokens = [f"{i}" + "".join(rng.choices(letters, k=rng.randint(1, 9))) for i in range(128256)]
    values = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": (-np.arange(len(tokens), dtype=np.float32) / 3).tolist(),
        "tokenizer.ggml.token_type": [rng.choice((1, 3, 4, 6)) for _ in tokens],
        "tokenizer.ggml.merges": [
            f"{rng.choice(tokens)} {rng.choice(tokens)}" for _ in range(280147)
        ],
    }
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(values["tokenizer.ggml.tokens"])
    writer.add_token_scores(values["tokenizer.ggml.scores"])
    writer.add_token_types(values["tokenizer.ggml.token_type"])
    writer.add_token_merges(values["tokenizer.ggml.merges"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tensor("token_embd.weight", np.arange(3 * 64, dtype=np.float32).reshape(3, 64))
    q8 = np.arange(2 * 4 * 34, dtype=np.uint8).reshape(2, 4 * 34)  # 2 rows of 4 Q8_0 blocks
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def test_a_llama3_sized_tokenizer_reads_in_well_under_a_second(tmp_path: Path) -> None:
    path = tmp_path / "llama3-sized.gguf"
    values = _llama3_sized(path)
    start = time.perf_counter()
    contents = read_gguf(path)
    seconds = time.perf_counter() - start
    print(f"read_gguf: 128k tokens, 280k merges in {seconds:.3f} s")
    assert seconds < 5  # ~0.3 s on a 2-core box; gguf.GGUFReader takes ~12 s
    for key, value in values.items():
        assert contents.metadata[key] == value, key
    assert contents.metadata["general.file_type"] == 7
    start = time.perf_counter()
    assert read_file_type(path) == 7  # every array skipped, none built: ~0.09 s
    assert time.perf_counter() - start < seconds + 1
    embd, q8 = contents.tensors
    assert (embd.ne, embd.ggml_type, q8.ne, q8.ggml_type) == ((64, 3), 0, (128, 2), 8)
    assert contents.tensor_bytes(embd).view(np.float32).tolist() == (
        np.arange(3 * 64, dtype=np.float32).reshape(3, 64).tolist()
    )
    assert contents.tensor_bytes(q8).tolist() == (np.arange(2 * 136) % 256).reshape(2, 136).tolist()


def test_every_value_type_and_nested_arrays(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    T = gguf.GGUFValueType
    scalars = [
        (T.UINT8, 255), (T.INT8, -128), (T.UINT16, 65535), (T.INT16, -32768),
        (T.UINT32, 2**32 - 1), (T.INT32, -(2**31)), (T.FLOAT32, 0.1), (T.BOOL, True),
        (T.UINT64, 2**64 - 1), (T.INT64, -(2**63)), (T.FLOAT64, 0.1),
    ]  # fmt: skip
    for vtype, value in scalars:
        writer.add_key_value(f"scalar.{vtype.name}", value, vtype)
        writer.add_key_value(f"array.{vtype.name}", [value, value], T.ARRAY, sub_type=vtype)
    writer.add_key_value("text", "héllo", T.STRING)
    writer.add_key_value("nested", [[1, 2], [3]], T.ARRAY)
    writer.add_key_value("nested.strings", [["a", "b"], ["ç"]], T.ARRAY)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = read_gguf(path).metadata
    fields = gguf.GGUFReader(path).fields
    for vtype, _ in scalars:
        for key in (f"scalar.{vtype.name}", f"array.{vtype.name}"):
            assert metadata[key] == fields[key].contents(), key
            assert type(metadata[key]) is type(fields[key].contents()), key
    assert metadata["scalar.FLOAT32"] == float(np.float32(0.1)) and metadata["text"] == "héllo"
    assert metadata["nested"] == [[1, 2], [3]]  # GGUFReader flattens these
    assert metadata["nested.strings"] == [["a", "b"], ["ç"]]
    assert read_gguf(path).tensors == []


# Broken files: each is a GGUFFormatError naming the file, never another exception.


def _refused(path: Path, data: bytes) -> str:
    """The message reading `data` as `path` raises, after the path it starts with."""
    path.write_bytes(data)
    with pytest.raises(GGUFFormatError) as caught:
        read_gguf(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message.removeprefix(f"{path}: ")


def _entry(key: bytes, value_type: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<I", value_type) + payload


def _file(*entries: bytes, version: int = 3, n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(entries)) + b"".join(entries)


def test_bad_magic_version_and_byte_order(tmp_path: Path) -> None:
    data = SMALL.read_bytes()
    path = tmp_path / "model.gguf"
    assert _refused(path, b"GGML" + data[4:]).startswith("not a GGUF file")
    assert "not a GGUF file" in _refused(path, b"")
    assert "not a GGUF file" in _refused(path, b"GG")
    assert "GGUF version 1 " in _refused(path, data[:4] + struct.pack("<I", 1) + data[8:])
    assert "unknown GGUF version 99" in _refused(path, data[:4] + struct.pack("<I", 99) + data[8:])
    assert "big-endian" in _refused(path, data[:4] + struct.pack(">I", 3) + data[8:])


def test_truncated_anywhere_in_the_header(tmp_path: Path) -> None:
    data, data_offset = SMALL.read_bytes(), read_gguf(SMALL).data_offset
    path = tmp_path / "cut.gguf"
    for end in [*range(0, 64), *random.Random(0).sample(range(64, data_offset + 1), 300)]:
        message = _refused(path, data[:end])
        if end < 4:
            assert message == f"not a GGUF file ({end} bytes): give a .gguf model"
        else:
            assert message.startswith("truncated") and message.endswith("download it again")


def test_truncated_in_the_data(tmp_path: Path) -> None:
    last = max(read_gguf(SMALL).tensors, key=lambda t: t.offset + t.n_bytes)
    end = last.offset + last.n_bytes
    message = _refused(tmp_path / "cut.gguf", SMALL.read_bytes()[: end - 1])
    assert message == (
        f"truncated: tensor {last.name} ends at byte {end} but the file has {end - 1} bytes; "
        f"download it again"
    )


def test_absurd_lengths_and_counts(tmp_path: Path) -> None:
    data = SMALL.read_bytes()
    path = tmp_path / "model.gguf"
    huge = struct.pack("<Q", 2**63)
    claims = f"claims {2**63} items but"
    # The first key's length, the metadata count, the tensor count.
    assert _refused(path, data[:24] + huge + data[32:]).startswith(
        f"truncated: metadata key 0 at byte 32 needs {2**63} bytes"
    )
    assert f"the metadata at byte 24 {claims}" in _refused(path, data[:16] + huge + data[24:])
    assert f"the tensor table at byte 11735 {claims}" in _refused(path, data[:8] + huge + data[16:])
    # The vocabulary's item count, and its first string's length.
    count_at = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8
    message = _refused(path, data[:count_at] + huge + data[count_at + 8 :])
    assert f"tokenizer.ggml.tokens at byte {count_at + 8} {claims}" in message
    first = count_at + 8
    message = _refused(path, data[:first] + huge + data[first + 8 :])
    assert message.startswith(f"truncated: tokenizer.ggml.tokens[0] at byte {first} needs")


def test_malformed_values(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    assert "unknown value type 13" in _refused(path, _file(_entry(b"k", 13, b"")))
    empty_of_unknown = struct.pack("<IQ", 13, 0)
    assert "unknown value type 13" in _refused(path, _file(_entry(b"k", 9, empty_of_unknown)))
    assert "not UTF-8" in _refused(path, _file(_entry(b"\xff", 4, b"\0" * 4)))
    strings = struct.pack("<IQQ", 8, 1, 1) + b"\xff"
    assert "k[0] is not UTF-8" in _refused(path, _file(_entry(b"k", 9, strings)))
    assert "twice" in _refused(path, _file(*[_entry(b"k", 4, b"\0" * 4)] * 2))
    deep = struct.pack("<IQ", 9, 1) * 40 + struct.pack("<IQ", 4, 0)
    assert "nests arrays" in _refused(path, _file(_entry(b"k", 9, deep)))
    alignment = _entry(b"general.alignment", 4, struct.pack("<I", 48))
    assert "not a power of two" in _refused(path, _file(alignment))


def _tensor(name: bytes, ne: tuple[int, ...], ggml_type: int, offset: int = 0) -> bytes:
    return (
        struct.pack("<Q", len(name))
        + name
        + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type, offset)
    )


def test_malformed_tensor_infos(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"

    def table(*tensors: bytes) -> bytes:
        return _file(n_tensors=len(tensors)) + b"".join(tensors) + b"\0" * 4096

    assert "5 dimensions" in _refused(path, table(_tensor(b"t", (1, 1, 1, 1, 1), 0)))
    assert "ggml type 99" in _refused(path, table(_tensor(b"t", (4,), 99)))
    assert "whole blocks of 32" in _refused(path, table(_tensor(b"t", (48,), 8)))
    assert "appears twice" in _refused(path, table(*[_tensor(b"t", (4,), 0)] * 2))
    assert "ends at byte" in _refused(path, table(_tensor(b"t", (2**40, 2**40), 0)))
    # Data off the alignment, or two tensors on the same bytes (llama.cpp refuses both):
    # read as they are, one tensor's bytes are another's weights, NaN scales and all.
    misaligned = table(_tensor(b"t", (4,), 0, offset=8))
    assert "t's offset 8 is not a multiple of general.alignment 32" in _refused(path, misaligned)
    overlap = table(_tensor(b"a", (16,), 0, offset=0), _tensor(b"b", (16,), 0, offset=32))
    assert "tensors a and b overlap" in _refused(path, overlap)  # (a: 64 bytes of F32)
    path.write_bytes(table(_tensor(b"a", (8,), 0), _tensor(b"b", (8,), 0, 32)))  # (a: 32 bytes)
    assert [t.name for t in read_gguf(path).tensors] == ["a", "b"]


def test_flipped_header_bytes_never_raise_anything_else(tmp_path: Path) -> None:
    data, data_offset = SMALL.read_bytes(), read_gguf(SMALL).data_offset
    path, rng = tmp_path / "flipped.gguf", random.Random(1)
    for _ in range(300):
        broken = bytearray(data)
        for at in rng.sample(range(data_offset), 3):
            broken[at] = rng.randrange(256)
        path.write_bytes(broken)
        try:
            read_gguf(path)
        except GGUFFormatError as exc:
            assert str(exc).startswith(f"{path}: ")


# Hostile files (issue 32): counts are checked against what follows and against specd's
# bounds before anything is read per item. Sparse files have every byte they claim, as
# zeros, at no cost on disk: the size of the file bounds nothing.


def _sparse(path: Path, head: bytes, size: int) -> Path:
    with path.open("wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def _refused_quickly(path: Path) -> str:
    start = time.perf_counter()
    with pytest.raises(GGUFFormatError) as caught:
        read_gguf(path)
    assert time.perf_counter() - start < 1, "read per item before refusing"
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message.removeprefix(f"{path}: ")


def test_counts_over_the_bounds_are_refused_before_any_item_is_read(tmp_path: Path) -> None:
    path, huge = tmp_path / "sparse.gguf", 2**31
    strings = _entry(b"tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2**26))
    message = _refused_quickly(_sparse(path, _file(strings), huge))
    assert message.startswith(
        f"tokenizer.ggml.tokens claims 67,108,864 items (a real model's largest array, its "
        f"vocabulary, has at most 262,144); specd reads at most {gguf_file.MAX_ARRAY_LENGTH:,}"
    )
    numbers = _entry(b"k", 9, struct.pack("<IQ", 0, gguf_file.MAX_ARRAY_LENGTH + 1))
    assert "k claims 4,194,305 items" in _refused_quickly(_sparse(path, _file(numbers), huge))
    many_keys = b"GGUF" + struct.pack("<IQQ", 3, 0, gguf_file.MAX_METADATA + 1)
    message = _refused_quickly(_sparse(path, many_keys, huge))
    assert message.startswith("the metadata claims 65,537 keys (a real model has 20-60)")
    many_tensors = _file(n_tensors=gguf_file.MAX_TENSORS + 1)
    assert "the tensor table claims 65,537 tensors" in _refused_quickly(
        _sparse(path, many_tensors, huge)
    )
    string = _entry(b"k", 8, struct.pack("<Q", gguf_file.MAX_HEADER_BYTES))
    message = _refused_quickly(_sparse(path, _file(string), huge))
    assert message.startswith(f"k at byte {len(_file(string))} takes 134,217,728 bytes")
    assert "specd reads headers of at most that size" in message


def test_the_items_of_all_arrays_together_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gguf_file, "MAX_ARRAY_ITEMS", 10)
    five = struct.pack("<IQ", 4, 5) + bytes(20)
    path = tmp_path / "items.gguf"
    path.write_bytes(_file(_entry(b"a", 9, five), _entry(b"b", 9, five)))
    assert read_gguf(path).metadata == {"a": [0] * 5, "b": [0] * 5}
    nested = struct.pack("<IQ", 9, 3) + struct.pack("<IQ", 4, 0) * 3  # 3 arrays: 3 items
    path.write_bytes(_file(_entry(b"a", 9, five), _entry(b"b", 9, nested), _entry(b"c", 9, five)))
    assert _refused_quickly(path).startswith("c brings the items of the file's arrays to 13")


def test_arrays_held_in_arrays_are_bounded(tmp_path: Path) -> None:
    """No model's metadata holds arrays of arrays, and each costs a Python call: an 8 KB
    sparse file of 8 million empty ones took 26 s and 0.9 GB, at every start while it sat
    in a model store (the draft search reads the stores). A few are read as they are."""
    path = tmp_path / "nested.gguf"
    few = struct.pack("<IQ", 9, 2) + struct.pack("<IQ", 4, 1) + bytes(4) + struct.pack("<IQ", 4, 0)
    path.write_bytes(_file(_entry(b"a", 9, few)))
    assert read_gguf(path).metadata == {"a": [[0], []]}
    many = gguf_file.MAX_NESTED_ARRAYS + 1
    empty = struct.pack("<IQ", 9, many)  # then `many` empty arrays of uint8: zeros, sparse
    message = _refused_quickly(_sparse(path, _file(_entry(b"a.x", 9, empty)), 12 * many + 64))
    assert message.startswith(f"a.x brings the arrays held in arrays to {many:,}; specd reads")


def test_a_zero_dimension_is_refused(tmp_path: Path) -> None:
    table = _file(n_tensors=1) + _tensor(b"t", (64, 0), 0) + b"\0" * 64
    assert "tensor t has a dimension of 0 ([64, 0])" in _refused(tmp_path / "z.gguf", table)


def test_a_fifo_or_a_folder_is_refused_without_reading_it(tmp_path: Path) -> None:
    """Opening a FIFO for reading waits for a writer: forever, for a model path."""
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with deadline(10):
        for path in (fifo, tmp_path):
            assert "not a regular file" in _refused_quickly(path)
