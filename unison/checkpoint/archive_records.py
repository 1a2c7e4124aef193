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
        unrecorded = info.CRC == 0 and info.file_size > 0
        found.append(Record(start, info.compress_size, None if unrecorded else info.CRC))
    return found


def unrecorded_note(path: str | os.PathLike[str]) -> None:
    """Logs that the archive ``path`` holds no CRC-32s and was checked from its structure."""
    _log.info(
        "Checkpoint %s holds no CRC-32s (torch.serialization.set_crc32_options(False)); its integrity was "
        "checked from the archive's structure (central directory, record headers and sizes) instead.",
        path,
    )


_LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip local file header: signature, 22 bytes, file name length, extra field length."""


def _record_start(raw: BinaryIO, info: zipfile.ZipInfo, size: int) -> int | None:
    """Where the data of ``info``'s record starts, when its local header is where the directory
    says, it is stored uncompressed and it fits the file; else None."""
    raw.seek(info.header_offset)
    header = raw.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    stored = info.compress_type == zipfile.ZIP_STORED and info.compress_size == info.file_size
    return start if signature == b"PK\x03\x04" and stored and start + info.compress_size <= size else None
