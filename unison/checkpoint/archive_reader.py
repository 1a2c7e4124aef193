"""Reading an archive's bytes: a file object over an archive (alone in its file or inside another
one) whose reads of a record go straight into the tensor's memory, checksummed as they are read.

``torch.load`` reads each record with one call into the storage it builds. Given
:class:`ParallelReader` instead of a path, that call reads the record in 8 MiB blocks, in order,
in the calling thread (``os.preadv``: threads reading one record's blocks at once ran a 101 MB
resume slower, :meth:`ParallelReader.fill`), the kernel reading ahead of them (the file is opened for
sequential reading; a ``posix_fadvise(WILLNEED)`` of each whole record, tried, made a 101 MB resume
20% slower: the calling thread allocated the record's cache pages before reading any), and hands
each block read to a pool thread that checksums it. A new tensor's pages are given to it by
another thread a few blocks ahead of the read (:class:`~unison.checkpoint.prefault.FaultAhead`):
a read that takes a page fault every 4 KiB ran at half the disk's speed.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from typing import Any

import unison.checkpoint.crc as checksums  # its crc32 looked up at each call: one place to patch in tests
from unison.checkpoint.archive_records import Record
from unison.checkpoint.crc import blocks, shift
from unison.checkpoint.prefault import FROM, FaultAhead, address
from unison.checkpoint.snapshot import default_threads

__all__ = ["READERS", "ParallelReader", "Window", "WindowReader", "reading_pool"]


READERS = 3
"""Threads that checksum an archive's blocks at least, while the calling thread reads the next ones."""


Window = tuple[int, int] | None
"""Where an archive lies in its file: ``(offset, length)``, or None for the whole file."""


class WindowReader(io.RawIOBase):
    """A read-only, seekable file object over bytes ``[offset, offset + length)`` of ``fd`` (all of it
    with no ``window``): an archive, alone in its file or inside another one."""

    def __init__(self, fd: int, window: Window) -> None:
        super().__init__()
        self.fd = fd
        self.base, self.size = window if window is not None else (0, os.fstat(fd).st_size)
        """Where the archive starts in the file, and its bytes."""
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence] + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self.size - self._pos)]
        got = os.preadv(self.fd, [view], self.base + self._pos) if len(view) else 0
        self._pos += got
        return got


class ParallelReader(WindowReader):
    """A read-only file object over ``fd`` that reads in 8 MiB blocks; a read of a whole record of
    ``checked`` (by its start) is checksummed block by block by ``pool``'s threads (with
    ``verify``), its CRC-32 put in :attr:`crcs`. A read of a whole record whose start is in
    ``defer`` reads nothing: the buffer is left untouched and the record kept in :attr:`deferred`,
    to be read later with :meth:`fill`."""

    def __init__(
        self,
        fd: int,
        pool: Executor,
        checked: dict[int, Record],
        faulter: Executor | None = None,
        *,
        verify: bool = True,
        defer: frozenset[int] = frozenset(),
        window: Window = None,
    ) -> None:
        super().__init__(fd, window)
        self.pool = pool
        self.faulter = faulter
        """The thread that faults in a big new buffer's pages ahead of the reads (None: the reads fault them)."""
        self.checked = checked
        self.verify = verify
        self.defer = defer
        self.crcs: dict[int, int] = {}
        """The CRC-32 of each record read whole, by its start."""
        self.deferred: dict[int, Record] = {}
        """The records left unread, by the address of the buffer they were asked into."""

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        record = self.checked.get(self._pos)
        if record is not None and record.start in self.defer and record.size == len(view):
            self.deferred[address(view)] = record
            self._pos += len(view)
            return len(view)
        read = self.fill(view, self._pos)
        self._pos += read
        return read

    def fill(self, view: memoryview, start: int, *, given: bool = False) -> int:
        """Reads the file from ``start`` into all of ``view``; the bytes read (fewer at the file's
        end). A whole record of :attr:`checked` is checksummed as it is read (with ``verify``).

        The blocks are read one after another by the calling thread, in file order: on the 2-CPU
        virtual machine these figures come from, a resume's reads of a cold 101 MB checkpoint in
        one pass took 46 ms so, 61 ms with each record's 8 MiB blocks read by several threads at
        once (their medians over 24 resumes each, alternating); at 1 GB the two ran alike.

        ``given``: the memory has its pages already (a tensor of the run's): none are faulted in
        ahead of the reads.
        """
        record = self.checked.get(start)
        check = self.verify and record is not None and record.crc is not None and record.size == len(view)
        spans = list(blocks(0, len(view)))
        if len(spans) == 1:  # one block: nothing to overlap its checksum with
            read = _read_block(self.fd, view, self.base + start, 0, len(view))
            if check and read == len(view):
                self.crcs[start] = checksums.crc32(
                    view
                )  # here: handing it to a pool thread cost 75 us a record
            return read
        read, crcs = 0, []
        fresh = not given and len(view) >= FROM
        ahead = FaultAhead(view, spans, self.faulter) if fresh and self.faulter is not None else None
        try:
            for n, (at, length) in enumerate(spans):
                if ahead is not None:  # the faulter's thread gives the next blocks their pages meanwhile
                    ahead.before(n)
                got = _read_block(self.fd, view, self.base + start + at, at, length)
                if check:  # checksummed by the pool's threads while the next block is read
                    crcs.append(self.pool.submit(checksums.crc32, view[at : at + got]))
                read += got
                if got < length:  # the file ends inside this block
                    break
        finally:
            if ahead is not None:
                ahead.close()
            wait(crcs)  # no thread touches the buffer once it is handed back
        if check and read == len(view):
            self._combine(start, [part.result() for part in crcs], spans)
        return read

    def _combine(self, start: int, parts: list[Any], spans: list[tuple[int, int]]) -> None:
        """The record's CRC-32 from its blocks' (every block after the first is BLOCK bytes long)."""
        crc = 0
        for n, (part, (_, length)) in enumerate(zip(parts, spans, strict=True)):
            crc = shift(crc, length) ^ part if n else part
        self.crcs[start] = crc


def _read_block(fd: int, view: memoryview, offset: int, at: int, length: int) -> int:
    """Reads ``length`` bytes of ``fd`` from ``offset`` into ``view[at:]``; the bytes read (fewer at the end)."""
    block = view[at : at + length]
    read = 0
    while read < length:
        n = os.preadv(fd, [block[read:]], offset + read)
        if not n:
            break
        read += n
    return read


def reading_pool(threads: int | None = None) -> ThreadPoolExecutor:
    """The threads that read and checksum an archive's blocks: ``threads``, by default
    :func:`~unison.checkpoint.snapshot.default_threads` and at least :data:`READERS`."""
    return ThreadPoolExecutor(threads or max(READERS, default_threads()), thread_name_prefix="unison-read")
