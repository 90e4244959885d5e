"""Ollama and LM Studio stores, built in tmp_path as those apps lay them out: manifests and
content-addressed blobs for Ollama, publisher/repo folders of GGUF files for LM Studio.
The model files are real GGUFs from /work/shared/models/gguf."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest

from modeling.checkpoints import model_stores
from modeling.checkpoints.model_stores import (
    StoreError,
    gguf_file_type,
    list_store_models,
    resolve_store_ref,
)
from tests.conftest import SHARED_MODELS

GGUFS = SHARED_MODELS / "gguf"
Q4_0 = GGUFS / "stories260k-Q4_0.gguf"
Q8_0 = GGUFS / "llama-rand-256-Q8_0.gguf"
Q4_K_M = GGUFS / "llama-rand-256-Q4_K_M.gguf"
TEMPLATE = "{{ if .System }}<|system|>{{ .System }}{{ end }}<|user|>{{ .Prompt }}<|assistant|>"
PARAMS = {"stop": ["<|user|>", "<|end|>"], "temperature": 0.6}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty home; the Linux system service's store moved where the test decides."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("USERPROFILE", str(tmp_path / "home"))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.delenv("LMSTUDIO_MODELS", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(model_stores, "OLLAMA_SYSTEM_MODELS", tmp_path / "service" / "models")
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def blob(models: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (models / "blobs").mkdir(parents=True, exist_ok=True)
    (models / "blobs" / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}"


def pull(
    models: Path,
    name: str = "registry.ollama.ai/library/llama3.1/latest",
    gguf_file: Path = Q4_0,
    **texts: str,
) -> Path:
    """What `ollama pull` leaves: a manifest at manifests/<host>/<ns>/<model>/<tag> and its
    blobs. `texts`: media type suffix (template, params, system…) → layer content."""
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": "", "size": 0}]
    layers[0]["digest"] = blob(models, gguf_file.read_bytes())
    for kind, text in texts.items():
        media = f"application/vnd.ollama.image.{kind}"
        layers.append({"mediaType": media, "digest": blob(models, text.encode()), "size": 1})
    config = {"mediaType": "application/vnd.docker.container.image.v1+json"}
    manifest = models / "manifests" / name
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {**config, "digest": blob(models, b"{}"), "size": 2},
                "layers": layers,
            }
        )
    )
    return manifest


def model_blob(manifest: Path) -> Path:
    digest = json.loads(manifest.read_text())["layers"][0]["digest"]
    return manifest.parents[4] / "blobs" / digest.replace(":", "-")


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def test_a_ref_without_a_store_prefix_is_not_a_store_ref(home: Path) -> None:
    refs = ("meta-llama/Llama-3.1-8B-Instruct", "/models/x.gguf", "hf:a/b", "ollama", "lmstudio")
    for ref in refs:
        assert resolve_store_ref(ref) is None


def test_ollama_short_name_is_the_store_blob_with_template_params_and_system(
    home: Path, tmp_path: Path
) -> None:
    models = home / ".ollama" / "models"
    manifest = pull(models, template=TEMPLATE, params=json.dumps(PARAMS), system="Be brief.")
    before = files_under(tmp_path)
    model = resolve_store_ref("ollama:llama3.1")
    assert model is not None
    assert model.store == "ollama" and model.name == "llama3.1"
    assert model.path == model_blob(manifest)  # the blob itself: nothing copied
    assert files_under(tmp_path) == before
    assert model.template_text == TEMPLATE  # Go template text, kept as it is
    assert model.params == PARAMS and model.stop == ["<|user|>", "<|end|>"]
    assert model.system == "Be brief."


@pytest.mark.parametrize(
    ("ref", "stored_as"),
    [
        ("llama3.1:8b", "registry.ollama.ai/library/llama3.1/8b"),
        ("registry.ollama.ai/library/llama3.1:8b", "registry.ollama.ai/library/llama3.1/8b"),
        ("someone/tiny:q4", "registry.ollama.ai/someone/tiny/q4"),
        ("someone/tiny", "registry.ollama.ai/someone/tiny/latest"),
        ("hf.co/bartowski/Llama-3.2-1B-GGUF:Q4_K_M", "hf.co/bartowski/Llama-3.2-1B-GGUF/Q4_K_M"),
        ("localhost:5000/team/model:v1.2", "localhost:5000/team/model/v1.2"),
    ],
)
def test_ollama_names_are_completed_as_ollama_does(home: Path, ref: str, stored_as: str) -> None:
    manifest = pull(home / ".ollama" / "models", stored_as)
    model = resolve_store_ref(f"ollama:{ref}")
    assert model is not None and model.path == model_blob(manifest)
    assert model.template_text is None and model.params == {} and model.stop == []


def test_ollama_store_from_env_and_the_system_services_store(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = pull(model_stores.OLLAMA_SYSTEM_MODELS)
    model = resolve_store_ref("ollama:llama3.1")
    assert model is not None and model.path == model_blob(service)
    elsewhere = pull(tmp_path / "disk" / "ollama", gguf_file=Q8_0)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "disk" / "ollama"))
    model = resolve_store_ref("ollama:llama3.1")
    assert model is not None and model.path == model_blob(elsewhere)


def test_ollama_store_missing(home: Path) -> None:
    with pytest.raises(StoreError, match="no Ollama model store") as caught:
        resolve_store_ref("ollama:llama3.1")
    message = str(caught.value)
    assert str(home / ".ollama" / "models") in message
    assert str(model_stores.OLLAMA_SYSTEM_MODELS) in message
    assert "`ollama pull llama3.1`" in message and "OLLAMA_MODELS" in message
    assert isinstance(caught.value, FileNotFoundError)


def test_ollama_store_not_readable(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The system service's store is often mode 0750 (tests may run as root, so the
    permission is faked)."""
    pull(model_stores.OLLAMA_SYSTEM_MODELS)
    monkeypatch.setattr(model_stores.os, "access", lambda path, mode: False)
    with pytest.raises(StoreError) as caught:
        resolve_store_ref("ollama:llama3.1")
    assert f"{model_stores.OLLAMA_SYSTEM_MODELS} (not readable by this user)" in str(caught.value)


