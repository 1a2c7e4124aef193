"""No circle of modules inside the packages that keep one-way imports: every import counts, one
inside a function or under ``TYPE_CHECKING`` included (STYLE.md, "No circle of files")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACYCLIC = ("unison.checkpoint", "unison.config", "unison.engine", "unison.recipe")
"""Packages whose modules import each other one way only."""


def _imports(path: Path, package: str, modules: set[str]) -> set[str]:
    """The modules of ``package`` (its subpackages' too) that the module at ``path`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in modules:
                found.add(node.module)
            elif node.module == package or node.module.startswith(package + "."):  # from package import module
                found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
    return found


def circles(root: Path, package: str) -> list[list[str]]:
    """The circles among the modules of ``package`` under ``root``, its subpackages' included (each
    ``__init__`` left out: it only hands names on), each as its modules, sorted; empty when every
    import runs one way."""
    folder = root.joinpath(*package.split("."))
    paths = {
        ".".join([package, *p.relative_to(folder).with_suffix("").parts]): p
        for p in sorted(folder.rglob("*.py"))
        if p.stem != "__init__"
    }
    graph = {name: _imports(path, package, set(paths)) - {name} for name, path in paths.items()}
    found, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


@pytest.mark.parametrize("package", ACYCLIC)
def test_no_circle_of_modules(package: str) -> None:
    found = circles(ROOT, package)
    assert not found, (
        f"modules of {package} import each other in a circle: {found}. Move what they share into a lower "
        "module, or give the lower one a small Protocol of what it needs from its caller."
    )


def test_an_import_inside_a_function_closes_a_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from demo.high import g\n    return g()\n")
    (pkg / "high.py").write_text("from demo.low import f\n\ndef g():\n    return 1\n")
    assert circles(tmp_path, "demo") == [["demo.high", "demo.low"]]
    (pkg / "low.py").write_text("def f():\n    return 1\n")
    assert circles(tmp_path, "demo") == []


def test_a_circle_through_a_subpackage_is_found(tmp_path: Path) -> None:
    (tmp_path / "demo" / "sub").mkdir(parents=True)
    (tmp_path / "demo" / "__init__.py").write_text("")
    (tmp_path / "demo" / "sub" / "__init__.py").write_text("")
    (tmp_path / "demo" / "top.py").write_text("from demo.sub import low\n")
    (tmp_path / "demo" / "sub" / "low.py").write_text("import demo.top\n")
    assert circles(tmp_path, "demo") == [["demo.sub.low", "demo.top"]]
