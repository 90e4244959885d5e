"""A daemon over the shared stories target that requires an API key (tests that probe the
HTTP edge with raw requests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.http.server import BackgroundServer
from daemon.settings_loading import load_settings


def keyed_server(
    target: Path,
    tmp_path_factory: pytest.TempPathFactory,
    key: str,
    settings: dict[str, Any],
) -> Iterator[BackgroundServer]:
    """`yield from` it in a fixture: the daemon on a free port, `key` in its key file, and
    `settings` ("section.key" → value) on top."""
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(key + "\n")
    overrides = {
        "models.target": (str(target), "test"),
        "runtime.compile": ("off", "test"),
        "server.port": (0, "test"),
        "server.api_key_file": (str(key_file), "test"),
        **{name: (value, "test") for name, value in settings.items()},
    }
    with BackgroundServer(load_settings(environ={}, overrides=overrides)) as srv:
        yield srv
