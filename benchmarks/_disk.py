"""The disk's own sequential write bandwidth, against which checkpoint_stall.py sets its saves.

A write here is what a durable checkpoint write is at least: one new file in the same
folder, written in large blocks, fsynced, closed, then removed. Nothing imports torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

BLOCK = 8 << 20
"""Bytes per write call (8 MiB): large enough that the calls cost nothing next to the disk."""


def write_seconds(folder: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file in ``folder`` and fsync it (the file is then removed).

    The bytes are random (a compressing file system would otherwise flatter the disk), drawn
    before the clock starts.
    """
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(min(BLOCK, max(nbytes, 1)))
    path = folder / f"disk-probe-{os.getpid()}.bin"
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as fh:
        left = nbytes
        while left > 0:
            left -= fh.write(block[: min(left, len(block))])
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def folder_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (a checkpoint file or a sharded checkpoint's folder)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mb_per_s(nbytes: float, seconds: float) -> float:
    """Throughput in MB/s (10^6 bytes)."""
    return nbytes / seconds / 1e6 if seconds > 0 else float("inf")
