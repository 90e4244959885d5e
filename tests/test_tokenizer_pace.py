"""The pace check on tokenizer.json (modeling/text/tokenizer_file.py): every pre-tokenizer
regex real models ship passes it with SmolLM2's real byte-level vocabulary and merges, and
a file is paced once a process. The hostile regexes it refuses are in
tests/test_hostile_folders.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modeling.checkpoints.gguf_file import read_gguf
from modeling.text import gguf_pretokenizers, tokenizer_file
from modeling.text.gguf_tokenizer import tokenizer_from_gguf
from tests.conftest import SHARED_MODELS

SMOLLM2 = SHARED_MODELS / "smollm2-135m-instruct" / "smollm2-135m-instruct-q4_1.gguf"
REAL = [
    "GPT2", "LLAMA3", "QWEN2", "QWEN35", "TEKKEN", "GPT4O", "KIMI_K2", "DEEPSEEK3", "SPARK",
    "BLOOM", "JAIS2", "YOUTU", "YOUTU_WORDS",
]  # fmt: skip


@pytest.fixture(scope="module")
def byte_level() -> dict[str, Any]:
    """SmolLM2's tokenizer (49,152 tokens, its merges) as a tokenizer.json."""
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} is not here")
    tokenizer = tokenizer_from_gguf(read_gguf(SMOLLM2).metadata, str(SMOLLM2))
    return json.loads(tokenizer.backend.to_str())


def _with_regex(spec: dict[str, Any], regex: str, folder: Path) -> Path:
    file = folder / "tokenizer.json"
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    byte_level["use_regex"] = False
    pre = {"type": "Sequence", "pretokenizers": [split, byte_level]}
    file.write_text(json.dumps({**spec, "pre_tokenizer": pre}))
    return file


@pytest.mark.parametrize("name", REAL)
def test_every_real_pre_tokenizer_regex_is_paced_and_passes(
    name: str, byte_level: dict[str, Any], tmp_path: Path
) -> None:
    file = _with_regex(byte_level, getattr(gguf_pretokenizers, name), tmp_path)
    backend = tokenizer_file.read_backend(file)
    assert backend.encode("Hello world").tokens == ["Hello", "Ġworld"]


def test_a_file_is_paced_once_a_process(
    byte_level: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = _with_regex(byte_level, gguf_pretokenizers.LLAMA3 + "|zz", tmp_path)
    timed: list[str] = []
    real = tokenizer_file._timed

    def spy(backend: Any, probe: str, file: Path, tries: int = 1) -> float:
        timed.append(probe)
        return real(backend, probe, file, tries)

    monkeypatch.setattr(tokenizer_file, "_timed", spy)
    tokenizer_file.read_backend(file)
    probes = len(tokenizer_file._probes(64))
    assert len(timed) >= probes * len(tokenizer_file.RUNGS)
    again = len(timed)
    tokenizer_file.read_backend(file)
    assert len(timed) == again  # the same text: not paced again
    file.write_text(file.read_text().replace("|zz", "|zy"))
    tokenizer_file.read_backend(file)
    assert len(timed) > again  # another text is


def test_the_same_text_read_twice_is_built_once(byte_level: dict[str, Any], tmp_path: Path) -> None:
    """A start reads the target's tokenizer.json twice (`--draft auto`, then the load): the
    second read of the same text returns what the first built; another text is built."""
    file = _with_regex(byte_level, gguf_pretokenizers.GPT2, tmp_path)
    first = tokenizer_file.read_backend(file)
    assert tokenizer_file.read_backend(file) is first
    file.write_text(file.read_text().replace('"use_regex": false', '"use_regex": true'))
    assert tokenizer_file.read_backend(file) is not first
