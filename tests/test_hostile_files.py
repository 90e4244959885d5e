"""Hostile model files (issue 32): GGUF files whose counts, lengths, types and tensors lie,
built here in tmp_path from the shared stories260k-Q8_0.gguf (gguf-py's writer, or bytes
written by hand where the writer would refuse). `specd plan`, `specd generate` and `specd
serve` must answer each with one line on stderr naming the file and the field, exit status
2 and no traceback, before they allocate or loop over anything per count the file claims;
the store listing (`specd models`) must list the good entries and a note for each bad one.

Each real-process check runs `python -m daemon.cli` with a timeout, so that a regression
fails rather than hangs; the matrix of malformed fields runs `main()` in this process."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from daemon.cli.commands import main
from modeling.checkpoints.gguf_file import read_gguf
from tests.conftest import ROOT, SHARED_MODELS

SOURCE = SHARED_MODELS / "gguf" / "stories260k-Q8_0.gguf"
T = gguf.GGUFValueType
TIMEOUT = 60  # seconds for one real process: each answers in about 2


def rewrite(
    path: Path,
    changes: dict[str, tuple[Any, ...] | None] | None = None,
    tensors: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """SOURCE written again by gguf-py's writer: `changes` maps a key to (value, type) or
    (value, ARRAY, item type), or to None to leave it out; `tensors` are added, those
    named in `drop` left out (an array, or raw blocks and their ggml type)."""
    changes = changes or {}
    source, reader = read_gguf(SOURCE), gguf.GGUFReader(SOURCE)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changes:
            continue
        sub_type = field.types[-1] if field.types[0] == T.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, change in changes.items():
        if change is not None:
            value, value_type, *sub_type = change
            writer.add_key_value(key, value, value_type, sub_type=(sub_type or [None])[0])
    for info in source.tensors:
        if info.name in drop:
            continue
        stored = source.tensor_bytes(info).copy()
        if info.ggml_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(info.name, stored.view(np.float32).reshape(info.ne[::-1]))
        elif info.ggml_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(info.name, stored.view(np.float16).reshape(info.ne[::-1]))
        else:
            writer.add_tensor(
                info.name, stored, raw_dtype=gguf.GGMLQuantizationType(info.ggml_type)
            )
    for name, array in (tensors or {}).items():
        if isinstance(array, tuple):  # (raw blocks, their ggml type)
            writer.add_tensor(name, array[0], raw_dtype=array[1])
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def with_zero_dimension(path: Path, name: str) -> Path:
    """SOURCE with the last dimension of tensor `name` set to 0 in its tensor info."""
    data = bytearray(SOURCE.read_bytes())
    at = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<Q", data, at + 4 + 8 * (n_dims - 1), 0)
    path.write_bytes(data)
    return path


def sparse_array(path: Path, key: str, count: int, item_type: int = 8) -> Path:
    """A GGUF whose one key is an array of `count` zero-length strings (or zero numbers):
    a few KB on disk, the bytes it claims there as a sparse file's zeros."""
    name = key.encode()
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(name)) + name
    header += struct.pack("<IIQ", 9, item_type, count)
    with path.open("wb") as f:
        f.write(header)
        f.truncate(len(header) + 8 * count + 4096)
    return path


BROKEN = 17  # the token the long-piece file replaces


