"""Where a ``torch.save`` archive's bytes lie, so that it can be read in one pass, in file order.

``torch.load`` reads an archive in the order of its pickle: each tensor's record is found through
its local header, which lies just before the record's data, spread over the whole file. A resume
that reads the records' data later, in file order, straight into the run's tensors
(:mod:`unison.checkpoint.in_place`), still had ``torch.load`` read every local header and every
small record first, each from another part of the file. On the 2-CPU virtual machine these
figures come from, a cold 101 MB checkpoint read in file order, headers and all, took 40.8 ms;
the same reads with the headers and small records read first took 58.6 ms, though those few
small reads took 5 ms themselves: the disk read the rest slower after them.

:func:`layout` finds, from the central directory, the archive's head (everything before the
first tensor's record: ``data.pkl``, ``byteorder`` and the like) and its tail (everything after
the last one, and at least its last :data:`TAIL` bytes), and reads each once. :meth:`Layout.serve`
then answers ``torch.load``'s reads without reading the middle of the file:

- a read inside the head or the tail, from those bytes;
- a tensor record's local header outside both, with a header of no extra field: torch's reader
  takes where the data start from the local header's two lengths only, so it then asks for the
  record's data at that place, which :meth:`Layout.serve` recognises and leaves unread;
- any other read (a torch that reads some other way) raises :class:`Refused`, before anything is
  read into the run's tensors, and the archive is read as before.

Each record's real local header is read just before its data, in file order, and checked
against the central directory (:func:`~unison.checkpoint.archive_records.local_start`).
"""

from __future__ import annotations

import os
import sys
import zipfile
from typing import NamedTuple

import torch

from unison.checkpoint.archive_records import LOCAL_HEADER, Record, local_start, recorded_crc

__all__ = ["TAIL", "Layout", "Member", "Refused", "layout"]

TAIL = 4096
"""Bytes at an archive's end read with its tail at least: torch's reader (miniz) looks for the end
of the central directory in the last 4 KiB."""
SLACK = 128
"""Bytes read past a local header's name for its extra field: torch writes 4 bytes and up to 63 of
padding, and 28 more for a record past 4 GiB. A longer one is read with a second read."""


class Refused(Exception):
    """``torch.load`` asked for bytes that a one-pass read does not serve."""


class Member(NamedTuple):
    """A tensor's record: its local header's offset, its name, its size and CRC-32 (None: not recorded)."""

    offset: int
    name: bytes
    size: int
    crc: int | None


