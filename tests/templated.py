"""A copy of a model folder with a chat template of the test's own (tests that need a
template the shared models do not have)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def templated_copy(source: Path, folder: Path, template: str) -> Path:
    """`source` copied to `folder`, its tokenizer_config.json's chat_template `template`."""
    shutil.copytree(source, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return folder
