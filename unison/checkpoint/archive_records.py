"""The records of a ``torch.save`` archive: where each one's data lie in the file, and its CRC-32."""

from __future__ import annotations

import io
import os
import struct
import zipfile
from typing import BinaryIO, NamedTuple

from unison.utils.logging import get_logger

_log = get_logger(__name__)


class Record(NamedTuple):
    """One member of an archive: where its data start in the file, its size, its CRC-32 (None: not recorded)."""

    start: int
    size: int
    crc: int | None


def records(raw: BinaryIO, archive: zipfile.ZipFile) -> list[Record] | None:
    """The members of ``archive`` (read from ``raw``) in file order; None when one is not where
    the central directory says, not stored, or does not fit the file. A member whose CRC is
    zero although it holds data was written with ``set_crc32_options(False)``: its CRC is None."""
    size = raw.seek(0, io.SEEK_END)  # a file, or an archive inside one
    found = []
    for info in sorted(archive.infolist(), key=lambda info: info.header_offset):  # in file order
        start = _record_start(raw, info, size)
        if start is None:
            return None
        found.append(Record(start, info.compress_size, recorded_crc(info)))
    return found


def recorded_crc(info: zipfile.ZipInfo) -> int | None:
    """The member's CRC-32 as recorded; None for one written with ``set_crc32_options(False)`` (a
    CRC of zero although it holds data)."""
    return None if info.CRC == 0 and info.file_size > 0 else info.CRC


def unrecorded_note(path: str | os.PathLike[str]) -> None:
    """Logs that the archive ``path`` holds no CRC-32s and was checked from its structure."""
    _log.info(
        "Checkpoint %s holds no CRC-32s (torch.serialization.set_crc32_options(False)); its integrity was "
        "checked from the archive's structure (central directory, record headers and sizes) instead.",
        path,
    )


LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip local file header: signature, 22 bytes, file name length, extra field length."""


def local_start(header: bytes, offset: int, name: bytes | None, size: int, total: int) -> int | None:
    """Where the data of a record start, given ``header``, the bytes from its local header's
    ``offset`` on: None unless they hold a local header (of ``name``, and the name itself, when
    ``name`` is given) and ``size`` bytes of data from there fit the archive's ``total``."""
    if len(header) < LOCAL_HEADER.size:
        return None
    signature, name_length, extra_length = LOCAL_HEADER.unpack_from(header)
    if signature != b"PK\x03\x04":
        return None
    if name is not None:
        end = LOCAL_HEADER.size + name_length
        if (
            name_length != len(name)
            or header[LOCAL_HEADER.size : end] != name
            or len(header) < end + extra_length
        ):
            return None
    start = offset + LOCAL_HEADER.size + name_length + extra_length
    return start if start + size <= total else None


def _record_start(raw: BinaryIO, info: zipfile.ZipInfo, size: int) -> int | None:
    """Where the data of ``info``'s record starts, when its local header is where the directory
    says, it is stored uncompressed and it fits the file; else None."""
    raw.seek(info.header_offset)
    header = raw.read(LOCAL_HEADER.size)
    stored = info.compress_type == zipfile.ZIP_STORED and info.compress_size == info.file_size
    return local_start(header, info.header_offset, None, info.compress_size, size) if stored else None
