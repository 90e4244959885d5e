"""GGUF models from the stores desktop users already have: Ollama's and LM Studio's.

`ollama:NAME[:TAG]` and `lmstudio:PUBLISHER/REPO[/FILE]` resolve to the store's own file,
never a copy, with what the store says about it (Ollama's Go template, params, system
prompt). Pure path and JSON logic, no torch: errors are `StoreError`, a
`FileNotFoundError` that the loader maps to checkpoint's `ModelNotFoundError`.

Where the stores live:
- Ollama: `$OLLAMA_MODELS`, else `~/.ollama/models` (macOS, Windows, `ollama serve` run by
  the user), and on Linux also `/usr/share/ollama/.ollama/models` (the system service's).
  `<models>/manifests/<host>/<namespace>/<model>/<tag>` is a Docker distribution v2
  manifest whose layers are blobs at `<models>/blobs/sha256-<hex>`.
- LM Studio: `$LMSTUDIO_MODELS` (specd's own override, not LM Studio's), else `models/`
  in LM Studio's home (`~/.lmstudio`, or the folder `~/.lmstudio-home-pointer` names, as
  LM Studio's `lms` finds it), and the pre-0.3 `~/.cache/lm-studio/models`. Files are
  `<root>/<publisher>/<repo>/<file>.gguf`.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"
# The Linux installer's system service runs as the `ollama` user, whose home this is.
OLLAMA_SYSTEM_MODELS = Path("/usr/share/ollama/.ollama/models")
_MODEL = "application/vnd.ollama.image.model"
# `prompt`: the template's media type in older manifests (Ollama reads both).
_TEMPLATES = ("application/vnd.ollama.image.template", "application/vnd.ollama.image.prompt")
_PARAMS = "application/vnd.ollama.image.params"
_SYSTEM = "application/vnd.ollama.image.system"
_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")
# Ollama's name parts: a letter, digit or underscore, then those, '-' and '.' (and ':' for
# a host's port). This also keeps a name from walking out of the store ("..", "/").
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_HOST_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
UNREADABLE = "unreadable"

Layer = tuple[str, Path]  # (digest, blob path)


class StoreError(FileNotFoundError):
    """A store reference that cannot be served: the store, the model or one of its files
    is missing or malformed. The message names the file and what to do."""


@dataclass(frozen=True)
class StoreModel:
    path: Path  # the GGUF itself: Ollama's blob or LM Studio's file
    store: str  # "ollama" | "lmstudio"
    name: str  # as typed after the prefix, e.g. "llama3.1:8b"
    template_text: str | None = None  # Ollama's Go template (not Jinja), kept as text
    params: dict[str, Any] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    system: str | None = None


@dataclass(frozen=True)
class StoreEntry:
    name: str  # as the user would type it, prefix included: "ollama:llama3.1:8b"
    store: str
    path: Path
    size: int  # bytes
    file_type: str | None  # "Q4_K_M", "F16"…; None if the file doesn't say; UNREADABLE


def resolve_store_ref(ref: str) -> StoreModel | None:
    """The model a store reference names; None when `ref` has no store prefix."""
    store, sep, name = ref.partition(":")
    if sep and store == "ollama":
        return _resolve_ollama(name)
    return _resolve_lmstudio(name) if sep and store == "lmstudio" else None


def list_store_models() -> list[StoreEntry]:
    """Every model in both stores, by name. A broken one is listed as UNREADABLE (resolving
    it says what is wrong); models with no local GGUF (cloud models) and multi-part GGUFs
    are left out."""
    entries: list[StoreEntry] = []
    for root in _existing(ollama_roots()):
        manifests = root / "manifests"
        for manifest in sorted(p for p in manifests.glob("*/*/*/*") if p.is_file()):
            host, namespace, model, tag = manifest.relative_to(manifests).parts
            # The shortest name that finds this manifest again, as Ollama shows it.
            if host.lower() != OLLAMA_HOST:
                name = f"{host}/{namespace}/{model}:{tag}"
            elif namespace.lower() != OLLAMA_NAMESPACE:
                name = f"{namespace}/{model}:{tag}"
            else:
                name = f"{model}:{tag}"
            try:
                blob = _ollama_layers(root, manifest, name).get(_MODEL)
            except StoreError:
                entries.append(StoreEntry(f"ollama:{name}", "ollama", manifest, 0, UNREADABLE))
                continue
            if blob is not None:
                entries.append(_entry(f"ollama:{name}", "ollama", blob[1]))
    for root in _existing(lmstudio_roots()):
        for path in sorted(root.glob("*/*/*.gguf")):
            if not _is_projector(path) and not _SPLIT_GGUF.search(path.name):
                entries.append(
                    _entry(f"lmstudio:{path.relative_to(root).as_posix()}", "lmstudio", path)
                )
    return sorted(entries, key=lambda e: e.name)


def ollama_roots() -> list[Path]:
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    roots = [Path.home() / ".ollama" / "models"]
    return [*roots, OLLAMA_SYSTEM_MODELS] if sys.platform.startswith("linux") else roots


def lmstudio_roots() -> list[Path]:
    if os.environ.get("LMSTUDIO_MODELS"):
        return [Path(os.environ["LMSTUDIO_MODELS"]).expanduser()]
    home, pointer = Path.home() / ".lmstudio", Path.home() / ".lmstudio-home-pointer"
    if pointer.is_file():
        home = Path(pointer.read_text(encoding="utf-8").strip())
    legacy = Path.home() / ".cache" / "lm-studio" / "models"
    return [home / "models"] if home / "models" == legacy else [home / "models", legacy]


def _resolve_ollama(name: str) -> StoreModel:
    host, namespace, model, tag = _ollama_name(name)
    roots = ollama_roots()
    existing = _existing(roots)
    if not existing:
        raise StoreError(
            f"no Ollama model store in {_paths(roots)}: install Ollama and run "
            f"`ollama pull {name}`, or set OLLAMA_MODELS to its models folder"
        )
    relative = Path("manifests", host, namespace, model, tag)
    root = next((r for r in existing if (r / relative).is_file()), None)
    if root is None:
        raise StoreError(
            f"Ollama has no model {name!r} (no {relative.as_posix()} in {_paths(existing)}): "
            f"run `ollama pull {name}`"
        )
    layers = _ollama_layers(root, root / relative, name)
    if _MODEL not in layers:
        raise StoreError(
            f"Ollama model {name!r} ({root / relative}) has no GGUF model layer (a cloud "
            f"model?): specd runs local GGUF models"
        )
    template = next((_text(layers[m], name) for m in _TEMPLATES if m in layers), None)
    params: Any = {}
    if _PARAMS in layers:
        try:
            params = json.loads(_text(layers[_PARAMS], name))
        except ValueError as exc:
            raise StoreError(f"{layers[_PARAMS][1]}: Ollama params are not JSON ({exc})") from exc
        if not isinstance(params, dict):
            raise StoreError(f"{layers[_PARAMS][1]}: Ollama params are not a JSON object")
    stop = params.get("stop", [])
    return StoreModel(
        path=_gguf(_blob(layers[_MODEL], name)),
        store="ollama",
        name=name,
        template_text=template,
        params=params,
        stop=[str(s) for s in (stop if isinstance(stop, list) else [stop])],
        system=_text(layers[_SYSTEM], name) if _SYSTEM in layers else None,
    )


def _ollama_name(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) as Ollama completes a name: `llama3.1` is
    registry.ollama.ai/library/llama3.1:latest. A ':' after the last '/' starts the tag."""
    text, tag = name, OLLAMA_TAG
    if name.rfind(":") > name.rfind("/"):
        text, tag = name.rsplit(":", 1)
    parts = text.split("/")
    full = [OLLAMA_HOST, OLLAMA_NAMESPACE][: max(0, 3 - len(parts))] + parts + [tag]
    names_ok = len(full) == 4 and all(_NAME_PART.fullmatch(part) for part in full[1:])
    if not names_ok or "." in full[1] or not _HOST_PART.fullmatch(full[0]):
        raise StoreError(
            f"{name!r} is not an Ollama model name: give NAME[:TAG], NAMESPACE/NAME[:TAG] "
            f"or HOST/NAMESPACE/NAME[:TAG], e.g. ollama:llama3.1:8b"
        )
    host, namespace, model, tag = full
    return host, namespace, model, tag


