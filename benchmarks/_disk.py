"""The disk's own sequential bandwidth, against which checkpoint_stall.py sets its saves and resumes.

A write here is what a durable checkpoint write is at least: one new file in the same
folder, written in large blocks, fsynced, closed. A read is that file read back in large
blocks after it left the page cache (:func:`drop_cache`): what a resume on a machine that
did not just write the checkpoint reads from. Each is done four ways: through the page cache
and, where the file system takes it, with ``O_DIRECT`` from page-aligned memory (what the disk
does without the kernel's copies), each once one block after another and once with
:data:`DEPTH` blocks of :data:`DEEP` bytes at once, by as many threads (a virtual disk served
twice as fast given 96 MiB at a time as given 8 MiB after 8 MiB). The fastest way's median is
the disk's speed (:func:`faster_way`). Nothing imports torch.

How a file was written changes how it reads back on some virtual disks: here a file written
through the page cache read back at 2.4-2.8 GB/s every time, one written with ``O_DIRECT``
(as checkpoints from 128 MiB are) at 0.6-1.1 GB/s in some rounds and 2.4-3.1 in others. One
more way, :data:`WRITTEN_DIRECT`, writes a file as the ``O_DIRECT`` way with several calls at once
does and reads it back through the page cache, one block after another, so that a resume can
also be set against a read of a file written as its own was (:func:`written_as`). Its write is
not counted among the writes (NaN): it is the same write as that way's.
"""

from __future__ import annotations

import math
import mmap
import os
import queue
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK = 8 << 20
"""Bytes per write or read call (8 MiB): large enough that the calls cost nothing next to the disk."""
DEEP = 32 << 20
"""Bytes per call of the ways that give the disk several at once (32 MiB)."""
DEPTH = 3
"""Calls in flight at once in those ways, each by its own thread."""


