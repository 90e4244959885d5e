"""A model folder's small files read as hostile input: regular files only (a FIFO would
block the read forever), within a size bound checked as they are read, UTF-8, JSON objects
nested at most MAX_JSON_DEPTH deep; and the shard index's names confined to the folder.
Each refusal is one CheckpointError line naming the file (and the key). The weights
themselves are modeling/checkpoints/safetensors_model.py's."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from modeling.checkpoints.gguf_file import short_repr
from modeling.checkpoints.regular import open_regular

# Bounds on a model folder's text files, checked before one is read (a hostile file may
# claim anything). tokenizer.json: the largest real ones are ~33 MB (Gemma 3's, 262,144
# tokens), so 64 MiB is about twice that. The others (config.json, generation_config.json,
# tokenizer_config.json, the shard index, chat_template.jinja) are a few KB to a few MB
# (a shard index of 100k tensors: ~10 MB).
MAX_TOKENIZER_BYTES = 2**26
MAX_TEXT_BYTES = 2**25
# Containers within containers in those JSON files: real ones nest 5 or 6 deep (a
# quantization config's groups); deeper is a hostile file, refused before anything (an
# error message's repr included) recurses into it.
MAX_JSON_DEPTH = 32
INDEX = "model.safetensors.index.json"
DAMAGED = "fix the file or download the model again"


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match its config (missing, unexpected, wrong shape),
    or one of its files is not a regular file."""


def refuse_irregular(*paths: Path) -> None:
    """A CheckpointError naming the first of `paths` that is there but is not a regular file
    (a FIFO, a device, a folder), checked before it is opened: opening a FIFO waits for a
    writer, forever for a model's file. A path with nothing there passes: the caller's own
    check says what is missing."""
    for path in paths:
        try:
            mode = os.stat(path).st_mode  # symlinks followed: the hub cache's lead to blobs
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise CheckpointError(
                f"{path}: not a regular file (a FIFO, a device or a folder); specd reads a "
                "model's files only from regular files"
            )


def read_text(file: Path, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a model folder's regular file of at most `limit` bytes (checked as
    it is read, so a file that grows meanwhile is refused too), or a CheckpointError
    naming it."""
    try:
        with os.fdopen(open_regular(file), "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise CheckpointError(
            f"{file}: over {limit:,} bytes, more than any real model's (specd's bound): {DAMAGED}"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not UTF-8 text (byte {exc.start:,}): {DAMAGED}") from None


# Values a folder's JSON file may hold (config.json, generation_config.json,
# tokenizer_config.json, ...), counted by its commas and brackets before it is parsed:
# Python's parser takes some 60 bytes a value, and 32 MB of "[]," cost 11 s and 1.2 GB
# (four such files 37 s and 1.9 GB, an attacker found). tokenizer.json has its own bound.
MAX_FOLDER_JSON_VALUES = 2**20


def read_json_object(file: Path) -> dict[str, Any]:
    """A model folder's JSON file (config.json, generation_config.json, ...) as an object,
    or a CheckpointError naming it: past MAX_TEXT_BYTES or MAX_FOLDER_JSON_VALUES, not
    JSON, not an object, or nested past MAX_JSON_DEPTH (Python's parser stops at its recursion limit, ~1,000)."""
    text = read_text(file)
    values = text.count(",") + text.count("[") + text.count("{")
    if values > MAX_FOLDER_JSON_VALUES:
        raise CheckpointError(
            f"{file}: holds about {values:,} values; specd reads at most "
            f"{MAX_FOLDER_JSON_VALUES:,} in such a file (Gemma 3's tokenizer_config.json "
            f"has about 50,000): {DAMAGED}"
        )
    too_deep = f"{file}: nested over {MAX_JSON_DEPTH} deep, more than any real one: {DAMAGED}"
    try:
        value = json.loads(text)
    except RecursionError:
        raise CheckpointError(too_deep) from None
    except ValueError as exc:
        raise CheckpointError(f"{file}: not JSON ({str(exc)[:120]}): {DAMAGED}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: not a JSON object but {short_repr(value)}: {DAMAGED}")
    if _nests_past(value, MAX_JSON_DEPTH):
        raise CheckpointError(too_deep)
    return value


def _nests_past(value: Any, depth: int) -> bool:
    """Whether `value` holds containers more than `depth` deep (the outermost counts as
    one), found level by level, without recursing."""
    level = [value]
    for _ in range(depth):
        level = [
            inner
            for outer in level
            for inner in (outer.values() if isinstance(outer, dict) else outer)
            if isinstance(inner, dict | list)
        ]
        if not level:
            return False
    return True


def indexed_shards(path: Path) -> list[str] | None:
    """The shard files that the folder's model.safetensors.index.json names (its
    `weight_map`'s values), sorted; None where it has no index. Each must be a file name
    alone: a shard is read from the model's folder, never from a path the index makes up
    (`../../etc/passwd`, `/dev/zero`). CheckpointError naming the index and the key."""
    index = path / INDEX
    refuse_irregular(index)
    if not index.is_file():
        return None
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index}: weight_map is {short_repr(weight_map)}; it must be an object of "
            f"tensor names to shard files: {DAMAGED}"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _plain_file_name(shard):
            raise CheckpointError(
                f"{index}: weight_map[{short_repr(name)}] is {short_repr(shard)}; a shard "
                f"is named by a file name in the model's folder (no folder, no '..'): {DAMAGED}"
            )
    shards = set(weight_map.values())
    if len(shards) > MAX_SHARDS:
        raise CheckpointError(
            f"{index}: weight_map names {len(shards):,} shard files; specd reads at most "
            f"{MAX_SHARDS:,} (DeepSeek-V3's 671B has 163): {DAMAGED}"
        )
    return sorted(shards)


# Shard files one index may name: each is looked at (regular, present) at every open, and a
# million of them took minutes and a 12 MB error line.
MAX_SHARDS = 4096


def _plain_file_name(name: str) -> bool:
    """A name of a file in the folder: no separator (so not absolute), not `..`, no NUL."""
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
