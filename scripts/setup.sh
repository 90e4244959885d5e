#!/usr/bin/env bash
# One-time (and idempotent) set-up: a virtual environment in .venv with specd installed
# in editable mode plus the test extra. torch is asked for as exactly 2.13.0: on a
# CPU-only machine of ours pip takes the local CPU wheel; elsewhere it takes the CUDA
# build from PyPI. Override with SPECD_TORCH_SPEC (e.g. "torch==2.13.0+cu128").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.specd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    # (setuptools warns on every editable install that a folder named like a package
    # could shadow it: here those folders are the packages themselves)
    PYTHONWARNINGS="ignore:Editable installation" \
        .venv/bin/python -m pip install --quiet "${SPECD_TORCH_SPEC:-torch==2.13.0}" -e ".[test]"
    touch "$stamp"
fi