class Layout:
    """An archive's head and tail bytes, its tensors' records (:attr:`members`, in file order) and
    its other records (:attr:`others`, each with its bytes)."""

    def __init__(
        self,
        size: int,
        head: bytes,
        tail_at: int,
        tail: bytes,
        members: list[Member],
        starts: dict[int, int],
        others: list[tuple[Record, bytes]],
        native: bool,
    ) -> None:
        self.size = size
        self.head = head
        self.tail_at = tail_at
        self.tail = tail
        self.members = members
        self.others = others
        """The records that are not a tensor's, each with its data (they lie in the head or the tail)."""
        self.native = native
        """Whether ``torch.load`` leaves the records' bytes as they are (this machine's byte order)."""
        self.starts = dict(starts)
        """Where each member's data start, by its offset, once its local header was read."""
        self._whole = head + tail if tail_at == len(head) else None
        """A small archive's bytes: its head and tail are all of it."""
        self._headers: dict[int, bytes] = {}
        self._asked: dict[int, Member] = {}
        for member in members:
            if member.offset in starts:
                self._asked[starts[member.offset]] = member
            else:
                name = len(member.name)
                self._headers[member.offset] = LOCAL_HEADER.pack(b"PK\x03\x04", name, 0)
                self._asked[member.offset + LOCAL_HEADER.size + name] = member

    def serve(self, view: memoryview, pos: int) -> int | Member:
        """Fills ``view`` with the archive's bytes from ``pos``; the bytes given, or the member
        whose data ``torch.load`` asked for whole (left unread). Raises :class:`Refused` for bytes
        neither the head nor the tail holds."""
        n = len(view)
        member = self._asked.get(pos)
        if member is not None and n == member.size and n:
            return member
        header = self._headers.get(pos)
        if header is not None and n <= len(header):
            view[:] = header[:n]
            return n
        end = min(pos + n, self.size)
        if pos >= end:
            return 0
        if end <= len(self.head):
            view[: end - pos] = self.head[pos:end]
            return end - pos
        if pos >= self.tail_at:
            view[: end - pos] = self.tail[pos - self.tail_at : end - self.tail_at]
            return end - pos
        if self._whole is not None:
            view[: end - pos] = self._whole[pos:end]
            return end - pos
        raise Refused(f"bytes {pos}-{end}")

    def start(self, fd: int, base: int, member: Member) -> int | None:
        """Where ``member``'s data start: read from its local header (at ``base`` + its offset in
        ``fd``) unless the head or tail held it; None when the header does not match the central
        directory or the data do not fit the archive."""
        known = self.starts.get(member.offset)
        if known is not None:
            return known
        want = LOCAL_HEADER.size + len(member.name) + SLACK
        header = os.pread(fd, want, base + member.offset)
        found = local_start(header, member.offset, member.name, member.size, self.size)
        if found is None and len(header) == want:  # an extra field longer than SLACK
            length = LOCAL_HEADER.unpack_from(header)[2] if len(header) >= LOCAL_HEADER.size else 0
            header = os.pread(fd, want + length, base + member.offset)
            found = local_start(header, member.offset, member.name, member.size, self.size)
        if found is not None:
            self.starts[member.offset] = found
        return found


def layout(fd: int, base: int, size: int, archive: zipfile.ZipFile) -> Layout | None:
    """The layout of ``archive`` (bytes ``[base, base + size)`` of ``fd``), its head and tail read;
    None when it is not laid out as torch writes it (a record that is not a tensor's between two
    that are, none that is a tensor's, a compressed record, a header the head or tail holds that
    does not match): the caller reads it as before, which finds any damage."""
    infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
    tensors = [n for n, info in enumerate(infos) if "/data/" in info.filename]
    if not tensors or tensors != list(range(tensors[0], tensors[-1] + 1)):
        return None
    if any(
        info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size for info in infos
    ):
        return None
    head_end = infos[tensors[0]].header_offset
    after = infos[tensors[-1] + 1].header_offset if tensors[-1] + 1 < len(infos) else archive.start_dir
    tail_at = max(head_end, min(after, size - TAIL))
    head = os.pread(fd, head_end, base) if head_end else b""
    tail = os.pread(fd, size - tail_at, base + tail_at)
    if len(head) != head_end or len(tail) != size - tail_at:
        return None

    def held(offset: int, length: int) -> bytes | None:
        """Bytes ``[offset, offset + length)`` from the head or the tail that holds ``offset`` (fewer
        where it ends)."""
        if offset < head_end:
            return head[offset : offset + length]
        if offset >= tail_at:
            return tail[offset - tail_at : offset - tail_at + length]
        return None

    members, starts, others, order = [], {}, [], None
    for n, info in enumerate(infos):
        name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
        crc = recorded_crc(info)
        header = held(info.header_offset, LOCAL_HEADER.size + len(name) + SLACK)
        start = (
            None if header is None else local_start(header, info.header_offset, name, info.file_size, size)
        )
        if header is not None and start is None:
            return None  # a header the head or the tail holds does not match
        if tensors[0] <= n <= tensors[-1]:
            members.append(Member(info.header_offset, name, info.file_size, crc))
            if start is not None:
                starts[info.header_offset] = start
            continue
        data = None if start is None else held(start, info.file_size)
        if start is None or data is None or len(data) != info.file_size:
            return None
        others.append((Record(start, info.file_size, crc), data))
        if info.filename.endswith("/byteorder"):
            order = data
    native = order == sys.byteorder.encode() and torch.serialization.get_default_load_endianness() is None
    return Layout(size, head, tail_at, tail, members, starts, others, native)
