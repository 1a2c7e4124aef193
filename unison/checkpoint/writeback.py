"""A file written at the disk's speed: large writes, and the disk's writeback started as the bytes come.

``torch.save`` hands its writer one call per record: a header of a few dozen bytes, then
a tensor's bytes. Written as they come to an unbuffered file, small pieces become one
system call each and big ones go to the page cache without a copy; but the kernel writes
nothing to the disk until the final ``fsync``, so serialising and writing would follow
each other instead of overlapping. :class:`WritebackFile` gathers the small pieces into
one write, passes the big ones through, and every :data:`WRITEBACK` bytes asks the kernel
to start writing what it holds (``posix_fadvise(POSIX_FADV_DONTNEED)`` starts the
writeback of a file's dirty pages without waiting for it): by the ``fsync`` most of the
file is on the disk already, and the ``fsync`` still waits for every byte.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import unison.checkpoint.crc as checksums  # its crc32 looked up at each call: one place to patch in tests
from unison.checkpoint.crc import crc_while

WRITEBACK = 32 << 20
"""Bytes written between two starts of the disk's writeback (32 MiB)."""
SMALL = 1 << 16
"""Writes below this many bytes are gathered into one (64 KiB)."""
PARALLEL = 1 << 20
"""Writes from this many bytes on are checksummed by other threads while they are written (1 MiB)."""


class WritebackFile:
    """The file object a durable write writes to: ``write`` and ``flush`` over a raw binary file.

    Args:
        raw: an unbuffered binary file (``os.fdopen(fd, "wb", buffering=0)``) whose
            ``write`` may write fewer bytes than given.
        writeback: bytes between two starts of the writeback (default :data:`WRITEBACK`);
            0 never starts it.
    """

    def __init__(self, raw: Any, *, writeback: int | None = None) -> None:
        self.raw = raw
        self.writeback = WRITEBACK if writeback is None else writeback
        self.written = 0
        """Bytes handed to the file so far."""
        self._started = 0  # the first byte whose writeback has not been started
        self._small = bytearray()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if size < SMALL:
            self._small += view
            if len(self._small) >= SMALL:
                self._drain()
            return size
        self._drain()
        self._put(view)
        return size

    def write_crc(self, data: Any, pool: Executor) -> int:
        """Writes ``data`` as :meth:`write` does and returns its CRC-32 (:func:`written_crc`)."""
        return written_crc(memoryview(data).cast("B"), self.write, pool)

    def restart(self) -> None:
        """Empties the file, to write it again from its first byte."""
        self._small = bytearray()
        self.raw.seek(0)
        self.raw.truncate(0)
        self.written = self._started = 0

    def flush(self) -> None:
        """Writes the gathered small pieces; the data is then in the kernel's hands (not yet durable)."""
        self._drain()

    def close(self) -> None:
        """Nothing to release (the caller closes ``raw``): as :meth:`DirectFile.close
        <unison.checkpoint.direct.DirectFile.close>`, so that a durable write closes either alike."""

    def _drain(self) -> None:
        if self._small:
            small, self._small = self._small, bytearray()
            self._put(memoryview(small))

    def _put(self, view: memoryview) -> None:
        while len(view):
            n = self.raw.write(view[: max(self.writeback, SMALL)])
            view = view[n:]
            self.written += n
            if self.writeback and self.written - self._started >= self.writeback:
                start_writeback(self.raw.fileno(), self._started, self.written - self._started)
                self._started = self.written


def written_crc(view: memoryview, write: Callable[[memoryview], object], pool: Executor) -> int:
    """Writes ``view`` with ``write`` and returns its CRC-32: a buffer of :data:`PARALLEL` bytes or
    more is checksummed by ``pool``'s threads while this thread writes it
    (:func:`unison.checkpoint.crc.crc_while`), a smaller one after."""
    if len(view) < PARALLEL:
        write(view)
        return checksums.crc32(view)
    return crc_while(view, write, pool)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Asks the kernel to start writing ``length`` bytes of ``fd`` from ``offset`` to the disk, without
    waiting (a no-op where ``posix_fadvise`` is missing). Nothing is made durable by this: the
    final ``fsync`` is what waits for the disk."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:  # pragma: no cover - macOS, Windows
        return
    try:
        advise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:  # pragma: no cover - a file system that refuses the advice: the fsync still writes all
        pass
