"""Loading a ``torch.save`` archive in one read: each record read straight into its tensor, its
CRC-32 checked by other threads as it is read.

An archive torch wrote is read in one pass, in file order (:mod:`unison.checkpoint.archive_pass`):
its head and tail are read once each and given to ``torch.load``, which builds the state with
every tensor's record left unread (its new memory untouched, so never given pages); then each
record's local header and data are read, one after the other, straight into the run's own tensor
at its key path where one fits it (a resume, ``into``: :mod:`unison.checkpoint.in_place`), into
its new tensor where none does. A read of a few bytes from the middle of the file ahead of that
pass slowed the whole pass: on the 2-CPU virtual machine these figures come from, a cold 101 MB
resume read its file at 1.6 GB/s when ``torch.load`` first read every local header and small
record, and at 2.2 GB/s in one pass (46 against 61 ms, the medians of 24 resumes each, alternating).

Each record is read in 8 MiB blocks by the calling thread, each block checksummed by a pool
thread meanwhile (:mod:`unison.checkpoint.archive_reader`): the file is read once, into the
tensors, and no state is returned before every record's CRC-32 matched the archive's central
directory.

An archive laid out otherwise (another writer's, another byte order) is read as before: ``torch.load``
reads it through :class:`ParallelReader`, the records of a resume's run tensors left unread and
then read in file order.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import zipfile
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import nullcontext
from typing import IO, Any, cast

import torch

import unison.checkpoint.crc as checksums  # its crc32 looked up at each call: one place to patch in tests
from unison.checkpoint.archive_pass import Layout, Member, Refused, layout
from unison.checkpoint.archive_reader import ParallelReader, Window, WindowReader, reading_pool
from unison.checkpoint.archive_records import Record, records, unrecorded_note
from unison.checkpoint.crc import range_crcs
from unison.checkpoint.in_place import FROM as IN_PLACE_FROM
from unison.checkpoint.in_place import Into, plan, put
from unison.checkpoint.prefault import address
from unison.utils.run_files import open_fd

__all__ = ["Damaged", "read_archive", "read_window"]


class Damaged(Exception):
    """The archive's structure is broken or a record's CRC-32 does not match."""


_MISMATCH = "its checksums do not match: a record's CRC-32 differs from the one it recorded"


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


def _read_archive(fd: int, window: Window, verify: bool, into: Into | None, name: str, pool: Executor) -> Any:
    if verify or into is not None:
        state = _read_in_one_pass(fd, window, verify, into, name, pool)
        if state is not _AS_BEFORE:
            return state
    base = window[0] if window is not None else 0
    found, tensors, native = (
        _members(WindowReader(fd, window)) if verify or into is not None else ([], [], False)
    )
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
        raise Damaged(_MISMATCH)
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
    into_run = _Targets(targets, swaps, into, name)
    for pointer, record in sorted(reader.deferred.items(), key=lambda item: item[1].start):
        into_run.fill(reader, pointer, record)
    return into_run.swapped(state)


class _Targets:
    """Where each record left unread goes (``targets``, by the pointer ``torch.load`` gave it), and
    which of the state's tensors become the run's once they are read (``swaps``)."""

    def __init__(
        self,
        targets: dict[int, torch.Tensor],
        swaps: list[tuple[tuple[Any, ...], torch.Tensor]],
        into: Into | None,
        name: str,
    ) -> None:
        self.targets = targets
        self.swaps = swaps
        self.own = {id(tensor) for _, tensor in swaps}
        self.refused: set[int] = set()
        if self.own and into is not None:
            into.files.append(name)

    def fill(self, reader: ParallelReader, pointer: int, record: Record) -> int:
        """Reads ``record`` into its target; the bytes read."""
        target = self.targets[pointer]
        try:
            return reader.fill(_memory(target), record.start, given=id(target) in self.own)
        except OSError as err:  # a read-only tensor of the run's: into the state's own instead
            if err.errno != errno.EFAULT or id(target) not in self.own:
                raise
            self.refused.add(id(target))
            return reader.fill(_memory_at(pointer, record.size), record.start)

    def swapped(self, state: Any) -> Any:
        """``state`` holding the run's tensors read into."""
        for keys, tensor in self.swaps:
            if id(tensor) not in self.refused:
                if keys:
                    put(state, keys, tensor)
                else:
                    state = tensor
        return state


