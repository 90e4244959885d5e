"""`specd models`: the models already on this machine that `--model` can name: Ollama's and
LM Studio's GGUF files (modeling/checkpoints/model_stores.py) and the Hugging Face hub cache, with
their size and type. Nothing is loaded; a GGUF's type is read from its metadata alone. A
store's entry that cannot be read is listed as unreadable, with a one-line note on stderr
saying why; the rest are listed all the same. Each readable entry is opened as `--model`
would open it (its config and, for a GGUF, its tokenizer metadata, no weights), and one that
specd cannot run says why on its row (`runs: false` and `why` in the JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Found:
    name: str  # what --model takes
    kind: str  # "Q4_K_M", "bf16", "gptq 4-bit", ...; "unreadable" for a damaged file
    size: int  # bytes on disk
    path: Path
    source: str  # "ollama" | "lmstudio" | "hub"
    note: str | None = None  # why it is unreadable: one line naming the file
    why: str | None = None  # why specd cannot run it (an architecture, a tokenizer...)


def hub_models() -> list[Found]:
    """The hub cache's model snapshots (the newest revision of each)."""
    from modeling.checkpoints.hub_cache import hub_snapshots

    return [
        Found(snap.repo_id, _hub_kind(snap.path), snap.size, snap.path, "hub")
        for snap in hub_snapshots()
    ]


def _hub_kind(folder: Path) -> str:
    """What config.json says the weights are: a quantization format, or the dtype."""
    from modeling.checkpoints.model_stores import read_text_file

    try:  # read as the stores' files are: a FIFO or a huge file is no config.json
        config = json.loads(read_text_file(folder / "config.json"))
    except (OSError, ValueError, RecursionError):
        return "no config.json"
    if not isinstance(config, dict):
        return "no config.json"
    quant = config.get("quantization_config") or {}
    if isinstance(quant, dict) and quant.get("quant_method"):
        bits = quant.get("bits") or quant.get("w_bit")
        return f"{quant['quant_method']} {bits}-bit" if bits else str(quant["quant_method"])
    return str(config.get("torch_dtype") or config.get("dtype") or "unknown dtype")


def store_models() -> list[Found]:
    from modeling.checkpoints.model_stores import list_store_models

    return [
        Found(e.name, e.file_type or "unknown type", e.size, e.path, e.store, e.note)
        for e in list_store_models()
    ]


def cannot_run(path: Path) -> str | None:
    """Why `--model` would refuse this file or folder, as opening it says (config and
    tokenizer metadata, no weights), without the path it starts with; None if it opens."""
    from modeling.checkpoints.checkpoint import open_checkpoint

    try:
        open_checkpoint(path, compare_head=False)  # (no plan follows: no weights read)
    except (ValueError, OSError) as err:  # every refusal of a model's files is one of these
        said = str(err).splitlines()[0] if str(err) else type(err).__name__
        return said.removeprefix(f"{path}: ").removeprefix(f"{path / 'config.json'}: ")
    return None


def _checked(found: Found) -> Found:
    if found.kind in ("unreadable", "no config.json"):
        return found
    return replace(found, why=cannot_run(found.path))


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def cmd_models(args: argparse.Namespace) -> int:
    found = [
        _checked(f) for f in sorted(store_models() + hub_models(), key=lambda f: (f.source, f.name))
    ]
    for f in found:
        if f.note is not None:
            print(f"specd: note: {printable(f.name)}: {printable(f.note)}", file=sys.stderr)
    if args.json:
        rows: list[dict[str, Any]] = [
            {"name": f.name, "type": f.kind, "bytes": f.size, "path": str(f.path),
             "source": f.source, "note": f.note, "why": f.why,
             "runs": f.why is None and f.kind not in ("unreadable", "no config.json")}
            for f in found
        ]  # fmt: skip
        print(json.dumps(rows, indent=2))
        return 0
    if not found:
        print(
            "no models found in Ollama's or LM Studio's stores or the Hugging Face cache; "
            "give --model a folder or a .gguf file, or `specd pull ORG/NAME`"
        )
        return 0
    width = max(len(printable(f.name)) for f in found)
    kinds = max(len(f.kind) for f in found)
    for f in found:
        name, path = printable(f.name), printable(str(f.path))
        print(f"{name:<{width}}  {f.kind:<{kinds}}  {_size(f.size):>9}  {path}")
        if f.why is not None:
            print(f"{'':<{width}}  specd cannot run it: {printable(f.why)}")
    return 0


def printable(text: str) -> str:
    """A store's file and folder names are anyone's: control characters (a terminal's
    escape sequences, a newline that forges a line of the listing) written as escapes
    (`specd models`, `specd plan`)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def register(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser(
        "models", help="list the models on this machine (Ollama, LM Studio, Hugging Face cache)"
    )
    models.add_argument("--json", action="store_true", help="one JSON list")
    models.set_defaults(func=cmd_models)
