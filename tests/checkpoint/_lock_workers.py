"""Rank functions of tests/checkpoint/test_lock.py (``run_distributed`` sends them by name)."""

from __future__ import annotations

from unison.checkpoint.lock import FolderInUseError, hold_folder


def claim(folder: str) -> str:
    """Every rank claims ``folder``; what each was told."""
    try:
        with hold_folder(folder) as held:
            return f"held={held.held}"
    except FolderInUseError as err:
        return f"refused: {err}"