def _ollama_layers(root: Path, manifest: Path, name: str) -> dict[str, Layer]:
    """mediaType → (digest, blob path), unchecked. A media type given twice keeps the last
    layer, as Ollama does."""
    try:
        found: dict[str, Layer] = {}
        for layer in json.loads(manifest.read_text(encoding="utf-8"))["layers"]:
            match = _DIGEST.fullmatch(layer["digest"])
            if not isinstance(layer["mediaType"], str) or match is None:
                raise ValueError(f"bad layer {layer}")
            found[layer["mediaType"]] = (layer["digest"], root / "blobs" / f"sha256-{match[1]}")
        return found
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(
            f"{manifest}: malformed Ollama manifest ({exc}): run `ollama pull {name}` again"
        ) from exc


def _blob(layer: Layer, name: str) -> Path:
    if not layer[1].is_file():
        raise StoreError(
            f"Ollama model {name!r}: blob {layer[0]} is missing ({layer[1]}): "
            f"run `ollama pull {name}` again"
        )
    return layer[1]


def _text(layer: Layer, name: str) -> str:
    path = _blob(layer, name)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: cannot read Ollama layer {layer[0]} ({exc})") from exc


def _resolve_lmstudio(name: str) -> StoreModel:
    parts = name.split("/")
    if len(parts) not in (2, 3) or any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise StoreError(f"{name!r} is not an LM Studio model: give PUBLISHER/REPO[/FILE]")
    roots = lmstudio_roots()
    folder = next((f for r in _existing(roots) if (f := r / parts[0] / parts[1]).is_dir()), None)
    if folder is None:
        raise StoreError(
            f"LM Studio has no {parts[0]}/{parts[1]} in {_paths(roots)}: download it in "
            f"LM Studio, or set LMSTUDIO_MODELS to the folder LM Studio keeps models in"
        )
    if len(parts) == 3:
        path = folder / (parts[2] if parts[2].endswith(".gguf") else parts[2] + ".gguf")
        if not path.is_file():
            raise StoreError(f"{path} does not exist: name a .gguf file in {folder}")
    else:
        ggufs = [p for p in sorted(folder.glob("*.gguf")) if not _is_projector(p)]
        # The parts of one multi-part model count as one model (refused below).
        models = {_SPLIT_GGUF.sub(".gguf", p.name): p for p in reversed(ggufs)}
        if not models:
            raise StoreError(f"{folder} has no GGUF file: download a GGUF of it in LM Studio")
        if len(models) > 1:
            raise StoreError(
                f"{folder} holds {len(models)} GGUF models ({', '.join(sorted(models))}): "
                f"name one, as lmstudio:{parts[0]}/{parts[1]}/FILE"
            )
        [path] = models.values()
    if _SPLIT_GGUF.search(path.name):
        raise StoreError(
            f"{path} is one part of a multi-part GGUF, which specd does not load: merge the "
            f"parts with llama.cpp's `llama-gguf-split --merge` and name the merged file"
        )
    return StoreModel(path=_gguf(path), store="lmstudio", name=name)


