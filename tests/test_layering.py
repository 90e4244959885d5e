"""Imports go one way (DESIGN.md, README's Development): `daemon → speculative, offload`,
which never import each other or `daemon`; inside the daemon, `cli` may use `http`, `http`
never uses `cli`, and the modules at `daemon/` use neither. Every import counts, those
inside functions and under TYPE_CHECKING too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# where the file lives → packages it must not import
FORBIDDEN = {
    "speculative": ("daemon", "offload"),
    "offload": ("daemon", "speculative"),
    "daemon": ("daemon.cli", "daemon.http"),  # the modules directly in daemon/
    "daemon/http": ("daemon.cli",),
}


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def files(folder: str) -> list[Path]:
    base = ROOT / folder
    # The modules directly in daemon/ only: its subpackages have their own rules.
    return sorted(base.glob("*.py") if folder == "daemon" else base.rglob("*.py"))


@pytest.mark.parametrize("folder", FORBIDDEN)
def test_imports_go_one_way(folder: str) -> None:
    assert files(folder), f"no modules found in {folder}"
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in files(folder)
        for module in sorted(imported_modules(path))
        if any(module == p or module.startswith(f"{p}.") for p in FORBIDDEN[folder])
    ]
    assert not wrong, "\n".join(wrong)