def test_ollama_model_not_pulled(home: Path) -> None:
    pull(home / ".ollama" / "models")
    with pytest.raises(StoreError) as caught:
        resolve_store_ref("ollama:qwen2.5:7b")
    message = str(caught.value)
    assert "manifests/registry.ollama.ai/library/qwen2.5/7b" in message
    assert str(home / ".ollama" / "models") in message
    assert "`ollama pull qwen2.5:7b`" in message


def test_ollama_missing_blob_names_digest_and_path(home: Path) -> None:
    manifest = pull(home / ".ollama" / "models", template=TEMPLATE)
    template = json.loads(manifest.read_text())["layers"][1]["digest"]
    template_blob = manifest.parents[4] / "blobs" / template.replace(":", "-")
    template_blob.unlink()
    with pytest.raises(StoreError) as caught:
        resolve_store_ref("ollama:llama3.1")
    assert template in str(caught.value) and str(template_blob) in str(caught.value)
    assert "ollama pull llama3.1" in str(caught.value)
    template_blob.write_text(TEMPLATE)
    model_blob(manifest).unlink()
    with pytest.raises(StoreError, match=re.escape(str(model_blob(manifest)))):
        resolve_store_ref("ollama:llama3.1")


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"schemaVersion": 2}',
        '{"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "md5:00"}]}',
        '{"layers": [{"digest": "sha256:' + "0" * 64 + '"}]}',
        '{"layers": "none"}',
    ],
)
def test_ollama_malformed_manifest(home: Path, text: str) -> None:
    manifest = pull(home / ".ollama" / "models")
    manifest.write_text(text)
    with pytest.raises(StoreError, match="malformed Ollama manifest") as caught:
        resolve_store_ref("ollama:llama3.1")
    assert str(manifest) in str(caught.value) and "ollama pull llama3.1" in str(caught.value)


