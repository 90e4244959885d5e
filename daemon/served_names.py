"""The id a target is served under (`/v1/models`, every response's `model`) and the other
names a request's `model` may give it, from the target's reference as configured: a
folder, a hub id, a GGUF file, or a model store's reference (modeling/checkpoints/)."""

from __future__ import annotations

from pathlib import Path

# The target references that name a GGUF file or a model store's (modeling/checkpoints/).
GGUF_SUFFIX, OLLAMA_PREFIX, LMSTUDIO_PREFIX = ".gguf", "ollama:", "lmstudio:"


def served_model_id(target: str) -> str:
    """The id /v1/models lists and every response echoes for a target reference: a folder's
    or hub id's last part (`org/Llama-3.2-1B` → `Llama-3.2-1B`), a GGUF file's name without
    `.gguf` (an LM Studio store's file's too), an Ollama reference as given."""
    text = target.rstrip("/")
    if text.startswith(OLLAMA_PREFIX):
        return text  # its last part alone would lose the store, or the namespace before a '/'
    name = Path(text).name
    stem = name[: -len(GGUF_SUFFIX)]
    return stem if name.lower().endswith(GGUF_SUFFIX) and stem else name


def served_model_aliases(target: str) -> frozenset[str]:
    """The names besides its id that a request's `model` may give the target by: a GGUF
    file's name with its extension and its path (as given, and absolute); a store reference
    as given; an Ollama model also as Ollama's own clients name it (`NAME:TAG`, and `NAME`
    for the tag latest), with or without `ollama:`. A folder or hub id: none (its id only)."""
    text = target.rstrip("/")
    if text.startswith(OLLAMA_PREFIX):
        names = _ollama_names(text.removeprefix(OLLAMA_PREFIX))
        return frozenset({*names, *(OLLAMA_PREFIX + name for name in names)})
    if text.startswith(LMSTUDIO_PREFIX):
        return frozenset({text, Path(text).name})
    if not text.lower().endswith(GGUF_SUFFIX):
        return frozenset()
    path = Path(text).expanduser()
    return frozenset({path.name, text, str(path), str(path.absolute())})


def _ollama_names(name: str) -> set[str]:
    """An Ollama model name's spellings, as Ollama completes them: `tiny`, `tiny:latest`,
    `library/tiny` and `registry.ollama.ai/library/tiny:latest` name one model."""
    # Imported here: the stores' module pulls in numpy and gguf, which reading the settings
    # does not need (it only runs for an Ollama target, which loads them anyway).
    from modeling.checkpoints.model_stores import (
        OLLAMA_HOST,
        OLLAMA_NAMESPACE,
        OLLAMA_TAG,
        StoreError,
        _ollama_name,
    )

    try:
        host, namespace, model, tag = _ollama_name(name)
    except StoreError:  # not a name Ollama completes: answered as given only
        return {name}
    bases = [f"{host}/{namespace}/{model}"]
    if host.lower() == OLLAMA_HOST:
        bases.append(f"{namespace}/{model}")
        if namespace.lower() == OLLAMA_NAMESPACE:
            bases.append(model)
    untagged = set(bases) if tag == OLLAMA_TAG else set()
    return {name, *untagged, *(f"{base}:{tag}" for base in bases)}
