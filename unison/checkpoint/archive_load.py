"""Loading a ``torch.save`` archive in one read: each record read straight into its tensor, its
CRC-32 checked by other threads as it is read.

``torch.load`` reads a record with one call into the storage it builds. Given a file object
(:class:`ParallelReader`) instead of a path, that call reads the record into the new tensor in
8 MiB blocks, in order, the kernel reading ahead of them (the file is opened for sequential
reading; a ``posix_fadvise(WILLNEED)`` of each whole record, tried, made a 101 MB resume 20%
slower: the calling thread allocated the record's cache pages before reading any), in
the calling thread (``os.preadv``: threads reading into one new tensor at once contend for its
page faults), and hands each block read to a pool thread that checksums it: the file is read
once, into the tensors, and no state is returned before every record's CRC-32 matched the
archive's central directory. The new tensor's pages are given to it by another thread a few
blocks ahead of the read (:class:`~unison.checkpoint.prefault.FaultAhead`): a read that takes
a page fault every 4 KiB ran at half the disk's speed.

A resume goes further (``into``, :mod:`unison.checkpoint.in_place`): ``torch.load`` builds the
state with its big records left unread (their new memory untouched, so never given pages), and
each is then read, in file order, straight into the run's own tensor at its key path where one
fits it (its blocks read by several threads at once: that memory has its pages), into its new
tensor where none does.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import sys
import zipfile
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import IO, Any, cast

import torch

import unison.checkpoint.crc as checksums  # its crc32 looked up at each call: one place to patch in tests
from unison.checkpoint.archive_records import Record, records, unrecorded_note
from unison.checkpoint.crc import blocks, range_crcs, shift
from unison.checkpoint.in_place import FROM as IN_PLACE_FROM
from unison.checkpoint.in_place import Into, plan, put
from unison.checkpoint.prefault import FROM, FaultAhead, address
from unison.checkpoint.snapshot import default_threads
from unison.utils.run_files import open_fd

__all__ = ["Damaged", "ParallelReader", "read_archive", "read_window"]


READERS = 3
"""Threads a resume's reads into the run's own tensors use at least: the disk is given three 8 MiB
reads at once. Measured here on a cold 1 GB file, three threads reading 32 MiB each at once ran at
1.5-1.7 GB/s through the page cache, one thread reading 8 MiB after 8 MiB at 0.9-1.0; on another
day, in the resume itself, three threads and one ran alike (1.7-1.9 against 1.6-1.9 GB/s), the
disk's speed moving more than either."""


Window = tuple[int, int] | None
"""Where an archive lies in its file: ``(offset, length)``, or None for the whole file."""


class Damaged(Exception):
    """The archive's structure is broken or a record's CRC-32 does not match."""


class _Window(io.RawIOBase):
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


class ParallelReader(_Window):
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

        ``given``: the memory has its pages already (a tensor of the run's): its blocks are read by
        the pool's threads at once, each checksumming its own, with no page fault to contend for.
        """
        record = self.checked.get(start)
        check = self.verify and record is not None and record.crc is not None and record.size == len(view)
        spans = list(blocks(0, len(view)))
        if given and len(spans) > 1:
            return self._fill_at_once(view, start, spans, check)
        read, crcs = 0, []
        ahead = FaultAhead(view, spans, self.faulter) if self.faulter and len(view) >= FROM else None
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

    def _fill_at_once(self, view: memoryview, start: int, spans: list[tuple[int, int]], check: bool) -> int:
        def block(at: int, length: int) -> tuple[int, int | None]:
            got = _read_block(self.fd, view, self.base + start + at, at, length)
            return got, checksums.crc32(view[at : at + got]) if check else None

        parts = [self.pool.submit(block, at, length) for at, length in spans]
        wait(parts)  # no thread touches the buffer once it is handed back
        done = [part.result() for part in parts]
        read = 0
        for (got, _), (_, length) in zip(done, spans, strict=True):
            read += got
            if got < length:  # the file ends inside this block: what follows it was not read
                break
        if check and read == len(view):
            self._combine(start, [crc for _, crc in done], spans)
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


def read_archive(
    path: str | os.PathLike[str], *, verify: bool = True, threads: int | None = None, into: Into | None = None
) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``, the file read once; with
    ``verify``, its blocks checksummed by ``threads`` threads as they are read (default
    :func:`~unison.checkpoint.snapshot.default_threads`, at least :data:`READERS`) and every
    record's CRC-32 checked (or, for an archive written without them, its structure) before the
    state is returned.

    With ``into`` (the run's own tensors, :class:`~unison.checkpoint.in_place.Into`), each record
    of :data:`~unison.checkpoint.in_place.FROM` bytes or more that fits the run's tensor at its key
    path is read into that tensor, and the state holds that tensor; the file is then listed in
    ``into.files`` (before the check: a damaged file has written them too).

    Raises:
        Damaged: the archive's structure is broken, or a record's CRC-32 does not match.
        Exception: whatever ``torch.load`` raises for a file it cannot read.
    """
    with os.fdopen(open_fd(path), "rb", buffering=0) as raw, reading_pool(threads) as pool:
        return _read_any(raw.fileno(), None, verify, into, str(path), pool)


def read_window(
    fd: int,
    offset: int,
    length: int,
    *,
    verify: bool = True,
    into: Into | None = None,
    pool: Executor | None = None,
) -> Any:
    """:func:`read_archive` of the ``torch.save`` archive held in bytes ``[offset, offset + length)`` of
    the open file ``fd`` (a Distributed Checkpoint's file holds one per tensor). With ``into``
    whose :attr:`~unison.checkpoint.in_place.Into.tensors` is a tensor, an archive of one tensor
    of 1 MiB or more that fits it is read straight into it, and that tensor is returned.

    ``pool``: the threads that read and checksum its blocks, kept by the caller from one archive
    to the next (a DCP file holds dozens; starting the threads anew for each cost a sharded
    resume of 1 GB 58 ms here). None: threads of its own, as :func:`read_archive`'s.

    A record without a CRC-32 is read without a note about it: unison's sharded saves write none
    (the folder's ``checksums.json`` covers every file and is checked before a load), and a note
    per item would come at every resume."""
    name = f"bytes {offset}-{offset + length} of a file"
    with nullcontext(pool) if pool is not None else reading_pool() as threads:
        return _read_any(fd, (offset, length), verify, into, name, threads)


class _Unplaced(Exception):
    """A record left unread belongs to no tensor of the loaded state."""


def _read_any(fd: int, window: Window, verify: bool, into: Into | None, name: str, pool: Executor) -> Any:
    try:
        return _read_archive(fd, window, verify, into, name, pool)
    except _Unplaced:  # a record left unread that the state does not hold: read it all as torch does
        return _read_archive(fd, window, verify, None, name, pool)


def reading_pool(threads: int | None = None) -> ThreadPoolExecutor:
    """The threads that read and checksum an archive's blocks: ``threads``, by default
    :func:`~unison.checkpoint.snapshot.default_threads` and at least :data:`READERS`."""
    return ThreadPoolExecutor(threads or max(READERS, default_threads()), thread_name_prefix="unison-read")


def _read_archive(fd: int, window: Window, verify: bool, into: Into | None, name: str, pool: Executor) -> Any:
    base = window[0] if window is not None else 0
    found, tensors, native = _members(_Window(fd, window)) if verify or into is not None else ([], [], False)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, base, window[1] if window is not None else 0, os.POSIX_FADV_SEQUENTIAL)
    with ThreadPoolExecutor(1, thread_name_prefix="unison-fault") as faulter:  # started at its first task
        big = (r.start for r in tensors if r.size >= IN_PLACE_FROM)
        defer = frozenset(big) if into is not None and native else frozenset()
        reader = ParallelReader(
            fd, pool, {r.start: r for r in found}, faulter, verify=verify, defer=defer, window=window
        )
        state = torch.load(cast(IO[bytes], reader), map_location="cpu", weights_only=True)
        if reader.deferred:
            state = _read_deferred(reader, state, cast(Into, into), name)
    if not verify:
        return state
    left = [r for r in found if r.crc is not None and r.start not in reader.crcs]  # not read whole by torch
    crcs = dict(
        zip(
            (r.start for r in left),
            range_crcs(fd, [(base + r.start, r.size) for r in left], 1),
            strict=True,
        )
    )
    crcs.update(reader.crcs)
    if any(r.crc is not None and crcs.get(r.start) != r.crc for r in found):
        raise Damaged("its checksums do not match: a record's CRC-32 differs from the one it recorded")
    if window is None and any(r.crc is None for r in found):  # a window: a DCP item (see read_window)
        unrecorded_note(name)
    return state


