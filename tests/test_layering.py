"""Imports go one way (DESIGN.md, README's Development): `daemon → speculative, offload`,
which never import each other or `daemon`; inside the daemon, `cli` may use `http`, `http`
never uses `cli`, and the modules at `daemon/` use neither. And no two modules import each
other, directly or round a longer circle. Every import counts, those inside functions and
under TYPE_CHECKING too."""

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


PACKAGES = ("speculative", "offload", "daemon")


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Each of the packages' modules → the project modules it imports. An import names the
    module it loads: `from a.b import c` is `a.b.c` when that is a module, else `a.b`;
    `import a.b.c` is the longest of `a.b.c`, `a.b`, `a` that is one of ours. Relative
    imports are resolved from the importing module's package. The packages' `__init__`s
    an import passes through on the way are not counted (else a package that re-exports a
    submodule would close a circle with each submodule that imports a sibling)."""
    paths: dict[str, Path] = {}
    for folder in packages:
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def ours(dotted: str) -> str | None:
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in paths:
                return ".".join(parts[:end])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(ours(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    found.add(submodule if submodule in paths else ours(source))
        graph[name] = {module for module in found if module is not None}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, and the modules that
    import themselves (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = lowest[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                lowest[module] = min(lowest[module], lowest[imported])
            elif imported in on_stack:
                lowest[module] = min(lowest[module], index[imported])
        if lowest[module] == index[module]:
            component: list[str] = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or module in graph[module]:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}, "f": set()}
    assert circles(graph) == [["a", "b", "c"], ["d"]]


def test_graph_counts_every_import(tmp_path: Path) -> None:
    sources = {
        "pkg/__init__.py": "from pkg.a import thing\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "pkg/b.py": "def f():\n    import pkg.sub.c.name\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from .. import a\nfrom . import d\nfrom pkg import thing\n",
        "pkg/sub/d.py": "import os\nimport pkg.sub\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_graph(tmp_path, ("pkg",)) == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.c"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.a", "pkg.sub.d", "pkg"},
        "pkg.sub.d": {"pkg.sub"},
    }


def test_no_import_circles() -> None:
    graph = import_graph()
    assert len(graph) > 50, f"only {len(graph)} modules found"
    found = [
        "\n  ".join(
            f"{module} imports {', '.join(sorted(graph[module] & set(circle)))}"
            for module in circle
        )
        for circle in circles(graph)
    ]
    assert not found, "import circles:\n  " + "\n\n  ".join(found)