# (label, changes to SOURCE's metadata, the key or tensor its message must name)
MALFORMED: list[tuple[str, dict[str, tuple[Any, ...] | None], str]] = [
    ("zero layers", {"llama.block_count": (0, T.UINT32)}, "llama.block_count"),
    ("negative layers", {"llama.block_count": (-1, T.INT32)}, "llama.block_count"),
    ("layers as text", {"llama.block_count": ("5", T.STRING)}, "llama.block_count"),
    ("layers as a float", {"llama.block_count": (5.0, T.FLOAT32)}, "llama.block_count"),
    ("a billion layers", {"llama.block_count": (10**9, T.UINT32)}, "llama.block_count"),
    ("zero heads", {"llama.attention.head_count": (0, T.UINT32)}, "llama.attention.head_count"),
    (
        "zero kv heads",
        {"llama.attention.head_count_kv": (0, T.UINT32)},
        "llama.attention.head_count_kv",
    ),
    ("zero width", {"llama.embedding_length": (0, T.UINT32)}, "llama.embedding_length"),
    # (each ignored: the whole head turned, the values read as wide as the keys)
    (
        "half a head turned",
        {"llama.rope.dimension_count": (4, T.UINT32)},
        "llama.rope.dimension_count is 4, not llama.attention.key_length (8)",
    ),
    (
        "wider values",
        {"llama.attention.value_length": (16, T.UINT32)},
        "llama.attention.value_length is 16, not llama.attention.key_length (8)",
    ),
    ("a wrong width", {"llama.embedding_length": (65, T.UINT32)}, "llama.embedding_length"),
    (
        "epsilon as text",
        {"llama.attention.layer_norm_rms_epsilon": ("tiny", T.STRING)},
        "llama.attention.layer_norm_rms_epsilon",
    ),
    ("negative context", {"llama.context_length": (-5, T.INT32)}, "llama.context_length"),
    (
        "rope base as text",
        {"llama.rope.freq_base": ("10000", T.STRING)},
        "llama.rope.freq_base",
    ),
    # (0: every frequency inf or NaN, every answer token 0)
    ("rope base zero", {"llama.rope.freq_base": (0.0, T.FLOAT32)}, "llama.rope.freq_base"),
    (
        "every token empty",  # (a text is then no tokens: a division by 0 at admission)
        {"tokenizer.ggml.tokens": ([""] * 512, T.ARRAY, T.STRING)},
        "tokenizer.ggml.tokens",
    ),
    (
        "rope factor as text",
        {
            "llama.rope.scaling.type": ("linear", T.STRING),
            "llama.rope.scaling.factor": ("4", T.STRING),
        },
        "llama.rope.scaling.factor",
    ),
    (
        "tokens as numbers",
        {"tokenizer.ggml.tokens": (list(range(512)), T.ARRAY, T.INT32)},
        "tokenizer.ggml.tokens",
    ),
    (
        "scores as text",
        {"tokenizer.ggml.scores": (["0.5"] * 512, T.ARRAY, T.STRING)},
        "tokenizer.ggml.scores",
    ),
    (
        "token types as text",
        {"tokenizer.ggml.token_type": (["1"] * 512, T.ARRAY, T.STRING)},
        "tokenizer.ggml.token_type",
    ),
    (
        "token types as floats",
        {"tokenizer.ggml.token_type": ([1.0] * 512, T.ARRAY, T.FLOAT32)},
        "tokenizer.ggml.token_type",
    ),
    (
        "bos past the vocabulary",
        {"tokenizer.ggml.bos_token_id": (512, T.UINT32)},
        "tokenizer.ggml.bos_token_id",
    ),
    (
        "eos as text",
        {"tokenizer.ggml.eos_token_id": ("2", T.STRING)},
        "tokenizer.ggml.eos_token_id",
    ),
    (
        "add_bos as text",
        {"tokenizer.ggml.add_bos_token": ("yes", T.STRING)},
        "tokenizer.ggml.add_bos_token",
    ),
    (
        "chat template as a number",
        {"tokenizer.chat_template": (5, T.INT32)},
        "tokenizer.chat_template",
    ),
    ("architecture as a number", {"general.architecture": (5, T.UINT32)}, "architecture 5"),
    (
        "experts stated, none stored",  # (a traceback from the plan's footprint)
        {"llama.expert_count": (8, T.UINT32), "llama.expert_used_count": (2, T.UINT32)},
        "llama.expert_count is 8, but the file holds no expert tensors",
    ),
    (
        "a template that does not compile",  # (plan said OK where generate refused)
        {"tokenizer.chat_template": ("{% if %}", T.STRING)},
        "tokenizer.chat_template, the model's chat template, does not compile",
    ),
]