def test_ollama_manifest_without_a_model_layer(home: Path) -> None:
    manifest = pull(home / ".ollama" / "models")
    layers = json.loads(manifest.read_text())
    layers["layers"] = []  # as a cloud model's manifest
    manifest.write_text(json.dumps(layers))
    with pytest.raises(StoreError, match="no GGUF model layer"):
        resolve_store_ref("ollama:llama3.1")


def test_ollama_params_that_are_not_json_and_a_blob_that_is_not_gguf(
    home: Path, tmp_path: Path
) -> None:
    pull(home / ".ollama" / "models", params="stop <|end|>")
    with pytest.raises(StoreError, match="params are not JSON"):
        resolve_store_ref("ollama:llama3.1")
    safetensors = tmp_path / "model.safetensors"
    safetensors.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    pull(home / ".ollama" / "models", gguf_file=safetensors)
    with pytest.raises(StoreError, match="not a GGUF file"):
        resolve_store_ref("ollama:llama3.1")


@pytest.mark.parametrize(
    "ref", ["../../etc/passwd", "a/b/c/d", "llama3.1:", ":8b", "-x", "ns.with.dots/model"]
)
def test_ollama_bad_names_do_not_touch_the_file_system(home: Path, ref: str) -> None:
    with pytest.raises(StoreError, match="not an Ollama model name"):
        resolve_store_ref(f"ollama:{ref}")


def lmstudio(root: Path, repo: str, *files: tuple[str, Path]) -> Path:
    folder = root / repo
    folder.mkdir(parents=True)
    for name, source in files:
        shutil.copyfile(source, folder / name)
    return folder


def test_lmstudio_resolution(home: Path, tmp_path: Path) -> None:
    root = home / ".lmstudio" / "models"
    folder = lmstudio(
        root,
        "lmstudio-community/Tiny-GGUF",
        ("Tiny-Q4_0.gguf", Q4_0),
        ("mmproj-Tiny-F16.gguf", Q8_0),  # a vision projector, not a second model
    )
    before = files_under(tmp_path)
    for ref in ("Tiny-GGUF", "Tiny-GGUF/Tiny-Q4_0.gguf", "Tiny-GGUF/Tiny-Q4_0"):
        model = resolve_store_ref(f"lmstudio:lmstudio-community/{ref}")
        assert model is not None and model.path == folder / "Tiny-Q4_0.gguf"
        assert model.store == "lmstudio" and model.template_text is None and model.stop == []
    assert files_under(tmp_path) == before


def test_lmstudio_several_ggufs_are_not_chosen_silently(home: Path) -> None:
    lmstudio(
        home / ".lmstudio" / "models",
        "bartowski/Llama-GGUF",
        ("Llama-Q4_K_M.gguf", Q4_K_M),
        ("Llama-Q8_0.gguf", Q8_0),
    )
    with pytest.raises(StoreError) as caught:
        resolve_store_ref("lmstudio:bartowski/Llama-GGUF")
    message = str(caught.value)
    assert "Llama-Q4_K_M.gguf, Llama-Q8_0.gguf" in message
    assert "lmstudio:bartowski/Llama-GGUF/FILE" in message
    model = resolve_store_ref("lmstudio:bartowski/Llama-GGUF/Llama-Q8_0.gguf")
    assert model is not None and model.path.name == "Llama-Q8_0.gguf"


def test_lmstudio_multi_part_ggufs_are_refused(home: Path) -> None:
    parts = [(f"Big-Q4_0-0000{i}-of-00002.gguf", Q4_0) for i in (1, 2)]
    lmstudio(home / ".lmstudio" / "models", "someone/Big-GGUF", *parts)
    for ref in ("someone/Big-GGUF", "someone/Big-GGUF/Big-Q4_0-00001-of-00002.gguf"):
        with pytest.raises(StoreError, match=r"multi-part GGUF.*llama-gguf-split --merge"):
            resolve_store_ref(f"lmstudio:{ref}")


