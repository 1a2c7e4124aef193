"""The disk's own sequential bandwidth, against which checkpoint_stall.py sets its saves and resumes.

A write here is what a durable checkpoint write is at least: one new file in the same
folder, written in large blocks, fsynced, closed. A read is that file read back in large
blocks after it left the page cache (:func:`drop_cache`): what a resume on a machine that
did not just write the checkpoint reads from. Nothing imports torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

BLOCK = 8 << 20
"""Bytes per write or read call (8 MiB): large enough that the calls cost nothing next to the disk."""


def write_seconds(folder: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file in ``folder`` and fsync it (the file is then removed).

    The bytes are random (a compressing file system would otherwise flatter the disk), drawn
    before the clock starts.
    """
    return probe(folder, nbytes, read=False)[0]


def probe(folder: Path, nbytes: int, *, read: bool = True) -> tuple[float, float]:
    """Seconds to write ``nbytes`` to a new file in ``folder`` and fsync it, and seconds to read it
    back from the disk (its pages dropped from the cache first); the file is then removed.
    With ``read=False`` the read is skipped (its seconds are NaN)."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(min(BLOCK, max(nbytes, 1)))
    path = folder / f"disk-probe-{os.getpid()}.bin"
    try:
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as fh:
            left = nbytes
            while left > 0:
                left -= fh.write(block[: min(left, len(block))])
            os.fsync(fh.fileno())
        written = time.perf_counter() - start
        return written, read_seconds(path) if read else float("nan")
    finally:
        path.unlink(missing_ok=True)


def read_seconds(path: Path) -> float:
    """Seconds to read the file ``path`` in 8 MiB blocks from the disk (dropped from the cache first)."""
    drop_cache(path)
    buffer = bytearray(BLOCK)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buffer):
            pass
    return time.perf_counter() - start


def drop_cache(path: Path) -> None:
    """Evicts the file ``path`` (or every file under the folder ``path``) from the page cache, once
    fsynced: its next read comes from the disk, as a resume on a fresh machine would."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def folder_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (a checkpoint file or a sharded checkpoint's folder)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mb_per_s(nbytes: float, seconds: float) -> float:
    """Throughput in MB/s (10^6 bytes)."""
    return nbytes / seconds / 1e6 if seconds > 0 else float("inf")
