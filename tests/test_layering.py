"""Imports go one way (docs/architecture.md, DESIGN.md): `daemon → speculative, offload,
modeling`; `speculative → modeling` through the runtime's protocol, cache, errors and text
modules only; `modeling` (the model runtime) and `offload` import none of the others; an
architecture module (modeling/models/<name>.py) imports no other architecture module, not
the registry and no loader. Inside the daemon, `cli` may use `http`, `http` never uses
`cli`, and the modules at `daemon/` use neither. And no two modules import each other,
directly or round a longer circle. Every import counts, those inside functions and under
TYPE_CHECKING too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PACKAGES = ("modeling", "speculative", "offload", "daemon")


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


# What speculative/ may import of the runtime: a model is a `Model` (modeling.protocol).
SPECULATIVE_SEES = ("modeling.protocol", "modeling.kv_cache", "modeling.errors", "modeling.text")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def forbidden(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported` (both module names), or None."""
    top = importer.split(".")[0]
    if top in ("modeling", "offload"):
        others = {"modeling", "speculative", "offload", "daemon"} - {top}
        if imported.split(".")[0] in others:
            return f"{top} imports none of {', '.join(sorted(others))}"
    if importer.startswith("modeling.models."):  # an architecture module, not the registry
        if _within(imported, "modeling.models"):
            return "an architecture module imports no other architecture module nor the registry"
        if _within(imported, "modeling.checkpoints"):
            return "an architecture module imports no loader"
    if top == "speculative":
        if imported.split(".")[0] in ("daemon", "offload"):
            return "speculative imports neither daemon nor offload"
        if _within(imported, "modeling") and not any(
            _within(imported, p) for p in SPECULATIVE_SEES
        ):
            return "speculative sees the runtime only through " + ", ".join(SPECULATIVE_SEES)
    at_root = top == "daemon" and not any(
        _within(importer, p) for p in ("daemon.cli", "daemon.http")
    )
    if at_root and (_within(imported, "daemon.cli") or _within(imported, "daemon.http")):
        return "the modules at daemon/ use neither daemon.cli nor daemon.http"
    if _within(importer, "daemon.http") and _within(imported, "daemon.cli"):
        return "daemon.http never uses daemon.cli"
    return None


def breaks(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} imports {imported}: {why}"
        for module in sorted(graph)
        for imported in sorted(graph[module])
        if (why := forbidden(module, imported)) is not None
    ]


def test_imports_go_one_way() -> None:
    graph = import_graph()
    for package in PACKAGES:
        assert any(_within(m, package) for m in graph), f"no modules found in {package}"
    wrong = breaks(graph)
    assert not wrong, "\n".join(wrong)


def test_a_deliberate_violation_fails(tmp_path: Path) -> None:
    sources = {
        "modeling/__init__.py": "",
        "modeling/protocol.py": "",
        "modeling/decoder.py": "from speculative import algo\n",
        "modeling/checkpoints/__init__.py": "",
        "modeling/checkpoints/loader.py": "",
        "modeling/models/__init__.py": "from modeling.models import a, b\n",
        "modeling/models/a.py": "def f():\n    from modeling.models import b\n",
        "modeling/models/b.py": "from ..checkpoints import loader\nfrom modeling import protocol\n",
        "speculative/__init__.py": "",
        "speculative/algo.py": "from modeling.protocol import Model\nimport modeling.decoder\n",
        "offload/__init__.py": "",
        "offload/stream.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import modeling\n",
        "daemon/__init__.py": "",
        "daemon/engine.py": "from daemon.http import server\nimport modeling.decoder\n",
        "daemon/http/__init__.py": "",
        "daemon/http/server.py": "from daemon.cli import main\n",
        "daemon/cli/__init__.py": "",
        "daemon/cli/main.py": "from daemon.http import server\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = breaks(import_graph(tmp_path))
    assert [line.split(":")[0] for line in found] == [
        "daemon.engine imports daemon.http.server",
        "daemon.http.server imports daemon.cli.main",
        "modeling.decoder imports speculative.algo",
        "modeling.models.a imports modeling.models.b",
        "modeling.models.b imports modeling.checkpoints.loader",
        "offload.stream imports modeling",
        "speculative.algo imports modeling.decoder",
    ], found


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