def _is_projector(path: Path) -> bool:
    # mmproj-*.gguf beside a vision model is its image projector, not a model to run.
    return path.name.lower().startswith("mmproj")


def _gguf(path: Path) -> Path:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise StoreError(f"{path}: cannot read ({exc})") from exc
    if magic != b"GGUF":
        raise StoreError(f"{path} is not a GGUF file (no GGUF magic): specd loads GGUF")
    return path


def _entry(name: str, store: str, path: Path) -> StoreEntry:
    try:
        size = path.stat().st_size
    except OSError:
        return StoreEntry(name, store, path, 0, UNREADABLE)
    return StoreEntry(name, store, path, size, gguf_file_type(path))


def _existing(roots: list[Path]) -> list[Path]:
    return [root for root in roots if os.path.isdir(root) and os.access(root, os.R_OK | os.X_OK)]


def _paths(paths: list[Path]) -> str:
    """The folders looked in. /usr/share/ollama, the system service's home, is often mode
    0750: Ollama's installer adds the user to its group, which counts from the next login."""
    return ", ".join(str(p) + " (not readable by this user)" * _unreadable(p) for p in paths)


def _unreadable(path: Path) -> bool:
    try:
        path.stat()
    except PermissionError:
        return True
    except OSError:
        return False
    return not os.access(path, os.R_OK | os.X_OK)


# GGUF value types (gguf.GGUFValueType): the fixed sizes, and struct codes of the integers.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INTS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}
_STRING, _ARRAY = 8, 9


def gguf_file_type(path: Path) -> str | None:
    """`general.file_type` as llama.cpp names it ("Q4_K_M", "F16"); None when the file does
    not say; UNREADABLE when it is no readable GGUF. Walks the metadata in a memory map up
    to that key, building no values and touching no tensor data. Quantized files keep the
    key after the tokenizer's arrays, which gguf.GGUFReader builds entry by entry: 24 s
    for a Llama 3 vocabulary, against 0.05 s here."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            value = _find_file_type(data)
    except (OSError, ValueError, struct.error, RecursionError):  # RecursionError: nesting
        return UNREADABLE
    if value is None:
        return None
    from gguf import LlamaFileType

    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"file type {value}"


def _find_file_type(data: mmap.mmap) -> int | None:
    offset, order = 4, "<"

    def read(fmt: str) -> Any:  # struct.error past the end of the file
        nonlocal offset
        value = struct.unpack_from(order + fmt, data, offset)[0]
        offset += struct.calcsize(fmt)
        return value

    def skip(value_type: int) -> None:
        nonlocal offset
        if value_type in _SIZES:
            offset += _SIZES[value_type]
        elif value_type == _STRING:
            length = read("Q")
            offset += length
        elif value_type == _ARRAY:
            item_type, count = read("I"), read("Q")
            if item_type in _SIZES:
                offset += _SIZES[item_type] * count
            elif item_type == _STRING:  # the vocabulary: the hot loop
                length_at = struct.Struct(order + "Q").unpack_from
                for _ in range(count):
                    offset += 8 + length_at(data, offset)[0]
            else:
                for _ in range(count):
                    skip(item_type)
        else:
            raise ValueError(f"unknown GGUF value type {value_type}")

    if data[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    version = read("I")
    if version & 0xFFFF == 0:  # a big-endian file: its small version reads byte-swapped
        order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version < 2:  # GGUF v1 had 32-bit counts and lengths
        raise ValueError(f"GGUF version {version}")
    read("Q")  # tensor count
    for _ in range(read("Q")):
        length = read("Q")
        key, offset = data[offset : offset + length], offset + length
        value_type = read("I")
        if key == b"general.file_type" and value_type in _INTS:
            return int(read(_INTS[value_type]))
        skip(value_type)
    return None
