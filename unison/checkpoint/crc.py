"""CRC-32s of ranges of a file, read and computed by several threads at once.

A checkpoint's integrity check computes the CRC-32 of every record of its archive. One
thread that reads a block and then computes its CRC leaves the disk idle while it computes,
and a CRC-32 on one core (3-4 GB/s with zlib, 12 GB/s with zlib-ng's :func:`crc32`, which this
module exports and every checkpoint module uses) is slower than a fast disk: here the calling
thread reads each range in order (``os.preadv``) while other threads checksum the blocks it
has read (both release the GIL), and the blocks' CRCs are combined into the range's. Combining
needs the CRC of a block's length of zeros as a linear map (:func:`shift`, as zlib's
``crc32_combine``): every range is cut so that each block appended after its first is one
length (:data:`READ` for a check, :data:`BLOCK` for a save's buffers), and one map serves them all.
"""

from __future__ import annotations

import os
import zlib  # noqa: F401 - the examples below check against it
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from functools import lru_cache

try:  # zlib-ng's CRC-32 (SIMD folding): 12 GB/s on a core here against zlib 1.2.13's 3-4, and it
    # releases the GIL, so the blocks of one save are checksummed side by side
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - a platform without zlib-ng's wheel
    from zlib import crc32

BLOCK = 8 << 20
"""Bytes per read and per CRC task (8 MiB)."""

_POLY = 0xEDB88320
"""The reflected CRC-32 polynomial of zlib."""


def _times(matrix: Sequence[int], vector: int) -> int:
    """A 32x32 matrix over GF(2) (its columns) times a vector."""
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _compose(a: Sequence[int], b: Sequence[int]) -> list[int]:
    return [_times(a, column) for column in b]


@lru_cache(maxsize=8)
def _zeros(length: int) -> tuple[int, ...]:
    """The map that advances a CRC-32 register over ``length`` zero bytes."""
    bit = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    byte = _compose(bit, bit)
    byte = _compose(byte, byte)
    byte = _compose(byte, byte)  # eight zero bits
    result = [1 << n for n in range(32)]
    while length:
        if length & 1:
            result = _compose(byte, result)
        length >>= 1
        if length:
            byte = _compose(byte, byte)
    return tuple(result)


def shift(crc: int, length: int) -> int:
    """``crc`` carried over ``length`` more bytes: ``crc32(a + b) == shift(crc32(a), len(b)) ^ crc32(b)``.

    Example:
        >>> a, b = b"checkpoint ", b"bytes"
        >>> shift(zlib.crc32(a), len(b)) ^ zlib.crc32(b) == zlib.crc32(a + b)
        True
    """
    return _times(_zeros(length), crc) if length else crc


def blocks(offset: int, size: int, step: int | None = None) -> Iterator[tuple[int, int]]:
    """The (offset, size) blocks a range is cut into: a first one of ``size % step`` bytes
    (when not zero), then blocks of ``step`` bytes (:data:`BLOCK` by default)."""
    step = step or BLOCK
    head = size % step
    if head:
        yield offset, head
    for start in range(offset + head, offset + size, step):
        yield start, step


READ = 2 << 20
"""Bytes per read of a range's check (2 MiB). One thread reading a cold file 2 MiB after 2 MiB,
the kernel reading ahead, other threads checksumming, ran at 1.3-1.9 GB/s on the 2-CPU virtual
machine these figures come from, where threads reading and checksumming 8 MiB blocks at once ran
at 0.9-1.3 GB/s (a 101 MB sharded folder written with ``O_DIRECT`` and a 101 MB checkpoint file,
medians of 12 rounds each: 75 against 115 ms, 52 against 76 ms)."""


def range_crcs(fd: int, ranges: Sequence[tuple[int, int]], threads: int) -> list[int | None]:
    """The CRC-32 of each (offset, size) range of the open file ``fd``; None for one that the
    file ends inside. The calling thread reads the ranges in order, :data:`READ` bytes at a time,
    while ``threads`` threads checksum the blocks read (with one, the calling thread does both)."""
    if threads <= 1:
        return _crcs(fd, ranges, None, 1)
    with ThreadPoolExecutor(threads, thread_name_prefix="unison-crc") as pool:
        pool.submit(_zeros, READ)  # the map that carries a CRC over a block, built while the first are read
        return _crcs(fd, ranges, pool, threads + 2)


def _crcs(
    fd: int, ranges: Sequence[tuple[int, int]], pool: Executor | None, buffers: int
) -> list[int | None]:
    """:func:`range_crcs` with ``pool`` checksumming (None: the calling thread), ``buffers`` blocks
    read ahead of the checksums at most."""
    free = [memoryview(bytearray(READ)) for _ in range(buffers)]
    busy: deque[tuple[Future[int], memoryview]] = deque()  # blocks being checksummed, oldest first
    parts: list[list[Future[int] | int] | None] = []
    for offset, size in ranges:
        found: list[Future[int] | int] = []
        for start, length in blocks(offset, size, READ):
            if not free:  # the oldest block's checksum frees its buffer
                done, buffer = busy.popleft()
                done.result()
                free.append(buffer)
            view = free[-1][:length]
            if _read(fd, view, start) < length:
                parts.append(None)
                break
            if pool is None:
                found.append(crc32(view))
            else:
                busy.append((pool.submit(crc32, view), free.pop()))
                found.append(busy[-1][0])
        else:
            parts.append(found)
    crcs: list[int | None] = []
    for cut in parts:  # every block after a range's first is READ bytes long: one map carries them all
        crc: int | None = None
        if cut is not None:
            crc = 0
            for n, part in enumerate(cut):
                value = part if isinstance(part, int) else part.result()
                crc = shift(crc, READ) ^ value if n else value
        crcs.append(crc)
    return crcs


def _read(fd: int, view: memoryview, offset: int) -> int:
    """Reads ``fd`` from ``offset`` into all of ``view``; the bytes read (fewer where the file ends)."""
    read = 0
    while read < len(view):
        n = os.preadv(fd, [view[read:]], offset + read)
        if not n:
            break
        read += n
    return read


def crc_while(view: memoryview, work: Callable[[memoryview], object], pool: Executor) -> int:
    """The CRC-32 of ``view``, computed block by block by ``pool``'s threads while the calling thread
    runs ``work(view)`` (writes it): the checksum costs no time of its own where a core is free.

    Every block is checksummed before this returns, even when ``work`` raises: ``view`` may be a
    buffer that its owner frees right after (``torch.save`` hands over such temporaries).

    Example:
        >>> with ThreadPoolExecutor(2) as pool:
        ...     crc_while(memoryview(b"x" * 10), len, pool) == zlib.crc32(b"x" * 10)
        True
    """
    parts = [pool.submit(crc32, view[start : start + length]) for start, length in blocks(0, len(view))]
    try:
        work(view)
    finally:
        wait(parts)  # no thread reads the buffer once it is handed back
    crc = 0
    for n, part in enumerate(parts):  # every block after the first is BLOCK bytes long
        crc = shift(crc, BLOCK) ^ part.result() if n else part.result()
    return crc
