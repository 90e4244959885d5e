"""Shared fixtures: tiny random checkpoints in real Hugging Face layout, and the small real
checkpoints in ../shared/models."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# `--draft auto` (the default) looks for a draft in the model stores and the hub cache: the
# tests see empty ones, never the developer's downloads, so what it picks does not depend
# on the machine (tests of the stores point these at their own folders).
_NO_MODELS = tempfile.mkdtemp(prefix="specd-test-stores-")
for _store in ("OLLAMA_MODELS", "LMSTUDIO_MODELS", "HF_HUB_CACHE"):
    os.environ.setdefault(_store, os.path.join(_NO_MODELS, _store.lower()))

sys.path.insert(0, str(ROOT))  # scripts/ (the tiny model factory) is not an installed package

from modeling.weights import cpu_kernels  # noqa: E402
from scripts.tiny_models import make_checkpoint  # noqa: E402

SHARED_MODELS = Path(os.environ.get("SPECD_SHARED_MODELS", ROOT.parent / "shared" / "models"))

# Daemons started by tests run eager: `auto` would compile the tiny models' passes on a
# background thread, tens of seconds of the two cores on a cold compile cache. Subprocess
# daemons inherit this; in-process servers built with `load_settings(environ={})` say
# "runtime.compile": "off" in their overrides. Compiled passes have their own tests
# (test_compiled.py, test_compiling.py), which ask for them explicitly.
os.environ["SPECD_RUNTIME_COMPILE"] = "off"

# What the daemon keeps between runs (built substitute drafts, pid files) goes to a
# folder of this test session's, never the user's state directory.
os.environ.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="specd-test-state-"))
# Nor is the user's config file read: `specd plan` and the daemon read it when no --config
# is given, and a developer's own would change what the tests plan.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="specd-test-config-")
# The CPU kernels on GGUF blocks are built once per test session, beside it.
os.environ.setdefault("SPECD_KERNEL_CACHE", tempfile.mkdtemp(prefix="specd-test-kernels-"))
# Built now: a first build is announced on stderr ("building the CPU kernels"), which no
# test's output should owe to the order tests run in.
cpu_kernels.available()

# Tiny models gain nothing from threads, and spinning OpenMP threads stall badly when the
# two cores are busy; tests run single-threaded.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_models() -> Path:
    if not (SHARED_MODELS / "stories260k" / "config.json").is_file():
        pytest.fail(f"the real checkpoints are missing: expected {SHARED_MODELS}/stories260k")
    return SHARED_MODELS


@pytest.fixture(scope="session")
def stories_target(shared_models: Path) -> Path:
    return shared_models / "stories260k"


@pytest.fixture(scope="session")
def stories_draft(shared_models: Path) -> Path:
    return shared_models / "stories260k-draft"


@pytest.fixture(scope="session")
def stories_reference(stories_target: Path) -> dict:
    return json.loads((stories_target / "reference.json").read_text())


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoint(family="llama", **options)` → a folder, built once per option set."""
    made: dict[str, Path] = {}

    def build(family: str = "llama", **options) -> Path:
        key = json.dumps([family, sorted(options.items())], default=str)
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            made[key] = make_checkpoint(path, family, **options)
        return made[key]

    return build
