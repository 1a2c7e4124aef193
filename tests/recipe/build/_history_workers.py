"""Rank functions of tests/recipe/build/test_history.py (``run_distributed`` sends them by name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unison.distributed import get_rank
from unison.recipe.build.history import HISTORY_FILE, RunHistory


def killed_and_restored(folder: str) -> dict[str, Any]:
    """Every rank appends the rows of epochs 1-3, then a new history restores epoch 2 from the file
    (rank 0's only: the other ranks' folder is empty, as on another node)."""
    run_dir = Path(folder) / f"rank{get_rank()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    written: list[dict[str, Any]] = []
    history = RunHistory(run_dir, written)
    for epoch in (1, 2, 3):
        history.append({"epoch": epoch, "train_loss": 1.0 / epoch})
    lines = (run_dir / HISTORY_FILE).read_text().splitlines() if (run_dir / HISTORY_FILE).exists() else []
    restored: list[dict[str, Any]] = []
    RunHistory(run_dir, restored).restore(2)
    return {"written": written, "lines": len(lines), "restored": restored}