def _read_deferred(reader: ParallelReader, state: Any, into: Into, name: str) -> Any:
    """Reads the records ``torch.load`` left unread, in file order: each into the run's tensor that
    :func:`~unison.checkpoint.in_place.plan` pairs it with (which then takes its place in
    ``state``; a state that is one tensor is replaced whole), else into its own new tensor."""
    targets, swaps = plan(state, into.tensors, set(reader.deferred))
    if len(targets) != len(reader.deferred):
        raise _Unplaced
    own = {id(tensor) for _, tensor in swaps}
    if own:
        into.files.append(name)
    refused: set[int] = set()
    for pointer, record in sorted(reader.deferred.items(), key=lambda item: item[1].start):
        target = targets[pointer]
        try:
            reader.fill(_memory(target), record.start, given=id(target) in own)
        except OSError as err:  # a read-only tensor of the run's: into the state's own instead
            if err.errno != errno.EFAULT or id(target) not in own:
                raise
            refused.add(id(target))
            reader.fill(_memory_at(pointer, record.size), record.start)
    for keys, tensor in swaps:
        if id(tensor) not in refused:
            if keys:
                put(state, keys, tensor)
            else:
                state = tensor
    return state


def _memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s storage, writable."""
    storage = tensor.untyped_storage()
    return _memory_at(storage.data_ptr(), storage.nbytes())


def _memory_at(pointer: int, size: int) -> memoryview:
    """``size`` writable bytes of this process's memory from ``pointer`` (a live storage's)."""
    return memoryview((ctypes.c_char * size).from_address(pointer)).cast("B")


def _members(raw: Any) -> tuple[list[Record], list[Record], bool]:
    """The archive's records, from its central directory; those of them that hold a storage's
    bytes; and whether ``torch.load`` leaves those bytes as they are (the archive was written in
    this machine's byte order, which this torch keeps). Raises :class:`Damaged` when its structure
    is broken."""
    try:
        with zipfile.ZipFile(raw) as archive:
            found = records(raw, archive)
            infos = sorted(archive.infolist(), key=lambda info: info.header_offset)  # as records() lists them
    except (zipfile.BadZipFile, EOFError, ValueError) as err:
        raise Damaged(f"its structure is broken ({err})") from err
    if found is None:
        raise Damaged("a record is not where the central directory says, or does not fit the file")
    orders = [r for info, r in zip(infos, found, strict=True) if info.filename.endswith("/byteorder")]
    order = b""
    if len(orders) == 1:
        raw.seek(orders[0].start)
        order = raw.read(min(orders[0].size, 8))
    native = order == sys.byteorder.encode() and torch.serialization.get_default_load_endianness() is None
    tensors = [r for info, r in zip(infos, found, strict=True) if "/data/" in info.filename]
    return found, tensors, native
