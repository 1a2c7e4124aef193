"""A checkpoint file written around the page cache: ``O_DIRECT`` writes from aligned staging buffers.

A buffered write copies every byte into the page cache: the kernel finds a page for it (on a
machine whose memory is full of cache, by reclaiming one), copies, marks it dirty, writes it
back and frees it again. Measured on a 2-CPU virtual machine, writing 1 GB of a model's memory
that way cost 0.3 to 3 CPU-seconds of kernel time and ran at 0.35 to 1.7 GB/s; the same bytes
written with ``O_DIRECT`` from aligned memory cost 0.02 CPU-seconds at 2.5 to 3.5 GB/s.

:class:`DirectFile` copies what it is handed into a few :data:`CHUNK`-byte page-aligned buffers
and, as each one fills, a writer thread writes it with ``O_DIRECT`` at its place in the file
while the next one fills: every byte is copied once, in user space, into memory that stays in
the CPU's caches, and the disk always has a write to do. What is left at the end (the last
partial buffer) goes through the page cache. ``O_DIRECT`` skips the page cache, not the disk's
own write cache: the ``fsync`` that follows every durable write
(:func:`unison.checkpoint.io.fsync_dir` and its caller) is still what makes the file durable,
and it waits for every byte.

Where the file system refuses ``O_DIRECT`` (at open or at the first write) the buffers are
written through the page cache instead, their writeback started as they go
(:func:`~unison.checkpoint.writeback.start_writeback`); where the platform has no ``O_DIRECT``,
:func:`open_sink` hands out a :class:`~unison.checkpoint.writeback.WritebackFile`.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import unison.checkpoint.crc as checksums  # its crc32 looked up at each call: one place to patch in tests
from unison.checkpoint.crc import shift
from unison.checkpoint.writeback import WritebackFile, start_writeback, written_crc

__all__ = ["CHUNK", "DIRECT_FROM", "DirectFile", "direct_available", "open_sink"]

CHUNK = 16 << 20
"""Bytes per staging buffer and per ``O_DIRECT`` write (16 MiB). What is left after the last full
buffer goes through the page cache: a smaller buffer keeps that tail small in files of tens of
MB (a rank's shard of a sharded checkpoint, a background save of a small model)."""
DEPTH = 6
"""Buffers written at once while the next one fills. What the disk is given at once decides its
speed: measured here on 1 GB saves (8 interleaved rounds, medians), two 16 MiB writes in flight
ran at 0.59-0.80x the disk's own speed (one 8 MiB ``O_DIRECT`` write after another from one
buffer), two of 32 MiB at 0.78-0.94x, and 96-128 MiB in flight (6 x 16, 3 x 32, 4 x 32,
2 x 64 MiB) at 0.88-0.94x, with no order among them beyond the noise. Seven buffers are kept
from file to file (112 MiB)."""
DIRECT_FROM = 128 << 20
"""Files of this many bytes on are written with ``O_DIRECT`` (128 MiB). A smaller one fits the page
cache's dirty limits whole: measured here, 101 and 160 MB files went out through the page cache at
1.1-1.5x the speed of ``O_DIRECT``'s pipeline, whose last two buffers must still go out after the
last byte is copied; from 256 MB on the page cache fell to 0.28-0.57x the disk, ``O_DIRECT`` held
0.66-0.78x. A background save is written with ``O_DIRECT`` whatever its size: while training
runs beside it, a 101 MB file was durable after 90-95 ms that way, after 115-270 ms through the
page cache."""
_O_DIRECT: int | None = getattr(os, "O_DIRECT", None)
_SPARE_LIMIT = DEPTH + 1
_spare: list[mmap.mmap] = []  # staging buffers kept from one file to the next: their pages stay mapped
_spare_lock = threading.Lock()


def direct_available() -> bool:
    """Whether this platform has ``O_DIRECT`` (a file system may still refuse it: :class:`DirectFile`
    then writes through the page cache)."""
    return _O_DIRECT is not None


def open_sink(
    raw: Any, path: str | os.PathLike[str], size: int = 0, direct: bool | None = None
) -> DirectFile | WritebackFile:
    """The file object a durable write of about ``size`` bytes to ``path`` (opened as the unbuffered
    ``raw``) writes to: a :class:`DirectFile` from :data:`DIRECT_FROM` bytes on (or whatever the
    size, with ``direct=True``; never, with ``False``) where this platform has ``O_DIRECT``, else a
    :class:`~unison.checkpoint.writeback.WritebackFile`."""
    wanted = size >= DIRECT_FROM if direct is None else direct
    if not wanted or not direct_available():
        return WritebackFile(raw)
    return DirectFile(raw, path)


def _buffer(size: int) -> mmap.mmap:
    with _spare_lock:
        for n, spare in enumerate(_spare):
            if len(spare) == size:
                return _spare.pop(n)
    return mmap.mmap(-1, size)  # page-aligned, as O_DIRECT asks of memory


def _keep(buffer: mmap.mmap) -> None:
    with _spare_lock:
        if len(_spare) < _SPARE_LIMIT:
            _spare.append(buffer)
            return
    try:
        buffer.close()
    except BufferError:  # a view of it is still alive somewhere: unmapped when that goes
        pass


class DirectFile:
    """The file object a durable write writes to: ``write``, ``write_crc``, ``flush``, ``restart``
    and ``close`` over the unbuffered binary file ``raw`` opened at ``path``.

    Bytes are gathered into staging buffers of ``chunk`` bytes (a multiple of 4096); each full
    buffer is written at its offset with ``O_DIRECT`` by a writer thread, up to ``depth`` at once.
    :meth:`flush` waits for them and writes the last partial buffer through ``raw``: the file
    then holds every byte handed to it, in the kernel's hands, not yet durable.

    Args:
        raw: the file, opened for writing, unbuffered (``os.fdopen(fd, "wb", buffering=0)``).
        path: where it is, to open it once more with ``O_DIRECT``.
        chunk: bytes per staging buffer and per direct write (default :data:`CHUNK`).
        depth: direct writes in flight at once (default :data:`DEPTH`).
        checksum: also compute the CRC-32 of the whole file as it is written (:attr:`crc`), each
            full buffer's by the writer thread that writes it.
    """

    def __init__(
        self,
        raw: Any,
        path: str | os.PathLike[str],
        *,
        chunk: int = CHUNK,
        depth: int = DEPTH,
        checksum: bool = False,
    ) -> None:
        if chunk <= 0 or chunk % 4096:
            raise ValueError(f"DirectFile: chunk={chunk} must be a positive multiple of 4096 (a page)")
        self.raw = raw
        self.path = Path(path)
        self.chunk = chunk
        self.depth = max(1, depth)
        self.written = 0
        """Bytes handed to the file so far."""
        self.direct = _O_DIRECT is not None
        """Whether full buffers go out with ``O_DIRECT``; False once the file system refused it."""
        self._fd: int | None = None  # the O_DIRECT descriptor, opened at the first full buffer
        self._writers: ThreadPoolExecutor | None = None
        self._inflight: deque[tuple[Future[None], mmap.mmap]] = deque()
        self._current: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._fill = 0  # bytes in the current buffer
        self._base = 0  # the file offset of the current buffer's first byte
        self._cached = 0  # bytes of the current buffer a flush wrote through the page cache
        self.checksum = checksum
        self._crcs: dict[int, int] = {}  # the CRC-32 of each full buffer, by its offset

    # -- the file object torch's writers and CrcFiller write to

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._put(view)
        return len(view)

    def write_crc(self, data: Any, pool: Executor) -> int:
        """Writes ``data`` as :meth:`write` does and returns its CRC-32
        (:func:`~unison.checkpoint.writeback.written_crc`: a big buffer checksummed by ``pool``'s
        threads while this thread copies it)."""
        return written_crc(memoryview(data).cast("B"), self._put, pool)

    def flush(self) -> None:
        """Waits for every direct write and writes the current partial buffer through the page cache:
        the file then holds every byte written so far (not yet durable: the caller fsyncs)."""
        self._wait(0)
        if self._fill > self._cached and self._view is not None:
            _pwrite_all(self.raw.fileno(), self._view[self._cached : self._fill], self._base + self._cached)
            self._cached = self._fill

    @property
    def crc(self) -> int:
        """The CRC-32 of every byte written so far (with ``checksum=True``)."""
        if not self.checksum:
            raise ValueError("DirectFile.crc: the file was opened without checksum=True")
        self._wait(0)
        crc = 0
        for n, offset in enumerate(sorted(self._crcs)):  # every full buffer is `chunk` bytes long
            crc = shift(crc, self.chunk) ^ self._crcs[offset] if n else self._crcs[offset]
        if self._fill and self._view is not None:
            crc = checksums.crc32(self._view[: self._fill], crc)
        return crc

    def restart(self) -> None:
        """Empties the file, to write it again from its first byte."""
        self._wait(0)
        self._crcs.clear()
        self._fill = self._base = self._cached = self.written = 0
        self.raw.seek(0)
        self.raw.truncate(0)

    def close(self) -> None:
        """Waits for the writes in flight, closes the direct descriptor, keeps the buffers for the next file."""
        try:
            self._wait(0)
        finally:
            if self._writers is not None:
                self._writers.shutdown(wait=True)
                self._writers = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            while self._inflight:
                _keep(self._inflight.popleft()[1])
            if self._current is not None:
                self._view = None
                _keep(self._current)
                self._current = None

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- staging

    def _put(self, view: memoryview) -> None:
        while len(view):
            if self._current is None or self._view is None:
                self._current = _buffer(self.chunk)
                self._view = memoryview(self._current)
            n = min(len(view), self.chunk - self._fill)
            self._view[self._fill : self._fill + n] = view[:n]
            self._fill += n
            self.written += n
            view = view[n:]
            if self._fill == self.chunk:
                self._send()

    def _send(self) -> None:
        """Hands the full current buffer to a writer thread and starts a new one."""
        assert self._current is not None
        full, offset = self._current, self._base
        self._view = None
        self._current = None
        self._base += self._fill
        self._fill = self._cached = 0
        self._wait(self.depth - 1)
        if self._writers is None:
            self._writers = ThreadPoolExecutor(self.depth, thread_name_prefix="unison-direct")
        fd = self._direct_fd()
        self._inflight.append((self._writers.submit(self._write_out, full, offset, fd), full))

    def _wait(self, left: int) -> None:
        """Waits until at most ``left`` writes are in flight; a failed write raises here."""
        while len(self._inflight) > left:
            future, buffer = self._inflight.popleft()
            try:
                future.result()
            finally:
                _keep(buffer)

    def _write_out(self, buffer: mmap.mmap, offset: int, fd: int | None) -> None:
        """Writes one full buffer at ``offset``: with ``O_DIRECT`` (``fd``) while the file system takes it."""
        view = memoryview(buffer)
        try:
            if self.checksum:
                self._crcs[offset] = checksums.crc32(view)
            if fd is not None and self.direct:
                try:
                    _pwrite_all(fd, view, offset)
                    return
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    self.direct = False  # refused: this buffer and the rest go through the page cache
            _pwrite_all(self.raw.fileno(), view, offset)
            start_writeback(self.raw.fileno(), offset, len(view))
        finally:
            view.release()

    def _direct_fd(self) -> int | None:
        """The ``O_DIRECT`` descriptor, opened at the first full buffer; None where it is refused."""
        if self._fd is None and self.direct:
            flags = (
                os.O_WRONLY | (_O_DIRECT or 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
            )
            try:
                fd = os.open(self.path, flags)  # a link put in the file's place is refused, not followed
            except OSError:  # a file system without O_DIRECT (some FUSE and network ones)
                self.direct = False
                return None
            if not os.path.samestat(os.fstat(fd), os.fstat(self.raw.fileno())):
                os.close(fd)  # the name now holds another file: every byte goes to the one opened
                self.direct = False
                return None
            self._fd = fd
        return self._fd


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Writes all of ``view`` at ``offset`` of ``fd`` (a short write is continued; a disk that is full
    raises ``OSError(ENOSPC)``)."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:  # pragma: no cover - pwrite reports a full disk by raising
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n
