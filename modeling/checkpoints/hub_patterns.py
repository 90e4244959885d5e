"""Which files of a Hugging Face repository specd downloads (`specd pull`, a hub id given
as a model): light to import, so that `specd pull` loads no torch."""

from __future__ import annotations

# What specd reads from a checkpoint; everything else (other formats, images) is skipped.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
# What planning reads: a plan needs no weights (`specd plan`, `specd pull --config-only`).
CONFIG_FILES = ["config.json", "generation_config.json"]
# Mistral's repositories keep their own format beside the Hugging Face one, as large again
# (`consolidated.safetensors`, its own tensor names): not downloaded, not read.
SKIPPED_FILES = ["consolidated*.safetensors"]
