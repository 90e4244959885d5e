"""Hostile model folders: copies of the shared stories260k whose JSON files (config.json,
generation_config.json, tokenizer.json, tokenizer_config.json, a shard index) are garbage,
nested without end, of the wrong types or too large, whose shard index points outside the
folder, or whose tokenizer produces ids the embedding has no row for. `specd plan` and
`specd generate` must answer each with exit status 2 and one line on stderr naming the
file and the key, before they read past a bound or recurse into the file (the GGUF files'
own: tests/test_hostile_files.py)."""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from daemon.cli.commands import main
from modeling.checkpoints import checkpoint
from modeling.checkpoints.folder_files import (
    INDEX,
    MAX_JSON_DEPTH,
    MAX_TEXT_BYTES,
    MAX_TOKENIZER_BYTES,
    CheckpointError,
)
from modeling.checkpoints.safetensors_model import weight_files
from tests.conftest import SHARED_MODELS
from tests.test_hostile_files import SOURCE, quiet_home, rewrite  # noqa: F401 (a fixture)

STORIES = SHARED_MODELS / "stories260k"
MODEL = ["--model", "{}", "--draft", "none"]
COMMANDS = {
    "plan": ["plan", *MODEL],
    "generate": ["generate", *MODEL, "--max-tokens", "2", "--prompt", "Once <big>"],
}
Mutation = Callable[[Path], None]


def _write(name: str, text: str) -> Mutation:
    return lambda folder: (folder / name).write_text(text)


def _edit(name: str, change: Callable[[Any], Any]) -> Mutation:
    """The folder's JSON file `name` rewritten as `change` returns it (given it parsed)."""

    def mutate(folder: Path) -> None:
        file = folder / name
        file.write_text(json.dumps(change(json.loads(file.read_text()))))

    return mutate


def _sparse(name: str, size: int) -> Mutation:
    """`name` as `size` zero bytes: a sparse file, nothing on disk."""

    def mutate(folder: Path) -> None:
        with (folder / name).open("wb") as f:
            f.truncate(size)

    return mutate


def _index(weight_map: Any) -> Mutation:
    return _write(INDEX, json.dumps({"metadata": {}, "weight_map": weight_map}))


