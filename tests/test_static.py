"""The package is lint-clean and fully typed (mypy), as STYLE asks; checked like any test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> list[str]:
    if shutil.which(name) is None and subprocess.run([sys.executable, "-m", name, "--version"], capture_output=True).returncode:
        pytest.fail(f"{name} is not installed: it is part of the test extra (pip install -e '.[test]')")
    return [sys.executable, "-m", name]


@pytest.mark.timeout(120)
def test_ruff_finds_nothing() -> None:
    result = subprocess.run([*_tool("ruff"), "check", "unison", "recipes", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)  # a cold cache on a loaded machine: a hang guard, not a time budget
def test_mypy_finds_nothing() -> None:
    result = subprocess.run([*_tool("mypy"), "unison"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
