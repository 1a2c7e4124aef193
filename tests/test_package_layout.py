"""The package's layout: no module name used twice, and recipe/ as a few phases on few levels.

A basename used in two parts (``steps.py`` in engine/ and in recipe/) makes a traceback, a search
and a conversation ambiguous; recipe/ holds one folder (or module) per phase, importing one way
on at most four levels (DESIGN.md's layout, docs/architecture.md).
"""

from __future__ import annotations

import ast
import os
from collections import Counter
from pathlib import Path

ROOT = Path(os.environ.get("UNISON_LAYOUT_ROOT", Path(__file__).resolve().parents[1]))
PACKAGE = ROOT / "unison"
RECIPE = PACKAGE / "recipe"
MAX_PARTS = 6
MAX_LEVELS = 4
SHARED_NAMES = {"__init__.py", "__main__.py"}
"""Names every package may have: its face and its entry point."""


def basenames_used_twice(package: Path) -> dict[str, list[str]]:
    """Each module basename that two files under ``package`` bear, with their paths."""
    paths = [p for p in sorted(package.rglob("*.py")) if p.name not in SHARED_NAMES]
    counts = Counter(p.name for p in paths)
    return {
        name: [p.relative_to(package.parent).as_posix() for p in paths if p.name == name]
        for name, n in counts.items()
        if n > 1
    }


def recipe_parts(recipe: Path) -> dict[str, set[str]]:
    """recipe/'s top-level modules and folders, each with the others it imports (anywhere in it)."""
    parts = sorted(
        p.stem if p.is_file() else p.name
        for p in recipe.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").is_file())
    )
    prefix = "unison.recipe."
    uses: dict[str, set[str]] = {}
    for part in parts:
        files = (
            [recipe / f"{part}.py"]
            if (recipe / f"{part}.py").is_file()
            else list((recipe / part).rglob("*.py"))
        )
        named: set[str] = set()
        for file in files:
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                named.update(n[len(prefix) :].split(".")[0] for n in names if n.startswith(prefix))
        uses[part] = {n for n in named if n in parts and n != part}
    return uses


def levels(uses: dict[str, set[str]]) -> dict[str, int]:
    """Each part's level: 1 for one that imports no other part, else one above the highest it imports.

    Raises:
        ValueError: parts that import each other in a circle (they have no level).
    """
    found: dict[str, int] = {}
    while len(found) < len(uses):
        ready = [p for p in uses if p not in found and uses[p] <= set(found)]
        if not ready:
            raise ValueError(
                f"parts of recipe/ import each other in a circle: {sorted(set(uses) - set(found))}"
            )
        for part in ready:
            found[part] = 1 + max((found[u] for u in uses[part]), default=0)
    return found


def test_no_module_basename_is_used_twice() -> None:
    twice = basenames_used_twice(PACKAGE)
    assert not twice, (
        "module basenames used by two files of unison/ (name each after its own idea, so a traceback or a "
        f"search names one file): {twice}"
    )


def test_recipe_holds_a_few_phases_on_a_few_levels() -> None:
    uses = recipe_parts(RECIPE)
    assert len(uses) <= MAX_PARTS, (
        f"recipe/ holds {len(uses)} top-level modules or folders (at most {MAX_PARTS}): {sorted(uses)}"
    )
    level = levels(uses)
    assert max(level.values()) <= MAX_LEVELS, (
        f"recipe/'s parts stand on more than {MAX_LEVELS} levels: {level}"
    )


def test_levels_refuse_a_circle_and_count_a_chain() -> None:
    assert levels({"a": set(), "b": {"a"}, "c": {"b", "a"}}) == {"a": 1, "b": 2, "c": 3}
    try:
        levels({"a": {"b"}, "b": {"a"}})
    except ValueError as err:
        assert "'a', 'b'" in str(err)
    else:
        raise AssertionError("a circle has no levels")
