"""One ``torch.save`` archive: whether it is whole (its CRC-32s, or its structure), and loading it safely."""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

from unison.checkpoint.checkpoint_error import CheckpointError
from unison.utils.logging import get_logger

_log = get_logger(__name__)


def archive_complete(path: str | os.PathLike[str]) -> bool:
    """Whether the file ``path`` is a whole ``torch.save`` archive; no tensor is built.

    Every member's CRC-32 is checked. A member whose recorded CRC is zero although it holds
    data was written with ``torch.serialization.set_crc32_options(False)``: its CRC was not
    recorded, so the archive's structure is checked instead (the central directory reads,
    every record's local header is where the directory says, and its stored size fits the
    file). That catches truncation and most damage, not flipped bytes inside a record; a
    log line says so.
    """
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb", buffering=0) as raw:
            size = os.fstat(raw.fileno()).st_size
            _read_ahead(raw.fileno(), 0, 0, getattr(os, "POSIX_FADV_SEQUENTIAL", 0))
            unrecorded = [info for info in archive.infolist() if info.CRC == 0 and info.file_size > 0]
            block = memoryview(bytearray(_BLOCK))
            for info in sorted(archive.infolist(), key=lambda info: info.header_offset):  # in file order
                if not _record_fits(raw, info, size):
                    return False
                if info not in unrecorded and not _crc_matches(raw, info, block):
                    return False
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False
    if unrecorded:
        _log.info(
            "Checkpoint %s holds no CRC-32s (torch.serialization.set_crc32_options(False)); its integrity was "
            "checked from the archive's structure (central directory, record headers and sizes) instead.",
            path,
        )
    return True


_BLOCK = 8 << 20
"""Bytes read per call while checking CRC-32s (8 MiB)."""
_AHEAD = 64 << 20
"""Bytes the kernel is asked to read ahead of the block being checked (64 MiB)."""


def _read_ahead(fd: int, offset: int, length: int, advice: int) -> None:
    """``posix_fadvise`` where there is one: the disk reads ahead while the CRC-32s are computed."""
    if advice and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, advice)
        except OSError:  # pragma: no cover - a file system that refuses the advice
            pass


def _crc_matches(raw: Any, info: zipfile.ZipInfo, block: memoryview) -> bool:
    """Whether the stored record of ``info`` has the CRC-32 the central directory records.

    Read in large blocks straight from the file (where :func:`_record_fits` left it, at the
    record's data), the disk asked to read ahead of the block being checked: reading and
    checking overlap, and ``zlib.crc32`` releases the GIL on large blocks.
    """
    left, crc = info.compress_size, 0
    offset = raw.tell()
    ahead = offset
    while left > 0:
        if ahead - offset < _AHEAD // 2 and ahead < offset + left:
            _read_ahead(raw.fileno(), ahead, _AHEAD, getattr(os, "POSIX_FADV_WILLNEED", 0))
            ahead += _AHEAD
        n = raw.readinto(block[: min(left, len(block))])
        if not n:
            return False
        crc = zlib.crc32(block[:n], crc)
        left -= n
        offset += n
    return crc == info.CRC


_LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip local file header: signature, 22 bytes, file name length, extra field length."""


def _record_fits(raw: BinaryIO, info: zipfile.ZipInfo, size: int) -> bool:
    """Whether the record of ``info`` has its local header where the directory says, is stored
    uncompressed, and fits the file; the file is left at the record's data."""
    raw.seek(info.header_offset)
    header = raw.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return False
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    raw.seek(start)
    stored = info.compress_type == zipfile.ZIP_STORED and info.compress_size == info.file_size
    return signature == b"PK\x03\x04" and stored and start + info.compress_size <= size


def load_archive(file: Path, *, checked: bool = False) -> dict[str, Any]:
    """Loads a checkpoint file onto the CPU with ``torch.load(weights_only=True)``; its CRC-32s
    are checked first unless this process has just ``checked`` them (:func:`archive_complete`).

    Raises:
        CheckpointError: naming the file, when it is missing, truncated, corrupt, or
            holds objects that ``weights_only`` refuses; with what to do.
    """
    if not file.is_file():
        raise CheckpointError(
            f"Checkpoint {file} does not exist. Check the path, or resume='auto' to pick the newest."
        )
    if not checked and not archive_complete(file):
        # torch.load does not verify the archive's checksums: damaged bytes would load as
        # wrong weights. One extra read of the file rules that out.
        raise CheckpointError(
            f"Checkpoint {file} is truncated or corrupt (its checksums do not match). It was probably cut "
            "short by a crash or a full disk, or damaged on disk. Delete it and resume from the previous "
            "checkpoint (resume='auto' skips it by itself)."
        )
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError, zip errors...
        if not archive_complete(file):
            raise CheckpointError(
                f"Checkpoint {file} is truncated or corrupt ({type(err).__name__}: {err}). It was probably "
                "cut short by a crash or a full disk. Delete it and resume from the previous checkpoint "
                "(resume='auto' skips it by itself)."
            ) from err
        raise CheckpointError(
            f"Checkpoint {file} could not be loaded with torch.load(weights_only=True): {err}. It holds "
            "Python objects beyond tensors and plain containers; unison's checkpoints never do, so it "
            "was written by other code. Load it yourself if you trust its source."
        ) from err
    if not isinstance(state, dict):
        raise CheckpointError(f"Checkpoint {file} holds a {type(state).__name__}, not a dict of states.")
    return state