def write_seconds(folder: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file in ``folder`` and fsync it (the file is then removed).

    The bytes are random (a compressing file system would otherwise flatter the disk), drawn
    before the clock starts.
    """
    return probe(folder, nbytes, read=False)[0]


def probe(folder: Path, nbytes: int, *, read: bool = True) -> tuple[float, float]:
    """Seconds to write ``nbytes`` to a new file in ``folder`` and fsync it, and seconds to read it
    back from the disk (its pages dropped from the cache first): each the faster of the page
    cache's way and ``O_DIRECT``'s. The file is then removed. With ``read=False`` the read is
    skipped (its seconds are NaN)."""
    ways = probe_ways(folder, nbytes, read=read)
    writes = [w for w, _ in ways.values() if not math.isnan(w)]
    return min(writes), min(r for _, r in ways.values())


def probe_ways(folder: Path, nbytes: int, *, read: bool = True) -> dict[str, tuple[float, float]]:
    """:func:`probe`'s write and read seconds for each way apart: ``{"page cache": (write, read),
    "O_DIRECT": (write, read), "page cache, 3 x 32 MiB at once": ..., "O_DIRECT, 3 x 32 MiB at
    once": ...}`` (the ``O_DIRECT`` ones where the platform has it)."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(min(BLOCK, max(nbytes, 1)))
    deep = _aligned(os.urandom(DEEP))
    path = folder / f"disk-probe-{os.getpid()}.bin"
    out: dict[str, tuple[float, float]] = {}
    try:
        for direct in _WAYS:
            written = _write(path, nbytes, block, direct)
            out[_NAMES[direct]] = (written, _read(path, direct) if read else float("nan"))
            written = _write_deep(path, nbytes, deep, direct)
            out[f"{_NAMES[direct]}, {DEPTH} x {DEEP >> 20} MiB at once"] = (
                written,
                _read_deep(path, direct) if read else float("nan"),
            )
        if read and _O_DIRECT and _write_deep(path, nbytes, deep, True) < float("inf"):
            out[WRITTEN_DIRECT] = (float("nan"), _read(path, False))
        return out
    finally:
        path.unlink(missing_ok=True)


def faster_way(
    rounds: list[dict[str, tuple[float, float]]], index: int, among: Callable[[str], bool] | None = None
) -> tuple[str, list[float]]:
    """The way whose median seconds (``index`` 0: write, 1: read) over ``rounds`` of
    :func:`probe_ways` is the least, and its seconds round by round: the disk's speed is that
    way's median. Taking the faster way within each round instead would pick the luckier of two
    noisy samples every time, and set the disk faster than either way ever is at its median.
    Only the ways ``among`` accepts (default: all) and that measured this (not NaN) are compared."""
    names = [
        n
        for n in (list(rounds[0]) if rounds else [_NAMES[False]])
        if (among is None or among(n)) and not any(math.isnan(r[n][index]) for r in rounds)
    ]
    best = min(names, key=lambda n: statistics.median(r[n][index] for r in rounds))
    return best, [r[best][index] for r in rounds]


def written_as(direct: bool) -> Callable[[str], bool]:
    """For :func:`faster_way`'s ``among``: the ways whose file was written with ``O_DIRECT``
    (``direct``) or through the page cache, however it was read back."""
    return lambda way: way.startswith(_NAMES[True]) == direct


_O_DIRECT = getattr(os, "O_DIRECT", 0)
_WAYS = (False, True) if _O_DIRECT else (False,)
_NAMES = {False: "page cache", True: "O_DIRECT"}
WRITTEN_DIRECT = f"{_NAMES[True]}, {DEPTH} x {DEEP >> 20} MiB at once, read through the page cache"
"""The way whose file is written with ``O_DIRECT`` and read back through the page cache."""


def _aligned(block: bytes) -> mmap.mmap:
    """``block`` in page-aligned memory, padded to whole 4 KiB pages (what ``O_DIRECT`` asks)."""
    buffer = mmap.mmap(-1, -(-len(block) // 4096) * 4096)
    buffer[: len(block)] = block
    return buffer


def _write(path: Path, nbytes: int, block: bytes, direct: bool) -> float:
    """Seconds to write ``nbytes`` of ``block`` over and over to ``path``, one call after another,
    and fsync it; inf where ``direct`` is refused by the file system."""
    source = memoryview(_aligned(block) if direct else block)
    step = len(block) - len(block) % 4096 or len(block)

    def calls(fd: int, whole: int) -> None:
        done = 0
        while done < whole:
            done += os.write(fd, source[: min(whole - done, step)])

    return _timed_write(path, nbytes, direct, calls, block)


def _write_deep(path: Path, nbytes: int, source: mmap.mmap, direct: bool) -> float:
    """Seconds to write ``nbytes`` to ``path`` in :data:`DEEP`-byte calls, :data:`DEPTH` at once by
    as many threads, and fsync it; inf where ``direct`` is refused."""
    view = memoryview(source)

    def calls(fd: int, whole: int) -> None:
        with ThreadPoolExecutor(DEPTH) as pool:
            list(pool.map(lambda at: os.pwrite(fd, view[: min(DEEP, whole - at)], at), range(0, whole, DEEP)))

    return _timed_write(path, nbytes, direct, calls, bytes(view[:4096]))


def _timed_write(
    path: Path, nbytes: int, direct: bool, calls: Callable[[int, int], None], tail: bytes
) -> float:
    """Seconds to create ``path``, write it with ``calls(fd, whole)`` (its first ``whole`` bytes:
    ``O_DIRECT`` writes whole pages), write the rest from ``tail`` and fsync it; inf where
    ``direct`` is refused by the file system."""
    path.unlink(missing_ok=True)
    whole = nbytes - nbytes % 4096 if direct else nbytes
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (_O_DIRECT if direct else 0), 0o644)
    except OSError:
        return float("inf")
    start = time.perf_counter()
    try:
        calls(fd, whole)
    except OSError:
        return float("inf")
    finally:
        os.close(fd)
    if whole < nbytes:
        with open(path, "r+b", buffering=0) as fh:
            fh.seek(whole)
            fh.write(tail[: nbytes - whole])
    fd = os.open(path, os.O_WRONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _read_deep(path: Path, direct: bool) -> float:
    """Seconds to read ``path`` from the disk (dropped from the cache first) in :data:`DEEP`-byte
    calls, :data:`DEPTH` at once by as many threads; inf where ``direct`` is refused."""
    drop_cache(path)
    size = path.stat().st_size
    free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
    for _ in range(DEPTH):  # one buffer per call in flight, its pages given before the clock starts
        buffer = mmap.mmap(-1, DEEP)
        buffer.write(b"\0" * DEEP)
        free.put(buffer)

    def read_at(offset: int) -> int:
        buffer = free.get()
        try:
            return os.preadv(fd, [buffer], offset)
        finally:
            free.put(buffer)

    try:
        fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
    except OSError:
        return float("inf")
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(DEPTH) as pool:
            list(pool.map(read_at, range(0, size, DEEP)))
    except OSError:
        return float("inf")
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _read(path: Path, direct: bool) -> float:
    """Seconds to read ``path`` in 8 MiB blocks from the disk (dropped from the cache first); inf
    where ``direct`` is refused."""
    if not direct:
        return read_seconds(path)
    drop_cache(path)
    buffer = mmap.mmap(-1, BLOCK)
    try:
        fd = os.open(path, os.O_RDONLY | _O_DIRECT)
    except OSError:
        return float("inf")
    start = time.perf_counter()
    try:
        while os.readv(fd, [buffer]) == BLOCK:
            pass
    except OSError:
        return float("inf")
    finally:
        os.close(fd)
    return time.perf_counter() - start


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