_AS_BEFORE = object()
"""Returned by :func:`_read_in_one_pass` where the archive is read as before."""


class _PassReader(ParallelReader):
    """A :class:`ParallelReader` that gives ``torch.load`` the bytes of ``layout``'s head and tail
    and leaves every tensor's record unread (:meth:`~unison.checkpoint.archive_pass.Layout.serve`),
    keeping each in :attr:`left` by the address of the buffer it was asked into."""

    def __init__(
        self, fd: int, pool: Executor, found: Layout, faulter: Executor, verify: bool, window: Window
    ) -> None:
        super().__init__(fd, pool, {}, faulter, verify=verify, window=window)
        self.layout = found
        self.left: dict[int, Member] = {}
        self.refused = False
        """Whether ``torch.load`` asked for bytes the layout does not serve."""

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        try:
            got = self.layout.serve(view, self._pos)
        except Refused:
            self.refused = True
            raise
        if isinstance(got, Member):
            self.left[address(view)] = got
            got = len(view)
        self._pos += got
        return got


def _read_in_one_pass(
    fd: int, window: Window, verify: bool, into: Into | None, name: str, pool: Executor
) -> Any:
    """The archive read in one pass, in file order (:mod:`unison.checkpoint.archive_pass`): its
    head and tail, ``torch.load`` given them, then each record's local header and data, the data
    straight into its tensor (the run's, for a record of :data:`IN_PLACE_FROM` bytes or more that
    fits it). :data:`_AS_BEFORE` where the archive is not laid out as torch writes it, not in this
    machine's byte order, or ``torch.load`` asked for other bytes: nothing was read into the run's
    tensors then."""
    raw = WindowReader(fd, window)
    base = raw.base
    try:
        with zipfile.ZipFile(raw) as archive:
            found = layout(fd, base, raw.size, archive)
    except (zipfile.BadZipFile, EOFError, ValueError) as err:
        raise Damaged(f"its structure is broken ({err})") from err
    if found is None or not found.native:
        return _AS_BEFORE
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, base, window[1] if window is not None else 0, os.POSIX_FADV_SEQUENTIAL)
    with ThreadPoolExecutor(1, thread_name_prefix="unison-fault") as faulter:  # started at its first task
        reader = _PassReader(fd, pool, found, faulter, verify, window)
        try:
            state = torch.load(cast(IO[bytes], reader), map_location="cpu", weights_only=True)
        except Exception:
            if reader.refused:
                return _AS_BEFORE
            raise
        if reader.refused or len(reader.left) != sum(1 for m in found.members if m.size):
            return _AS_BEFORE
        big = {pointer for pointer, member in reader.left.items() if member.size >= IN_PLACE_FROM}
        targets, swaps = plan(state, into.tensors, big) if into is not None else ({}, [])
        small, _ = plan(state, None, set(reader.left) - set(targets))
        targets.update(small)
        if len(targets) != len(reader.left):
            return _AS_BEFORE  # a record the state does not reach: torch reads it all
        into_run = _Targets(targets, swaps, into, name)
        pointers = {member.offset: pointer for pointer, member in reader.left.items()}
        for member in found.members:  # in file order
            start = found.start(fd, base, member)
            if start is None:
                raise Damaged("a record is not where the central directory says, or does not fit the file")
            if not member.size:
                continue
            record = Record(start, member.size, member.crc)
            reader.checked[start] = record
            if into_run.fill(reader, pointers[member.offset], record) != member.size:
                raise Damaged("a record does not fit the file")
        state = into_run.swapped(state)
    if not verify:
        return state
    wrong = any(r.crc is not None and checksums.crc32(data) != r.crc for r, data in found.others) or any(
        m.crc is not None and (reader.crcs.get(found.starts[m.offset]) if m.size else 0) != m.crc
        for m in found.members
    )
    if wrong:
        raise Damaged(_MISMATCH)
    if window is None and (
        any(r.crc is None for r, _ in found.others) or any(m.crc is None for m in found.members)
    ):
        unrecorded_note(name)
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