def _with(key: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda raw: {**raw, key: value}


def _vocab(token: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(tok: dict[str, Any]) -> dict[str, Any]:
        tok["model"]["vocab"][token] = value
        return tok

    return change


def _added(token: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(tok: dict[str, Any]) -> dict[str, Any]:
        tok["added_tokens"].append({**tok["added_tokens"][0], **token})
        return tok

    return change


def _added_many(count: int, content: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(tok: dict[str, Any]) -> dict[str, Any]:
        first = tok["added_tokens"][0]
        tok["added_tokens"] += [{**first, "content": f"{i}{content}"} for i in range(count)]
        return tok

    return change


def _merge(merge: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(tok: dict[str, Any]) -> dict[str, Any]:
        tok["model"]["merges"].append(merge)
        return tok

    return change


def _model_type(tok: dict[str, Any]) -> dict[str, Any]:
    tok["model"]["type"] = "Bogus"
    return tok


def _first_added_id(value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(tok: dict[str, Any]) -> dict[str, Any]:
        tok["added_tokens"][0]["id"] = value
        return tok

    return change


def _part(part: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda tok: {**tok, part: value}


def _sequence(normalizers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "Sequence", "normalizers": normalizers}


def _precompiled(char: str, written: str) -> dict[str, Any]:
    """A SentencePiece charsmap (tokenizers' `Precompiled` normalizer) that writes `written`
    for the one-byte `char`: a 4-byte trie size, a darts-clone double array holding the one
    key (root -> its node at 1 ^ byte, labelled, with a leaf next to it whose value is the
    offset 0), then the NUL-terminated strings."""
    byte = char.encode()[0]
    units = [0] * 256
    units[0] = 1 << 10  # the root: children at offset 1
    node = 1 ^ byte
    units[node] = byte | 1 << 8 | 1 << 10  # its label, a leaf below, at offset 1
    units[node ^ 1] = 1 << 31  # the leaf: value 0, where `written` starts
    trie = b"".join(unit.to_bytes(4, "little") for unit in units)
    blob = len(trie).to_bytes(4, "little") + trie + written.encode() + b"\0"
    return {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(blob).decode()}


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _special_ids(ids: list[int]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def change(tok: dict[str, Any]) -> dict[str, Any]:
        tok["post_processor"]["special_tokens"]["<s>"]["ids"] = ids
        return tok

    return change


DEEP = "[" * 100_000
TOKENIZER, TC = "tokenizer.json", "tokenizer_config.json"
GEN, CONFIG = "generation_config.json", "config.json"
# label → (mutation, the file named, what the line says of it: the key, or the fault)
MUTATIONS: dict[str, tuple[Mutation, str, str]] = {
    # model.safetensors.index.json
    "index-weight-map-a-list": (_index(["model.safetensors"]), INDEX, "weight_map is"),
    "index-root-a-list": (_write(INDEX, "[1]"), INDEX, "not a JSON object"),
    "index-without-weight-map": (_write(INDEX, "{}"), INDEX, "weight_map is None"),
    "index-shard-a-number": (_index({"a": 5}), INDEX, "weight_map['a'] is 5"),
    "index-garbage": (_write(INDEX, "{garbage"), INDEX, "not JSON"),
    "index-nested-deep": (_write(INDEX, DEEP), INDEX, "nested over"),
    "index-shard-up-the-tree": (_index({"a": "../../../../etc/passwd"}), INDEX, "weight_map['a']"),
    "index-shard-absolute": (_index({"a": "/etc/passwd"}), INDEX, "weight_map['a']"),
    "index-shard-in-a-folder": (_index({"a": "sub/model.safetensors"}), INDEX, "weight_map['a']"),
    "index-too-large": (_sparse(INDEX, MAX_TEXT_BYTES + 1), INDEX, "bytes"),
    # tokenizer.json: the `tokenizers` library's refusals, each in one short line
    "tokenizer-nested-deep": (_write(TOKENIZER, "[" * 50_000), TOKENIZER, "not a tokenizer"),
    "tokenizer-id-too-large": (_edit(TOKENIZER, _vocab("<unk>", 10**12)), TOKENIZER, "u32"),
    "tokenizer-id-negative": (_edit(TOKENIZER, _vocab("<unk>", -1)), TOKENIZER, "u32"),
    "tokenizer-merge-unknown": (_edit(TOKENIZER, _merge(["zzq", "qqz"])), TOKENIZER, "zzq"),
    "tokenizer-merge-a-number": (_edit(TOKENIZER, _merge(5)), TOKENIZER, "not a tokenizer"),
    "tokenizer-added-id-text": (_edit(TOKENIZER, _first_added_id("x")), TOKENIZER, "u32"),
    "tokenizer-model-type": (_edit(TOKENIZER, _model_type), TOKENIZER, "not a tokenizer"),
    "tokenizer-root-a-list": (_write(TOKENIZER, "[]"), TOKENIZER, "not a tokenizer"),
    "tokenizer-garbage": (_write(TOKENIZER, "{nope"), TOKENIZER, "not a tokenizer"),
    "tokenizer-too-large": (_sparse(TOKENIZER, MAX_TOKENIZER_BYTES + 1), TOKENIZER, "bytes"),
    # ids the embedding (512 rows) has no row for: a token the prompt holds indexed past it
    "tokenizer-token-past-the-embedding": (
        _edit(TOKENIZER, _added({"id": 1_000_000, "content": "<big>", "special": False})),
        TOKENIZER,
        "513 tokens but the model has 512 embedding rows",
    ),
    "tokenizer-id-past-the-embedding": (
        _edit(TOKENIZER, _vocab("<unk>", 700)),  # (as many tokens, one id past the rows)
        TOKENIZER,
        "ids up to 700 but the model has 512 embedding rows",
    ),
    # a normalizer, pre-tokenizer or decoder that writes megabytes for what it matches
    # (a 12-space prompt became 36M tokens, 6.9 GB), a post-processor id past the rows
    "tokenizer-normalizer-replace-bomb": (
        _edit(
            TOKENIZER,
            _part(
                "normalizer",
                {"type": "Replace", "pattern": {"String": " "}, "content": "a" * 3_000_000},
            ),
        ),
        TOKENIZER,
        "normalizer writes up to 3,000,000 characters for one it matches",
    ),
    "tokenizer-decoder-replace-bomb": (
        _edit(
            TOKENIZER,
            _part(
                "decoder", {"type": "Replace", "pattern": {"String": "a"}, "content": " " * 100_000}
            ),
        ),
        TOKENIZER,
        "decoder writes up to 100,000 characters",
    ),
    "tokenizer-prepend-bomb": (
        _edit(TOKENIZER, _part("normalizer", {"type": "Prepend", "prepend": "x" * 1000})),
        TOKENIZER,
        "writes up to 1,001 characters",
    ),
    # steps in sequence multiply: three Replaces of "a" by 60 made a character 216,000
    "tokenizer-nested-replace-bomb": (
        _edit(
            TOKENIZER,
            _part(
                "normalizer",
                {
                    "type": "Sequence",
                    "normalizers": [
                        {"type": "Replace", "pattern": {"String": "a"}, "content": "a" * 60}
                    ]
                    * 3,
                },
            ),
        ),
        TOKENIZER,
        "normalizer writes up to 216,000 characters",
    ),
    # a SentencePiece charsmap writing a million characters for "A" (1M tokens a letter);
    # ByteLevel normalizers in a chain, each spelling a character's bytes (22 took 11.8 GB
    # for 64 characters); a thousand steps that write nothing (900 took 10 s to load)
    "tokenizer-precompiled-bomb": (
        _edit(TOKENIZER, _part("normalizer", _precompiled("A", " x" * 500_000))),
        TOKENIZER,
        "normalizer writes up to 1,000,000 characters",
    ),
    # a Replace of "ل" by "ﷺ" (one character), then NFKC (18 characters, five "ل"): 5x a
    # round, where the content alone counted one
    "tokenizer-nfkc-replace-chain": (
        _edit(
            TOKENIZER,
            _part(
                "normalizer",
                _sequence(
                    [
                        {"type": "Replace", "pattern": {"String": "ل"}, "content": "ﷺ"},
                        {"type": "NFKC"},
                    ]
                    * 2
                ),
            ),
        ),
        TOKENIZER,
        "normalizer writes up to 324 characters",
    ),
    "tokenizer-bytelevel-chain": (
        _edit(TOKENIZER, _part("normalizer", _sequence([{"type": "ByteLevel"}] * 4))),
        TOKENIZER,
        "normalizer writes up to 256 characters",
    ),
    "tokenizer-a-thousand-steps": (
        _edit(TOKENIZER, _part("normalizer", _sequence([{"type": "Lowercase"}] * 1000))),
        TOKENIZER,
        "steps; at most 64 (real ones have a dozen)",
    ),
    # what the library builds at load, bounded before it does: added tokens matched whole
    # (20,000 of 1,000 CJK characters took 81 s and 4.5 GB), a token of any length (a
    # Unigram of 20,000 pieces of 1,000 characters: 21 s, 7 GB)
    "tokenizer-added-tokens-past-their-bytes": (
        _edit(TOKENIZER, _added_many(1_500, "東" * 1_000)),
        TOKENIZER,
        "tokens of 4,50",
    ),
    # every encode with special tokens writes the template's ids: 2.5 million made each
    # prompt 2.5 million tokens
    "tokenizer-post-processor-bomb": (
        _edit(TOKENIZER, _special_ids([1] * 100_000)),
        TOKENIZER,
        "post_processor holds 100,0",
    ),
    "tokenizer-added-token-too-long": (
        _edit(TOKENIZER, _added({"content": "x" * 1_025, "id": 511})),
        TOKENIZER,
        "added_tokens[3] is 1,025 characters long ('xxxxx",
    ),
    "tokenizer-piece-too-long": (
        _edit(TOKENIZER, _vocab("▁" + "y" * 2_000, 510)),
        TOKENIZER,
        "model.vocab[512] is 2,001 characters long",
    ),
    # A `Split` regex that backtracks: quadratic in a run of letters (62 s projected for a
    # 131,072-character prompt), cubic in a run of spaces, past the regex engine's retry
    # limit (a Rust panic) on one
    "tokenizer-quadratic-split": (
        _edit(TOKENIZER, _part("pre_tokenizer", _split(r"(?:a|\s)*b|\s+"))),
        TOKENIZER,
        "(a run of letters",
    ),
    "tokenizer-cubic-split": (
        _edit(TOKENIZER, _part("pre_tokenizer", _split(r"(\s*\s*\s*)x|\s"))),
        TOKENIZER,
        "(a run of spaces",
    ),
    # cubic only where "e" and "t" come within 40 characters, and only in runs of letters,
    # spaces and ".,;" (text without a tab, "=", "*" or "%")
    "tokenizer-split-slow-on-plain-prose": (
        _edit(
            TOKENIZER,
            _part(
                "pre_tokenizer",
                _split(
                    r"(?=[^e\t]{0,40}e)(?=[^t\t]{0,40}t)[\p{L} \n.,;]+[\p{L} \n.,;]+@"
                    r"|\p{L}+|\s+|[^\s\p{L}]+"
                ),
            ),
        ),
        TOKENIZER,
        "(plain English paragraphs",
    ),
    # quadratic only in runs of the marks a control token is made of ("<" and "|"), which
    # no probe of ordinary text holds: 3.4 s for 32,768 of them, minutes for a request
    "tokenizer-split-slow-on-runs-of-marks": (
        _edit(TOKENIZER, _part("pre_tokenizer", _split(r"[<|]+[^<|]|\p{L}+|\s+|[^\s\p{L}]"))),
        TOKENIZER,
        "(a run of '",  # ('<' or '|', as timing goes: a run of either is slow)
    ),
    # the same, its marks named by an octal escape and a wide character
    "tokenizer-split-slow-on-runs-of-marks-escaped": (
        _edit(
            TOKENIZER, _part("pre_tokenizer", _split(r"[\074＜]+[^\074＜]|\p{L}+|\s+|[^\s\p{L}]"))
        ),
        TOKENIZER,
        "(a run of",
    ),
    "tokenizer-split-past-the-retry-limit": (
        _edit(TOKENIZER, _part("pre_tokenizer", _split(r"(a|a)*b|\s|a"))),
        TOKENIZER,
        "fails on ordinary text (Onig: Regex search error: retry-limit-in-match over)",
    ),
    "tokenizer-special-id-past-the-embedding": (
        _edit(TOKENIZER, _special_ids([4_000_000_000])),
        TOKENIZER,
        "ids up to 4,000,000,000 but the model has 512 embedding rows",
    ),
    # tokenizer_config.json
    "bos-token-a-number": (_edit(TC, _with("bos_token", 5)), TC, "bos_token is 5"),
    "bos-token-content-a-number": (_edit(TC, _with("bos_token", {"content": 5})), TC, "bos_token"),
    "eos-token-a-list": (_edit(TC, _with("eos_token", ["</s>"])), TC, "eos_token is"),
    "add-bos-token-text": (_edit(TC, _with("add_bos_token", "yes")), TC, "add_bos_token is"),
    "tokenizer-config-garbage": (_write(TC, "{nope"), TC, "not JSON"),
    # a template of 500 KB took 13.7 s and 1.2 GB to compile (and `plan` compiles it)
    "chat-template-too-long": (
        _edit(TC, _with("chat_template", "{{x}}" * 40_000)),
        TC,
        "is 200,000 characters",
    ),
    "tokenizer-config-nested-deep": (_write(TC, DEEP), TC, "nested over"),
    # generation_config.json
    "eos-id-nested-list": (_edit(GEN, _with("eos_token_id", [[2]])), GEN, "eos_token_id is"),
    "eos-id-an-object": (_edit(GEN, _with("eos_token_id", {"a": 1})), GEN, "eos_token_id is"),
    "eos-id-past-the-vocabulary": (_edit(GEN, _with("eos_token_id", 512)), GEN, "eos_token_id"),
    "generation-config-a-list": (_write(GEN, "[1]"), GEN, "not a JSON object"),
    "generation-config-garbage": (_write(GEN, "{nope"), GEN, "not JSON"),
    "generation-config-nested-deep": (_write(GEN, DEEP), GEN, "nested over"),
    # config.json
    "config-nested-deep": (_write(CONFIG, DEEP), CONFIG, "nested over"),
    "config-300-mb": (_sparse(CONFIG, 300 * 2**20), CONFIG, "bytes"),
    "bos-id-past-the-vocabulary": (_edit(CONFIG, _with("bos_token_id", 10**12)), CONFIG, "bos"),
}


def hostile_copy(parent: Path, mutate: Mutation) -> Path:
    folder = parent / "model"
    shutil.copytree(STORIES, folder)
    for file in [folder, *folder.iterdir()]:
        file.chmod(0o755 if file.is_dir() else 0o644)  # (the shared copy is read-only)
    mutate(folder)
    return folder


@pytest.mark.parametrize("label", list(MUTATIONS))
@pytest.mark.usefixtures("quiet_home")
def test_each_mutation_is_one_line_naming_the_file_and_key(
    label: str, tmp_path: Path, capsys: Any
) -> None:
    mutate, name, says = MUTATIONS[label]
    folder = hostile_copy(tmp_path, mutate)
    for command, words in COMMANDS.items():
        start = time.perf_counter()
        status = main([word.format(folder) for word in words])
        err = capsys.readouterr().err
        assert status == 2, (command, err)
        assert err.count("\n") == 1 and err.startswith(f"specd: error: {folder / name}: "), err
        assert says in err and len(err) < 400, (command, err)
        assert time.perf_counter() - start < 10, command  # refused at a bound, not past it


@pytest.mark.parametrize(
    ("normalizer", "pre_tokenizer"),
    [
        # T5's and ALBERT's: a charsmap (NFKC's longest, 18 characters for U+FDFA; here for
        # "A"), runs of spaces made one; Metaspace
        (
            _sequence(
                [
                    _precompiled("A", "x" * 18),
                    {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
                ]
            ),
            None,
        ),
        # Llama 2's and Mistral's as transformers writes them
        (
            _sequence(
                [
                    {"type": "Prepend", "prepend": "▁"},
                    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
                ]
            ),
            {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious"},
        ),
        # GPT-2's and Qwen's
        (
            {"type": "NFC"},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True},
        ),
    ],
)
def test_real_tokenizer_steps_pass_the_bounds(
    normalizer: dict[str, Any], pre_tokenizer: dict[str, Any] | None, tmp_path: Path
) -> None:
    def change(tok: dict[str, Any]) -> dict[str, Any]:
        tok["normalizer"] = normalizer
        if pre_tokenizer is not None:
            tok["pre_tokenizer"] = {**pre_tokenizer, "invert": False}
        return tok

    folder = hostile_copy(tmp_path, _edit(TOKENIZER, change))
    tokenizer = checkpoint.load_tokenizer(checkpoint.open_checkpoint(folder))
    assert tokenizer.encode("Once  upon a time", add_special_tokens=False)


@pytest.mark.usefixtures("quiet_home")
def test_the_unmutated_copy_plans_and_generates(tmp_path: Path, capsys: Any) -> None:
    """What the mutations start from (and `Once <big>`, plain text to it) is fine."""
    folder = hostile_copy(tmp_path, lambda folder: None)
    for words in COMMANDS.values():
        assert main([word.format(folder) for word in words]) == 0
    capsys.readouterr()


def test_a_file_that_is_no_utf8_names_the_file(tmp_path: Path) -> None:
    folder = hostile_copy(tmp_path, lambda folder: (folder / CONFIG).write_bytes(b'{"a": "\xff"}'))
    with pytest.raises(CheckpointError, match=rf"^{folder / CONFIG}: not UTF-8 text \(byte 7\)"):
        checkpoint.open_checkpoint(folder)


def test_a_sharded_index_names_shards_in_the_folder_only(tmp_path: Path) -> None:
    """The shards an index names are read from the model's folder: a good index loads, one
    that names a path up the tree or elsewhere is refused before anything is opened."""
    good = hostile_copy(
        tmp_path / "good", _index({"model.embed_tokens.weight": "model.safetensors"})
    )
    assert weight_files(good) == [good / "model.safetensors"]
    checkpoint.load(good)  # (the index's one shard is the whole model)
    shards = ("../model.safetensors", "/etc/passwd", "..", ".", "", "a\\b", "a\0b")
    for n, shard in enumerate(shards):
        bad = hostile_copy(tmp_path / f"bad{n}", _index({"x": shard}))
        with pytest.raises(CheckpointError, match=r"weight_map\['x'\] is .* a shard is named"):
            weight_files(bad)


def test_a_vocabulary_past_the_bound_is_refused_before_its_ids_are_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """specd reads vocabularies of at most the GGUF bound (MAX_VOCABULARY): counted by the
    library, before the id → token dict that a 3M-token file would take 1.5 GB for."""
    monkeypatch.setattr(checkpoint, "MAX_VOCABULARY", 100)
    folder = hostile_copy(tmp_path, lambda folder: None)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: the vocabulary holds 512 tok"):
        checkpoint.load_tokenizer(checkpoint.open_checkpoint(folder))


@pytest.mark.usefixtures("quiet_home")
def test_a_gguf_vocabulary_past_its_embedding_is_refused(tmp_path: Path, capsys: Any) -> None:
    """A GGUF file whose vocab_size key (and embedding) says 256 rows for 512 tokens: the
    tokens past 255 have no row."""
    from gguf import GGUFValueType

    from modeling.checkpoints.gguf_file import read_gguf

    info = next(t for t in read_gguf(SOURCE).tensors if t.name == "token_embd.weight")
    rows = np.zeros((256, info.ne[0]), dtype=np.float32)
    path = rewrite(
        tmp_path / "short.gguf",
        {"llama.vocab_size": (256, GGUFValueType.UINT32)},
        tensors={"token_embd.weight": rows},
        drop=("token_embd.weight",),
    )
    for words in COMMANDS.values():
        assert main([word.format(path) for word in words]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"specd: error: {path}: tokenizer.ggml.tokens: the tokenizer ")
        assert "but the model has 256 embedding rows" in err and err.count("\n") == 1


@pytest.mark.parametrize(("depth", "refused"), [(32, False), (33, True)])
def test_json_nesting_is_bounded_at_max_json_depth(
    depth: int, refused: bool, tmp_path: Path
) -> None:
    """The object itself is one level: a config of 32 levels is read, one of 33 refused."""
    nested = "[" * (depth - 1) + "]" * (depth - 1)
    folder = hostile_copy(tmp_path, _edit(CONFIG, _with("x", json.loads(nested))))
    if refused:
        with pytest.raises(CheckpointError, match=rf"config\.json: nested over {MAX_JSON_DEPTH}"):
            checkpoint.open_checkpoint(folder)
    else:
        assert checkpoint.open_checkpoint(folder).config.vocab_size == 512


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json"])
def test_a_folders_json_files_are_counted_before_they_are_parsed(name: str, tmp_path: Path) -> None:
    """32 MB of `[],` in config.json cost 11 s and 1.2 GB to parse, and four such files 37 s
    and 1.9 GB, before anything was refused (an attacker found): a file holding more values
    than MAX_FOLDER_JSON_VALUES is refused from its commas and brackets, quickly."""
    from modeling.checkpoints.folder_files import MAX_FOLDER_JSON_VALUES

    def mutate(folder: Path) -> None:
        file = folder / name
        head = file.read_text().rstrip().removesuffix("}")
        file.write_text(head + ', "x": [' + ",".join(["[]"] * MAX_FOLDER_JSON_VALUES) + "]}")

    folder = hostile_copy(tmp_path, mutate)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=rf"{name}: holds about [\d,]+ values; specd reads"):
        checkpoint.load_tokenizer(checkpoint.open_checkpoint(folder))
    assert time.perf_counter() - start < 5


def test_an_index_of_too_many_shards_is_refused(tmp_path: Path) -> None:
    """An index naming 1.5 million shards took minutes at every open (each looked at three
    times) and ended in a 12 MB line; past MAX_SHARDS it is one short line, and missing
    shards are named eight at most."""
    from modeling.checkpoints.folder_files import MAX_SHARDS

    def index_of(count: int) -> Mutation:
        def mutate(folder: Path) -> None:
            shards = {f"t{i}": f"s{i}.safetensors" for i in range(count)}
            (folder / INDEX).write_text(json.dumps({"weight_map": shards}))

        return mutate

    folder = hostile_copy(tmp_path / "many", index_of(MAX_SHARDS + 1))
    with pytest.raises(CheckpointError, match=r"weight_map names 4,097 shard files; specd reads"):
        weight_files(folder)
    folder = hostile_copy(tmp_path / "missing", index_of(20))
    with pytest.raises(CheckpointError) as caught:
        weight_files(folder)
    assert (
        str(caught.value).endswith("s15.safetensors and 12 more") and len(str(caught.value)) < 400
    )


@pytest.mark.parametrize(
    "change",
    [
        lambda t: {**t, "model": {**t["model"], "continuing_subword_prefix": "##"}},
        lambda t: {**t, "normalizer": {"type": "Precompiled", "precompiled_charsmap": "/////w=="}},
    ],
    ids=["subword-prefix", "charsmap"],
)
@pytest.mark.usefixtures("quiet_home")
def test_a_tokenizer_the_library_panics_on_is_one_line(
    change: Callable[[Any], Any], tmp_path: Path
) -> None:
    """The `tokenizers` library panics on these (a Rust panic is no Exception): a traceback
    and exit 1, after the panic hook's own lines on stderr. Now one line naming the file,
    exit 2, in a real process (the hook's lines held back unless RUST_BACKTRACE asks)."""
    from tests.test_hostile_files import specd

    folder = hostile_copy(tmp_path, _edit(TOKENIZER, change))
    done = specd("plan", "--model", str(folder), env={"RUST_BACKTRACE": "0"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"specd: error: {folder / TOKENIZER}: not a tokenizer (")


def test_what_else_reaches_stderr_while_a_tokenizer_builds_is_kept() -> None:
    """The panic hook's lines are kept off stderr while a tokenizer builds; another
    thread's lines written meanwhile (a daemon's log) are written after, in order."""
    from modeling.errors import _without_panics

    written = (
        b"INFO one\n\nthread '<unnamed>' (6565) panicked at src/models/bpe/model.rs:267:23:\n"
        b"slice index starts at 3 but ends at 2\n"
        b"note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n"
        b"INFO two\n"
    )
    assert _without_panics(written) == b"INFO one\nINFO two\n"


def test_overlapping_quiet_windows_give_stderr_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """fd 2 is the process's: two threads' windows overlapping once left stderr pointed at
    /dev/null for good (the second saved the first's). One window at a time now."""
    import os
    import threading

    from modeling.errors import rust_quiet

    monkeypatch.setenv("RUST_BACKTRACE", "0")  # (set, the windows swap nothing)
    before = os.fstat(2)
    inside = threading.Event()

    def first() -> None:
        with rust_quiet():
            inside.set()
            time.sleep(0.1)

    def second() -> None:  # (opens while the first is open, closes after it)
        inside.wait(10)
        with rust_quiet():
            time.sleep(0.3)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
