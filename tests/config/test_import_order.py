"""unison/config/: validation runs the checks of compat and tuning, which import only lower modules
(imports inside functions counted)."""

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


def test_validation_runs_the_checks_of_compat_and_tuning_not_the_reverse() -> None:
    graph = _graph()
    assert {"unison.config.compat", "unison.config.tuning"} <= graph["unison.config.validation"]
    for name in ("unison.config.compat", "unison.config.tuning"):
        assert "unison.config.validation" not in graph[name]
        assert "unison.config.checks_base" in graph[name]


def test_only_the_package_imports_validation() -> None:
    users = sorted(name for name, imported in _graph().items() if "unison.config.validation" in imported)
    assert users == [], f"{users} import validation, which imports them: a circle"
