"""The package keeps its parts: the arrows pyproject's import-linter contracts allow, every
module in a part, no part importing the top-level package (docs/architecture.md)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, before it joined the standard library
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "unison"
TOP_LEVEL = {"__init__", "__main__"}
"""Modules allowed directly in unison/: the re-exports and ``python -m unison``."""


def _contracts(root: Path = ROOT) -> list[dict]:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _parts() -> set[str]:
    (layers,) = [c for c in _contracts() if c["type"] == "layers"]
    return {name.strip() for layer in layers["layers"] for name in layer.split("|")} | {"unison.config"}


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists() and shutil.which("lint-imports") is None:
        pytest.fail("import-linter is not installed: it is part of the test extra (pip install -e '.[test]')")
    command = [str(exe) if exe.exists() else "lint-imports", "--no-logo", "--no-cache"]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(root)})


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


@pytest.mark.timeout(120)
def test_import_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" in result.stdout and "0 broken" in result.stdout, result.stdout


def test_every_module_belongs_to_a_part() -> None:
    parts = _parts()
    homeless = [
        f"{path.relative_to(ROOT)}: module {name} belongs to no part; move it into one of {sorted(parts)} "
        "(or add a part to pyproject's [tool.importlinter] contracts and docs/architecture.md)"
        for name, path in _modules()
        if name != "unison"
        and path.stem not in TOP_LEVEL | {"__init__"}
        and not any(name == part or name.startswith(part + ".") for part in parts)
    ]
    assert not homeless, "\n".join(homeless)


def test_no_part_imports_the_top_level_package() -> None:
    offenders = []
    for _, path in _modules():
        if path.parent == PACKAGE:
            continue  # unison/__init__.py and __main__.py are the top level
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import) and any(alias.name == "unison" for alias in node.names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: import unison")
            elif isinstance(node, ast.ImportFrom) and node.module == "unison" and node.level == 0:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: from unison import ...")
    assert not offenders, "a part imports the top-level package, which only re-exports:\n" + "\n".join(offenders)


def test_architecture_doc_names_every_part() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [part for part in sorted(_parts()) if f"`{part.split('.')[-1]}`" not in text]
    assert not missing, f"docs/architecture.md does not describe {missing}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_forbidden_import_inside_a_function_is_caught(tmp_path: Path) -> None:
    """The contracts would fail on the import the layering exists to prevent."""
    copy = tmp_path / "tree"
    shutil.copytree(PACKAGE, copy / "unison", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    engine = copy / "unison" / "engine" / "engine.py"
    engine.write_text(
        engine.read_text() + "\n\ndef _probe() -> None:\n    from unison.handlers import checkpoint  # noqa: F401\n"
    )
    result = _lint_imports(copy)
    assert result.returncode != 0
    assert "unison.engine is not allowed to import unison.handlers" in result.stdout
    assert "unison.engine.engine -> unison.handlers.checkpoint" in result.stdout