def test_lmstudio_errors(home: Path) -> None:
    with pytest.raises(StoreError, match=r"LM Studio has no a/b in .*LMSTUDIO_MODELS") as caught:
        resolve_store_ref("lmstudio:a/b")
    assert str(home / ".lmstudio" / "models") in str(caught.value)
    assert str(home / ".cache" / "lm-studio" / "models") in str(caught.value)
    lmstudio(home / ".lmstudio" / "models", "a/b")
    with pytest.raises(StoreError, match="has no GGUF file"):
        resolve_store_ref("lmstudio:a/b")
    with pytest.raises(StoreError, match=re.escape("b/x.gguf does not exist")):
        resolve_store_ref("lmstudio:a/b/x")
    for ref in ("a", "a/b/c/d", "a/..", "../b", "a//c"):
        with pytest.raises(StoreError, match="is not an LM Studio model"):
            resolve_store_ref(f"lmstudio:{ref}")


def test_lmstudio_older_and_moved_folders(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    legacy = lmstudio(home / ".cache" / "lm-studio" / "models", "a/old", ("m.gguf", Q4_0))
    model = resolve_store_ref("lmstudio:a/old")
    assert model is not None and model.path == legacy / "m.gguf"
    pointed = lmstudio(tmp_path / "lms-home" / "models", "a/pointed", ("m.gguf", Q4_0))
    (home / ".lmstudio-home-pointer").write_text(f"{tmp_path / 'lms-home'}\n")
    model = resolve_store_ref("lmstudio:a/pointed")
    assert model is not None and model.path == pointed / "m.gguf"
    moved = lmstudio(tmp_path / "disk", "a/moved", ("m.gguf", Q4_0))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(tmp_path / "disk"))
    model = resolve_store_ref("lmstudio:a/moved")
    assert model is not None and model.path == moved / "m.gguf"


def test_listing_both_stores(home: Path) -> None:
    models = home / ".ollama" / "models"
    short = pull(models, "registry.ollama.ai/library/llama3.1/8b", Q8_0, template=TEMPLATE)
    pull(models, "registry.ollama.ai/someone/tiny/latest", Q4_0)
    pull(models, "hf.co/bartowski/Llama-GGUF/Q4_K_M", Q4_K_M)
    pull(models, "registry.ollama.ai/library/broken/latest").write_text("{")
    cloud = pull(models, "registry.ollama.ai/library/gpt-oss/120b-cloud")
    cloud.write_text(json.dumps({"schemaVersion": 2, "layers": []}))
    # Blobs are shared by content: the corrupt one is a file no other manifest uses.
    corrupt = pull(
        models, "registry.ollama.ai/library/corrupt/latest", GGUFS / "stories260k-F16.gguf"
    )
    model_blob(corrupt).write_bytes(Q4_0.read_bytes()[:100])
    folder = lmstudio(
        home / ".lmstudio" / "models",
        "lmstudio-community/Tiny-GGUF",
        ("Tiny-Q4_K_M.gguf", Q4_K_M),
        ("mmproj-Tiny-F16.gguf", Q4_0),
        ("Split-00001-of-00002.gguf", Q4_0),
    )
    found = {entry.name: entry for entry in list_store_models()}
    assert list(found) == sorted(found)
    assert {name: (e.store, e.size, e.file_type) for name, e in found.items()} == {
        "ollama:llama3.1:8b": ("ollama", Q8_0.stat().st_size, "Q8_0"),
        "ollama:someone/tiny:latest": ("ollama", Q4_0.stat().st_size, "Q4_0"),
        "ollama:hf.co/bartowski/Llama-GGUF:Q4_K_M": ("ollama", Q4_K_M.stat().st_size, "Q4_K_M"),
        "ollama:broken:latest": ("ollama", 0, "unreadable"),
        "ollama:corrupt:latest": ("ollama", 100, "unreadable"),
        "lmstudio:lmstudio-community/Tiny-GGUF/Tiny-Q4_K_M.gguf": (
            "lmstudio",
            Q4_K_M.stat().st_size,
            "Q4_K_M",
        ),
    }
    assert found["ollama:llama3.1:8b"].path == model_blob(short)
    assert found["lmstudio:lmstudio-community/Tiny-GGUF/Tiny-Q4_K_M.gguf"].path == (
        folder / "Tiny-Q4_K_M.gguf"
    )
    for name in found:  # every listed name resolves back to its entry, or says why not
        if found[name].file_type != "unreadable":
            model = resolve_store_ref(name)
            assert model is not None and model.path == found[name].path


