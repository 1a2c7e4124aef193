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


def choose_with_a_failing_read(folder: str, failing_rank: int) -> str:
    """``choose(manifest, "auto")`` where every file read on ``failing_rank`` raises; what each rank got."""
    from unison.checkpoint.checkpoint_error import CheckpointError
    from unison.distributed import get_rank

    real = files_module.file_checksum

    def refused(path: Path) -> tuple[int, int]:
        raise PermissionError(13, "Permission denied", str(path))

    if get_rank() == failing_rank:
        files_module.file_checksum = refused
    try:
        return f"chose {choose(Manifest(folder), 'auto')}"
    except CheckpointError as err:
        return f"CheckpointError: {err}"
    finally:
        files_module.file_checksum = real
