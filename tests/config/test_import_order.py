"""unison/config/: its modules import each other one way (no circle, imports inside functions counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import unison.config

PACKAGE = Path(unison.config.__file__).parent


def _imports(path: Path) -> set[str]:
    """The modules of unison.config that ``path`` imports, anywhere in it (a function's body too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "unison.config":
                names.update(f"unison.config.{a.name}" for a in node.names)
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {
        n
        for n in names
        if n.startswith("unison.config.") and (PACKAGE / f"{n.rsplit('.', 1)[1]}.py").is_file()
    }


def _graph() -> dict[str, set[str]]:
    return {
        f"unison.config.{p.stem}": _imports(p) for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"
    }


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_circle_finder_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _circle(graph) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


def test_config_modules_import_each_other_one_way() -> None:
    circle = _circle(_graph())
    assert circle is None, "unison/config/ modules import each other in a circle: " + " -> ".join(
        circle or []
    )


def test_validation_runs_the_checks_of_compat_and_tuning_not_the_reverse() -> None:
    graph = _graph()
    assert {"unison.config.compat", "unison.config.tuning"} <= graph["unison.config.validation"]
    for name in ("unison.config.compat", "unison.config.tuning"):
        assert "unison.config.validation" not in graph[name]
        assert "unison.config.checks_base" in graph[name]