def test_names_no_one_can_ask_for_are_not_listed_and_none_is_printed_raw(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest named with a terminal's escape sequences and a newline was listed as it
    is: it cleared the screen and forged a line of `specd models`, for a model --model
    cannot name. Such names are left out; an LM Studio folder's, which --model takes, is
    printed with its control characters escaped."""
    from daemon.cli.commands import main

    models = home / ".ollama" / "models"
    pull(models, "registry.ollama.ai/library/tiny/latest", Q4_0)
    pull(models, "registry.ollama.ai/library/\x1b[2Jfake\nollama:evil/latest", Q4_0)
    lmstudio(home / ".lmstudio" / "models", "pub/Odd\x1b]0;title\x07-GGUF", ("m.gguf", Q4_0))
    assert [e.name for e in list_store_models()] == [
        "lmstudio:pub/Odd\x1b]0;title\x07-GGUF/m.gguf",
        "ollama:tiny:latest",
    ]
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "lmstudio:pub/Odd\\x1b]0;title\\x07-GGUF/m.gguf" in out


def test_listing_with_no_stores_is_empty(home: Path) -> None:
    assert list_store_models() == []


def test_file_type_reads_the_metadata_only(tmp_path: Path) -> None:
    """A file cut right after its metadata still says its type: no tensor data is read."""
    for source in sorted(GGUFS.glob("*.gguf")):
        cut = tmp_path / source.name
        cut.write_bytes(source.read_bytes()[: gguf.GGUFReader(source).data_offset])
        reader = gguf.GGUFReader(source)
        expected = gguf.LlamaFileType(reader.fields["general.file_type"].contents()).name
        assert gguf_file_type(cut) == expected.removeprefix("MOSTLY_").removeprefix("ALL_")


def test_file_type_of_files_that_do_not_say_or_are_not_gguf(tmp_path: Path) -> None:
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    cases = {
        "no-key.gguf": b"GGUF" + struct.pack("<IQQ", 3, 0, 0),
        "empty.gguf": b"",
        "text.gguf": b"hello, world",
        "truncated.gguf": Q4_0.read_bytes()[:200],
        "huge-key.gguf": header + struct.pack("<Q", 2**60),
        "bad-type.gguf": header + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99),
        "v1.gguf": b"GGUF" + struct.pack("<IIIQ", 1, 0, 0, 0),
    }
    expected = {"no-key.gguf": None}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        assert gguf_file_type(tmp_path / name) == expected.get(name, "unreadable"), name


# ---- hostile stores (issue 32): nothing in a store may hang or stop the listing ----------


class Blocked(BaseException):
    """Raised in a test that blocked: not an OSError (TimeoutError is one), which the code
    under test may catch, nor an Exception."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Ends a block that runs past `seconds` (opening a FIFO waits for a writer forever)
    with Blocked, again every second, so that a caught one does not hang the test."""

    def blocked(signum: int, frame: Any) -> None:
        raise Blocked(f"still running after {seconds} s: blocked on a FIFO, or looping")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_fifo_is_never_opened(home: Path) -> None:
    with deadline(10):
        _fifo_checks(home)


def _fifo_checks(home: Path) -> None:
    models = home / ".ollama" / "models"
    manifest = pull(models)
    model_blob(manifest).unlink()
    os.mkfifo(model_blob(manifest))
    folder = lmstudio(home / ".lmstudio" / "models", "a/pipes", ("good.gguf", Q8_0))
    os.mkfifo(folder / "pipe.gguf")
    assert gguf_file_type(folder / "pipe.gguf") == "unreadable"
    found = {entry.name: entry for entry in list_store_models()}
    assert {name: entry.file_type for name, entry in found.items()} == {
        "ollama:llama3.1:latest": "unreadable",
        "lmstudio:a/pipes/good.gguf": "Q8_0",
        "lmstudio:a/pipes/pipe.gguf": "unreadable",
    }
    for name in ("ollama:llama3.1:latest", "lmstudio:a/pipes/pipe.gguf"):
        note = found[name].note
        assert note is not None and note.startswith(f"{found[name].path}: not a regular file")
    assert found["lmstudio:a/pipes/good.gguf"].note is None
    with pytest.raises(StoreError, match="is not a regular file"):
        resolve_store_ref("ollama:llama3.1")
    with pytest.raises(StoreError, match="not a regular file"):
        resolve_store_ref("lmstudio:a/pipes/pipe")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deep"),
        (" " * (model_stores.MAX_TEXT_BYTES + 1), "over 1,048,576 bytes"),
        ("\xff", "can't decode"),
    ],
)
def test_a_bad_manifest_is_one_entry_with_a_note(home: Path, text: str, why: str) -> None:
    """A deeply nested manifest (RecursionError in the JSON parser) made the listing empty."""
    models = home / ".ollama" / "models"
    pull(models, "registry.ollama.ai/library/good/latest", Q8_0)
    bad = pull(models, "registry.ollama.ai/library/bad/latest")
    bad.write_bytes(text.encode("latin-1"))
    found = {entry.name: entry for entry in list_store_models()}
    assert {name: entry.file_type for name, entry in found.items()} == {
        "ollama:bad:latest": "unreadable",
        "ollama:good:latest": "Q8_0",
    }
    note = found["ollama:bad:latest"].note
    assert note is not None and note.startswith(f"{bad}: malformed Ollama manifest")
    assert why in note and "\n" not in note
    with pytest.raises(StoreError, match="malformed Ollama manifest"):
        resolve_store_ref("ollama:bad")


def test_params_nested_too_deep_are_one_line(home: Path) -> None:
    pull(home / ".ollama" / "models", params="[" * 100_000 + "]" * 100_000)
    with pytest.raises(StoreError, match=r"Ollama params are not JSON \(nested too deep\)"):
        resolve_store_ref("ollama:llama3.1")


def test_file_type_of_hostile_files_is_unreadable_at_once(tmp_path: Path) -> None:
    """Counts past gguf_file's bounds are refused before they are looped over: 67M empty
    strings in a sparse file took a minute to walk."""
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
    cases = {
        "strings": header + struct.pack("<IIQ", 9, 8, 2**26),
        "keys": b"GGUF" + struct.pack("<IQQ", 3, 0, 2**40),
        "nested": header + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) * 40,
        "long-key": b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**40),
    }
    for name, head in cases.items():
        path = tmp_path / f"{name}.gguf"
        with path.open("wb") as f:
            f.write(head)
            f.truncate(2**31)  # sparse: 2 GiB of zeros that take no room
        start = time.perf_counter()
        assert gguf_file_type(path) == "unreadable", name
        assert time.perf_counter() - start < 1, name


@pytest.mark.parametrize(
    "stop", [{"a": [1, 2]}, None, [1], [""], ["x" * 1001], [f"s{i}" for i in range(65)]]
)
def test_ollama_stop_strings_are_strings(home: Path, stop: Any) -> None:
    """A params layer's `stop` of a dict or null became the stop strings "{'a': [1, 2]}" and
    "None", and 100,000 of them a megabyte warning at every start (an attacker found): a
    string or a list of up to 64 strings, else one line naming the file."""
    pull(home / ".ollama" / "models", params=json.dumps({"stop": stop}))
    with pytest.raises(StoreError, match=r"Ollama params' stop is .*; it must be a string"):
        resolve_store_ref("ollama:llama3.1")
    pull(home / ".ollama" / "models", params=json.dumps({"stop": "<|end|>"}))
    assert resolve_store_ref("ollama:llama3.1").stop == ["<|end|>"]