@pytest.fixture(scope="module")
def malformed_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Every file of MALFORMED, and a stray layer, a zero dimension, a 300k-character token
    and a sparse file claiming 67M strings: label → (path, what its message names)."""
    folder = tmp_path_factory.mktemp("malformed")
    files = {
        label: (rewrite(folder / f"{i:02}.gguf", changes), named)
        for i, (label, changes, named) in enumerate(MALFORMED)
    }
    stray = {"blk.99.attn_norm.weight": np.ones(64, dtype=np.float32)}
    files["a stray layer"] = (rewrite(folder / "stray.gguf", tensors=stray), "blk.99")
    # (`blk.01` was read as layer 1 and crashed the quantized loader with a traceback; a
    # Unicode digit too)
    for label, name in (("layer 01", "blk.01.attn_q.weight"), ("layer ١", "blk.١.attn_q.weight")):
        q = read_gguf(SOURCE)
        named = q.tensor_bytes(q.tensors_by_name["blk.1.attn_q.weight"]).copy()
        odd = {name: (named, gguf.GGMLQuantizationType.Q8_0)}
        files[f"a {label}"] = (
            rewrite(folder / f"{label}.gguf", tensors=odd),
            f"unexpected tensor {name}",
        )
    # (plan said OK: only loading looked at the tensors, now their infos are checked first)
    files["a missing tensor"] = (
        rewrite(folder / "missing.gguf", drop=("blk.1.attn_q.weight",)),
        "missing tensors: layers.1.",
    )
    files["a zero dimension"] = (
        with_zero_dimension(folder / "zero-dim.gguf", "blk.1.ffn_up.weight"),
        "tensor blk.1.ffn_up.weight has a dimension of 0",
    )
    long_piece = read_gguf(SOURCE).metadata["tokenizer.ggml.tokens"]
    long_piece[BROKEN] = "a" * 300_000
    files["a 300k-character token"] = (
        rewrite(
            folder / "long-piece.gguf",
            {"tokenizer.ggml.tokens": (long_piece, T.ARRAY, T.STRING)},
        ),
        f"tokenizer.ggml.tokens[{BROKEN}] is 300,000 characters long",
    )
    # (a token list shorter than the embedding loaded, and the model's writing past it read
    # as nothing: empty answers, no error)
    meta = read_gguf(SOURCE).metadata
    cut = {
        key: (meta[key][:259], T.ARRAY, kind)
        for key, kind in (
            ("tokenizer.ggml.tokens", T.STRING),
            ("tokenizer.ggml.scores", T.FLOAT32),
            ("tokenizer.ggml.token_type", T.INT32),
        )
    }
    files["a short token list"] = (
        rewrite(folder / "short-vocab.gguf", cut),
        "tokenizer.ggml.tokens holds 259 tokens but token_embd.weight has 512 rows",
    )
    for label, value in (("zero", 0.0), ("NaN", float("nan"))):  # (Llama 3.1's divisors)
        divisors = {"rope_freqs.weight": np.full(4, value, dtype=np.float32)}
        files[f"{label} RoPE divisors"] = (
            rewrite(folder / f"rope-{label}.gguf", tensors=divisors),
            "rope_freqs.weight: holds a value that is not a finite number above 0",
        )
    files["67M empty strings"] = (
        sparse_array(folder / "sparse.gguf", "tokenizer.ggml.tokens", 2**26),
        "tokenizer.ggml.tokens claims 67,108,864 items",
    )
    return files


# The reported attacks that made specd run on and on: checked in real processes only.
HANGS = ("a billion layers", "a 300k-character token", "67M empty strings")
COMMANDS = {
    "plan": ["plan", "--model", "{}"],
    "generate": ["generate", "--model", "{}", "--prompt", "Once", "--max-tokens", "2"],
    "serve": ["serve", "--model", "{}", "--port", "0"],
}


@pytest.fixture
def quiet_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No user config file (platformdirs reads XDG_CONFIG_HOME), no model stores, no hub
    cache of the user's."""
    for name in ("HOME", "XDG_CONFIG_HOME", "HF_HOME"):
        monkeypatch.setenv(name, str(tmp_path / "home"))
    for name in ("OLLAMA_MODELS", "LMSTUDIO_MODELS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "home"


def test_the_source_file_plans_and_generates(quiet_home: Path, capsys: Any) -> None:
    """What the malformed files are made from is itself fine, rewritten as they are."""
    path = rewrite(quiet_home.parent / "same.gguf")
    assert main(["plan", "--model", str(path)]) == 0
    assert main([c.format(path) for c in COMMANDS["generate"]]) == 0
    capsys.readouterr()


def test_a_tokenizer_specd_cannot_build_is_refused_by_plan_as_by_loading(
    quiet_home: Path, capsys: Any
) -> None:
    """Well-formed but unsupported (another kind of tokenizer): `specd plan` refuses it in
    the one line generation does (issue 34: a plan for a file that cannot run misleads)."""
    path = rewrite(quiet_home.parent / "rwkv.gguf", {"tokenizer.ggml.model": ("rwkv", T.STRING)})
    said = []
    for command in (["plan", "--model", str(path)], [c.format(path) for c in COMMANDS["generate"]]):
        assert main(command) == 2
        said.append(capsys.readouterr().err)
    assert "tokenizer.ggml.model is 'rwkv'; specd builds" in said[0]
    assert said[0] == said[1]


def test_a_merge_outside_the_vocabulary_is_refused_by_plan_as_by_loading(
    quiet_home: Path, capsys: Any
) -> None:
    """A byte-level (gpt2) file whose merges name a token its vocabulary lacks: only
    building the tokenizer finds it, which `specd plan` now does as loading does (it said
    OK, and generate refused)."""
    from tests.test_gguf_tokenizer import train_byte_level

    tokens, merges = train_byte_level()
    rows = len(read_gguf(SOURCE).metadata["tokenizer.ggml.tokens"])  # the embedding's 512
    tokens = tokens[:rows]
    kept = [m for m in merges if "".join(m.split(" ")) in set(tokens)]

    def gpt2(name: str, merges: list[str]) -> Path:
        return rewrite(
            quiet_home.parent / name,
            {
                "tokenizer.ggml.model": ("gpt2", T.STRING),
                "tokenizer.ggml.pre": ("gpt2", T.STRING),
                "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
                "tokenizer.ggml.merges": (merges, T.ARRAY, T.STRING),
                "tokenizer.ggml.scores": None,
            },
        )

    assert main(["plan", "--model", str(gpt2("fine.gguf", kept))]) == 0
    capsys.readouterr()
    path = gpt2("bad-merges.gguf", ["zzz qqq", *kept])
    said = []
    for command in (["plan", "--model", str(path)], [c.format(path) for c in COMMANDS["generate"]]):
        assert main(command) == 2
        said.append(capsys.readouterr().err)
    assert said[0].startswith(f"specd: error: {path}: the tokenizer.ggml.* keys do not make")
    assert "out of vocabulary" in said[0] and said[0].count("\n") == 1
    assert said[0] == said[1]


def test_specd_models_says_which_files_cannot_run(
    quiet_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A store's file that `--model` would refuse is listed with the reason on its row
    (issue 34: the listing showed no sign that a file cannot run)."""
    from tests.test_model_stores import pull

    store = quiet_home.parent / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    rwkv = rewrite(quiet_home.parent / "rwkv.gguf", {"tokenizer.ggml.model": ("rwkv", T.STRING)})
    pull(store, "registry.ollama.ai/library/rwkv/latest", rwkv)
    pull(store, "registry.ollama.ai/library/tiny/latest", rewrite(quiet_home.parent / "ok.gguf"))
    assert main(["models", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert listed["ollama:tiny:latest"]["runs"] and listed["ollama:tiny:latest"]["why"] is None
    assert not listed["ollama:rwkv:latest"]["runs"]
    assert listed["ollama:rwkv:latest"]["why"].startswith("tokenizer.ggml.model is 'rwkv'")
    assert main(["models"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert any("specd cannot run it: tokenizer.ggml.model is 'rwkv'" in row for row in rows)
    assert sum("cannot run" in row for row in rows) == 1


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_malformed_field_is_one_line_naming_the_file_and_the_field(
    command: str,
    malformed_files: dict[str, tuple[Path, str]],
    quiet_home: Path,
    capsys: Any,
) -> None:
    for label, (path, named) in malformed_files.items():
        if label in HANGS:
            continue  # in a real process with a timeout, below: a regression would hang here
        start = time.perf_counter()
        status = main([part.format(path) for part in COMMANDS[command]])
        seconds = time.perf_counter() - start
        err = capsys.readouterr().err
        assert status == 2, (label, err)
        assert err.count("\n") == 1 and err.startswith(f"specd: error: {path}: "), (label, err)
        assert named in err, (label, err)
        assert seconds < 5, (label, seconds)  # refused from the header, not after a loop


@pytest.mark.parametrize("missing", ["../no-such/stories26k", "no-such/x.gguf", "/no/such"])
def test_a_missing_path_is_refused_before_the_daemon_listens(
    missing: str, quiet_home: Path, capsys: Any
) -> None:
    """A path (no hub id can be one) that is not there: `specd serve` said "listening" and
    then logged the failure twice; now it is one line before it listens, as plan says."""
    for command in ("serve", "plan"):
        assert main([part.format(missing) for part in COMMANDS[command]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("does not exist" in err or "not found" in err), err
        assert "listening" not in err


@pytest.mark.parametrize(
    "reference", ["/tmp/" + "a" * 300, "a" * 300 + ".gguf", "ollama:" + "a" * 300]
)
def test_a_name_past_the_file_systems_length_is_one_line(
    reference: str, quiet_home: Path, capsys: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """A path with a name over 255 bytes: Python's path checks raise for this one error
    (ENAMETOOLONG) where they answer "not there" for the others, and it was a traceback."""
    store = tmp_path / "ollama"
    (store / "manifests" / "registry.ollama.ai" / "library").mkdir(parents=True)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    for command in ("serve", "plan", "generate"):
        assert main([part.format(reference) for part in COMMANDS[command]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("specd: error: "), err
        assert "does not exist" in err or "not found" in err or "too long" in err, err


def specd(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`specd ARGV` as a user runs it, in its own process, ended after TIMEOUT seconds."""
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


REAL_RUNS = [(command, label) for command in COMMANDS for label in (*HANGS, "scores as text")]


@pytest.mark.parametrize(("command", "label"), REAL_RUNS)
def test_a_real_process_answers_in_one_line_and_exit_2(
    command: str, label: str, malformed_files: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    """The reported attacks, as the command line meets them: before, `plan` and
    `generate` never answered on a billion layers (growing ~40 MB/s), took 57 s and 1.26 GB
    to refuse 67M empty strings and had no answer in 60 s on a 300k-character token; scores
    as text were a traceback, and `serve` exited 2 without naming the file."""
    path, named = malformed_files[label]
    home = str(tmp_path / "home")
    env = {"HOME": home, "XDG_CONFIG_HOME": home, "HF_HOME": home, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = specd(*[part.format(path) for part in COMMANDS[command]], env=env)
    seconds = time.perf_counter() - start
    print(f"specd {command} on {label}: exit {done.returncode} in {seconds:.1f} s")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"specd: error: {path}: ")
    assert named in done.stderr
    assert seconds < 30  # ~1.5 s: the start-up; refusing the file itself is milliseconds


# Each file of a Hugging Face folder, with the command that first opens it.
FOLDER_FILES = [
    ("config.json", "plan"),
    ("generation_config.json", "plan"),
    ("tokenizer.json", "generate"),
    ("tokenizer_config.json", "generate"),
    ("model.safetensors", "generate"),
]


@pytest.mark.parametrize(("name", "command"), FOLDER_FILES)
def test_a_fifo_in_a_model_folder_is_refused_at_once(
    name: str, command: str, tmp_path: Path
) -> None:
    """Before, a FIFO for the weights blocked `generate` forever on opening it; one for
    config.json was "no config.json", and the other JSON files were passed over as absent."""
    folder = tmp_path / "stories260k"
    shutil.copytree(SHARED_MODELS / "stories260k", folder)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    home = str(tmp_path / "home")
    env = {"HOME": home, "XDG_CONFIG_HOME": home, "HF_HOME": home, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = specd(*[part.format(folder) for part in COMMANDS[command]], env=env)
    seconds = time.perf_counter() - start
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr == (
        f"specd: error: {folder / name}: not a regular file (a FIFO, a device or a folder); "
        "specd reads a model's files only from regular files\n"
    )
    assert seconds < 30  # ~1.5 s: the start-up


# ---- the model stores ----------------------------------------------------------------


def _blob(models: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (models / "blobs").mkdir(parents=True, exist_ok=True)
    (models / "blobs" / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}"


def _manifest(models: Path, name: str, layers: list[dict[str, Any]]) -> Path:
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return manifest


@pytest.fixture
def hostile_stores(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """An Ollama store with a good model, a FIFO blob and a manifest nested 100,000 deep,
    an LM Studio store with a good file and a FIFO named like a GGUF, and a Hugging Face
    cache whose one snapshot has a FIFO for its config.json."""
    ollama, lmstudio, hub = tmp_path / "ollama", tmp_path / "lmstudio", tmp_path / "hub"
    model = "application/vnd.ollama.image.model"
    good = _blob(ollama, SOURCE.read_bytes())
    _manifest(ollama, "good", [{"mediaType": model, "digest": good}])
    fifo_digest = "sha256:" + "f" * 64
    _manifest(ollama, "fifo", [{"mediaType": model, "digest": fifo_digest}])
    os.mkfifo(ollama / "blobs" / f"sha256-{'f' * 64}")
    deep = _manifest(ollama, "deep", [])
    deep.write_text("[" * 100_000 + "]" * 100_000)
    folder = lmstudio / "someone" / "Tiny-GGUF"
    folder.mkdir(parents=True)
    (folder / "tiny-Q8_0.gguf").write_bytes(SOURCE.read_bytes())
    os.mkfifo(folder / "pipe-Q4_0.gguf")
    repo = hub / "models--someone--piped"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    os.mkfifo(repo / "snapshots" / "abc" / "config.json")
    # refs the hub library's scan read whole: a FIFO (it hung), /dev/zero (memory filled);
    # and a dangling link among a repository's snapshots (it hid the repository)
    for name, make in (("fiforef", os.mkfifo), ("zeroref", lambda p: p.symlink_to("/dev/zero"))):
        repo = hub / f"models--someone--{name}"
        (repo / "snapshots" / "abc").mkdir(parents=True)
        (repo / "refs").mkdir()
        make(repo / "refs" / "main")
    (hub / "models--someone--fiforef" / "snapshots" / "gone").symlink_to(tmp_path / "nowhere")
    yield {"ollama": ollama, "lmstudio": lmstudio, "hub": hub}


def test_models_lists_the_good_entries_and_a_note_for_each_bad_one(
    hostile_stores: dict[str, Path], tmp_path: Path
) -> None:
    """Before: a FIFO as a blob, as an LM Studio file, as a cached config.json or as a
    cache's ref hung `specd models` forever, and one deeply nested manifest made it list
    nothing."""
    home = str(tmp_path / "home")
    env = {
        "OLLAMA_MODELS": str(hostile_stores["ollama"]),
        "LMSTUDIO_MODELS": str(hostile_stores["lmstudio"]),
        "HOME": home,
        "HF_HUB_CACHE": str(hostile_stores["hub"]),
    }
    done = specd("models", "--json", env=env)
    assert done.returncode == 0, done.stderr
    listed = {row["name"]: row for row in json.loads(done.stdout)}
    assert {name: row["type"] for name, row in listed.items()} == {
        "ollama:good:latest": "Q8_0",
        "ollama:fifo:latest": "unreadable",
        "ollama:deep:latest": "unreadable",
        "lmstudio:someone/Tiny-GGUF/tiny-Q8_0.gguf": "Q8_0",
        "lmstudio:someone/Tiny-GGUF/pipe-Q4_0.gguf": "unreadable",
        "someone/piped": "no config.json",
        "someone/fiforef": "no config.json",
        "someone/zeroref": "no config.json",
    }
    notes = done.stderr.splitlines()
    assert len(notes) == 3 and all(line.startswith("specd: note: ") for line in notes)
    by_name = {name: note for name in listed for note in notes if f" {name}: " in note}
    assert "not a regular file" in by_name["ollama:fifo:latest"]
    assert "not a regular file" in by_name["lmstudio:someone/Tiny-GGUF/pipe-Q4_0.gguf"]
    assert "malformed Ollama manifest (nested too deep)" in by_name["ollama:deep:latest"]
    assert listed["ollama:good:latest"]["note"] is None
    # The text listing says the same, and resolving a bad entry is one line too.
    assert specd("models", env=env).stderr.splitlines() == notes
    failed = specd("plan", "--model", "ollama:fifo", env=env)
    assert failed.returncode == 2 and failed.stderr.count("\n") == 1, failed.stderr
    assert "not a regular file" in failed.stderr


def test_an_error_line_is_cut_to_a_readable_length(
    tmp_path: Path, quiet_home: Path, capsys: Any
) -> None:
    """A message holding what a file made it hold (400,000 unexpected tensor names were a
    3.5 MB line) is one line of at most MAX_ERROR_CHARS and the words it was cut by."""
    from daemon.cli.commands import MAX_ERROR_CHARS, one_line

    assert one_line("a\nb") == "a b" and one_line("x" * 10) == "x" * 10
    assert one_line("a\x1b[2Jb") == "a\\x1b[2Jb"  # (a terminal sequence from a file)
    long = one_line("head " + "n" * 100_000 + " tail")
    assert long.startswith("head ") and long.endswith(" tail") and "characters left out" in long
    assert len(long) < MAX_ERROR_CHARS + 60
    import safetensors.torch
    import torch

    folder = tmp_path / "model"
    shutil.copytree(SHARED_MODELS / "stories260k", folder)
    weights = folder / "model.safetensors"
    weights.chmod(0o644)
    tensors = safetensors.torch.load_file(weights)
    tensors.update({f"x{i}": torch.zeros(1) for i in range(3000)})
    safetensors.torch.save_file(tensors, weights)
    argv = ["generate", "--model", str(folder), "--draft", "none", "--max-tokens", "1"]
    assert main([*argv, "--prompt", "Once"]) == 2
    err = capsys.readouterr().err
    assert "unexpected tensors" in err and "characters left out" in err, err[:300]
    assert err.count("\n") == 1 and len(err) < MAX_ERROR_CHARS + 80, len(err)


def test_rope_divisors_of_one_change_nothing(tmp_path: Path, quiet_home: Path) -> None:
    """Llama 3.1's `rope_freqs` divisors are read at open (checked: finite, above 0) and
    applied: divisors of one give the file's own greedy answer, of four another."""
    from daemon.options import RuntimeOptions
    from daemon.runtime import Runtime
    from speculative.sampling import SamplingParams

    ones = {"rope_freqs.weight": np.ones(4, dtype=np.float32)}
    fours = {"rope_freqs.weight": np.full(4, 4.0, dtype=np.float32)}
    texts = []
    for path in (
        SOURCE,
        rewrite(tmp_path / "ones.gguf", tensors=ones),
        rewrite(tmp_path / "fours.gguf", tensors=fours),
    ):
        runtime = Runtime(RuntimeOptions(model=str(path), device="cpu"))
        ids = runtime.tokenizer.encode("Once upon a time")
        greedy = SamplingParams(temperature=0.0)
        texts.append(runtime.generation(ids, greedy, 12, strategy="autoregressive").run().text)
    assert texts[0] == texts[1] and texts[0]
    assert texts[2] != texts[0]  # (and they are applied: slower rotations, another text)
