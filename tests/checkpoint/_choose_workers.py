"""Rank functions of tests/checkpoint/test_choose_shared.py (``run_distributed`` sends them by name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import unison.checkpoint.sharded_files as files_module
from unison.checkpoint.manifest import Manifest
from unison.checkpoint.ranks import choose


def choose_counting(folder: str) -> dict[str, Any]:
    """Every rank takes part in ``choose(manifest, "auto")``; the checkpoint chosen, and the files this
    rank checksummed."""
    read: list[str] = []
    real = files_module.file_checksum

    def spy(path: Path) -> tuple[int, int]:
        read.append(f"{path.parent.name}/{path.name}")
        return real(path)

    files_module.file_checksum = spy
    try:
        choice = choose(Manifest(folder), "auto")
    finally:
        files_module.file_checksum = real
    return {"choice": None if choice is None else Path(choice).name, "read": read}
