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

What a store holds is taken as hostile: only regular files are opened (a FIFO named like a
blob would block a reader forever, a device never end), each opened without blocking and
checked again once open; manifests and text layers are read up to MAX_TEXT_BYTES; and a
bad entry is listed with a note saying why, never stopping the listing of the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modeling.checkpoints.gguf_file import read_file_type, short_repr
from modeling.checkpoints.regular import open_regular

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
MAX_TEXT_BYTES = 1 << 20  # a manifest, a template, params or a system prompt (real: ~1 KB)

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
    note: str | None = None  # why it is UNREADABLE, in one line naming the file


def resolve_store_ref(ref: str) -> StoreModel | None:
    """The model a store reference names; None when `ref` has no store prefix."""
    store, sep, name = ref.partition(":")
    if sep and store == "ollama":
        return _resolve_ollama(name)
    return _resolve_lmstudio(name) if sep and store == "lmstudio" else None


def list_store_models() -> list[StoreEntry]:
    """Every model in both stores, by name. A broken one is listed as UNREADABLE with a
    note saying why (resolving it says the same); models with no local GGUF (cloud models)
    and multi-part GGUFs are left out."""
    entries: list[StoreEntry] = []
    for root in _existing(ollama_roots()):
        manifests = root / "manifests"
        for manifest in sorted(p for p in manifests.glob("*/*/*/*") if not p.is_dir()):
            host, namespace, model, tag = manifest.relative_to(manifests).parts
            if not (
                _HOST_PART.fullmatch(host)
                and all(_NAME_PART.fullmatch(p) for p in (namespace, model, tag))
            ):
                continue  # not a name Ollama writes, nor one --model takes (escapes, newlines)
            # The shortest name that finds this manifest again, as Ollama shows it.
            if host.lower() != OLLAMA_HOST:
                name = f"{host}/{namespace}/{model}:{tag}"
            elif namespace.lower() != OLLAMA_NAMESPACE:
                name = f"{namespace}/{model}:{tag}"
            else:
                name = f"{model}:{tag}"
            try:
                blob = _ollama_layers(root, manifest, name).get(_MODEL)
            except StoreError as exc:
                entries.append(
                    StoreEntry(f"ollama:{name}", "ollama", manifest, 0, UNREADABLE, str(exc))
                )
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
        with contextlib.suppress(OSError, ValueError):  # unreadable: the default home
            home = Path(read_text_file(pointer).strip())
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
        except (ValueError, RecursionError) as exc:
            why = "nested too deep" if isinstance(exc, RecursionError) else str(exc)[:200]
            raise StoreError(f"{layers[_PARAMS][1]}: Ollama params are not JSON ({why})") from None
        if not isinstance(params, dict):
            raise StoreError(f"{layers[_PARAMS][1]}: Ollama params are not a JSON object")
    stop = params.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOPS and all(
        isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop
    )):  # fmt: skip
        # (a dict was stringified into a stop string, null into "None"; 100,000 of them
        # made a megabyte warning at every start, an attacker found)
        raise StoreError(
            f"{layers[_PARAMS][1]}: Ollama params' stop is {short_repr(stop)}; it must be a "
            f"string or a list of up to {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS:,} "
            "characters: pull the model again"
        )
    return StoreModel(
        path=_gguf(_blob(layers[_MODEL], name)),
        store="ollama",
        name=name,
        template_text=template,
        params=params,
        stop=list(stop),
        system=_text(layers[_SYSTEM], name) if _SYSTEM in layers else None,
    )


# An Ollama model's own stop strings (its params layer): a few end-of-turn markers.
MAX_STOPS = 64
MAX_STOP_CHARS = 1000


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
        for layer in json.loads(read_text_file(manifest))["layers"]:
            match = _DIGEST.fullmatch(layer["digest"])
            if not isinstance(layer["mediaType"], str) or match is None:
                raise ValueError(f"bad layer {layer}")
            found[layer["mediaType"]] = (layer["digest"], root / "blobs" / f"sha256-{match[1]}")
        return found
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        # RecursionError: JSON nested too deep for the parser (a manifest is 3 levels).
        why = str(exc)[:200] if not isinstance(exc, RecursionError) else "nested too deep"
        raise StoreError(
            f"{manifest}: malformed Ollama manifest ({why}): run `ollama pull {name}` again"
        ) from None


def _blob(layer: Layer, name: str) -> Path:
    if not layer[1].is_file():
        what = "is not a regular file" if layer[1].exists() else "is missing"
        raise StoreError(
            f"Ollama model {name!r}: blob {layer[0]} {what} ({layer[1]}): "
            f"run `ollama pull {name}` again"
        )
    return layer[1]


def _text(layer: Layer, name: str) -> str:
    path = _blob(layer, name)
    try:
        return read_text_file(path)
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path}: cannot read Ollama layer {layer[0]} ({_why(exc)})") from None


def read_text_file(path: Path) -> str:
    """The UTF-8 text of a small regular file (a manifest, a config): OSError if it is not
    one (a FIFO, say), ValueError past MAX_TEXT_BYTES or if it is not UTF-8."""
    with os.fdopen(open_regular(path), "rb") as f:
        data = f.read(MAX_TEXT_BYTES + 1)
    if len(data) > MAX_TEXT_BYTES:
        raise ValueError(f"over {MAX_TEXT_BYTES:,} bytes, more than any real one")
    return data.decode("utf-8")


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
        if not path.exists():
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
        with os.fdopen(open_regular(path), "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise StoreError(f"{path}: cannot read it ({_why(exc)})") from None
    if magic != b"GGUF":
        raise StoreError(f"{path} is not a GGUF file (no GGUF magic): specd loads GGUF")
    return path


def _entry(name: str, store: str, path: Path) -> StoreEntry:
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        return StoreEntry(name, store, path, 0, UNREADABLE, f"{path}: {exc.strerror}")
    try:
        return StoreEntry(name, store, path, size, _read_file_type(path))
    except ValueError as exc:  # GGUFFormatError, naming the path
        return StoreEntry(name, store, path, size, UNREADABLE, str(exc))


def _why(exc: OSError | ValueError) -> str:
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))[:200]


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


def gguf_file_type(path: Path) -> str | None:
    """`general.file_type` as llama.cpp names it ("Q4_K_M", "F16"); None when the file does
    not say; UNREADABLE when it is no readable GGUF. Only the metadata is read, and none of
    its values built (modeling/checkpoints/gguf_file.py's `read_file_type`)."""
    try:
        return _read_file_type(path)
    except ValueError:  # GGUFFormatError: what it says is in _entry's note
        return UNREADABLE


def _read_file_type(path: Path) -> str | None:
    from gguf import LlamaFileType

    value = read_file_type(path)
    if value is None:
        return None
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"file type {value}"
