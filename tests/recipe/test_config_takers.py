"""Only the plan reads a Config: the plan holds none, and outside unison/config/ and
unison/recipe/planning/ at most a few functions take one (the entry points that are handed a
config, and the last readers left)."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from unison.config import Config
from unison.recipe import RunPlan

ROOT = Path(__file__).resolve().parents[2]
MOST = 6
READERS = ("unison/config/", "unison/recipe/planning/")


def config_takers(root: Path) -> list[str]:
    """``path:line:function`` of each function outside READERS with a parameter annotated with ``Config``."""
    found = []
    for path in sorted((root / "unison").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(READERS):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                names = (
                    {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)}
                    if arg.annotation is not None
                    else set()
                )
                if "Config" in names:
                    found.append(f"{rel}:{node.lineno}:{node.name}")
                    break
    return found


def test_few_functions_outside_the_plan_take_a_config() -> None:
    takers = config_takers(ROOT)
    assert len(takers) <= MOST, (
        f"{len(takers)} functions outside {' and '.join(READERS)} take a Config (at most {MOST}); give them "
        "the plan's values instead:\n" + "\n".join(takers)
    )


def test_the_plan_holds_no_config() -> None:
    """What runs after the plan reads its values: no field of RunPlan is (or holds) a Config."""
    hints = typing.get_type_hints(RunPlan)
    holding = [
        f.name
        for f in dataclasses.fields(RunPlan)
        if Config in {hints[f.name], *typing.get_args(hints[f.name])} or f.name == "config"
    ]
    assert holding == [], f"RunPlan holds a Config in {holding}: give the plan the values its readers need"
