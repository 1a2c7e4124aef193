"""CRC-32s of ranges of a file, read and computed by several threads at once.

A checkpoint's integrity check computes the CRC-32 of every record of its archive. One
thread that reads a block and then computes its CRC leaves the disk idle while it computes,
and a CRC-32 on one core (3-4 GB/s with zlib, 12 GB/s with zlib-ng's :func:`crc32`, which this
module exports and every checkpoint module uses) is slower than a fast disk: here each range
is cut into blocks that threads read (``os.preadv``) and checksum at once (both release the
GIL), and the blocks' CRCs are combined into the range's. Combining needs the CRC of a
block's length of zeros as a linear map (:func:`shift`, as zlib's ``crc32_combine``): every
range is cut so that each block appended after its first is :data:`BLOCK` bytes long, and
that one map serves them all.
"""

from __future__ import annotations

import os
import zlib  # noqa: F401 - the examples below check against it
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from functools import lru_cache
from threading import local

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


def blocks(offset: int, size: int) -> Iterator[tuple[int, int]]:
    """The (offset, size) blocks a range is cut into: a first one of ``size % BLOCK`` bytes
    (when not zero), then blocks of :data:`BLOCK` bytes."""
    head = size % BLOCK
    if head:
        yield offset, head
    for start in range(offset + head, offset + size, BLOCK):
        yield start, BLOCK


def range_crcs(fd: int, ranges: Sequence[tuple[int, int]], threads: int) -> list[int | None]:
    """The CRC-32 of each (offset, size) range of the open file ``fd``; None for one that the
    file ends inside. Blocks are read and checksummed by ``threads`` threads."""
    tasks = [
        (i, start, length)
        for i, (offset, size) in enumerate(ranges)
        for start, length in blocks(offset, size)
    ]
    crcs: list[int | None] = [0] * len(ranges)
    begun = [False] * len(ranges)
    buffers = local()

    def crc(task: tuple[int, int, int]) -> int | None:
        _, start, length = task
        buffer = getattr(buffers, "block", None)
        if buffer is None:
            buffer = buffers.block = memoryview(bytearray(BLOCK))
        view = buffer[:length]
        read = 0
        while read < length:
            n = os.preadv(fd, [view[read:]], start + read)
            if not n:
                return None
            read += n
        return crc32(view)

    def combine(values: Iterator[int | None]) -> list[int | None]:
        for (i, _, length), value in zip(tasks, values, strict=True):
            so_far = crcs[i]
            if value is None or so_far is None:
                crcs[i] = None
            else:  # every block after a range's first is BLOCK bytes long: one map carries them all
                crcs[i] = shift(so_far, length) ^ value if begun[i] else value
            begun[i] = True
        return crcs

    if threads <= 1 or len(tasks) <= 1:  # nothing to overlap: no threads to start
        return combine(map(crc, tasks))
    with ThreadPoolExecutor(threads, thread_name_prefix="unison-crc") as pool:
        if len(tasks) > len(ranges):  # some block follows another: its map is built while the first are read
            pool.submit(_zeros, BLOCK)
        return combine(pool.map(crc, tasks))


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
