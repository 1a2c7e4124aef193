"""Durable checkpoint files: temp file, fsync, rename, fsync the folder; and safe loading."""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from unison.utils.logging import get_logger

_log = get_logger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used: missing, truncated, corrupt or foreign."""


def fsync_dir(folder: Path) -> None:
    """Makes a rename or unlink inside ``folder`` durable (a no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on folders
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Writes ``obj`` with ``torch.save`` so that ``path`` is either the old file or the new one.

    The data goes to a temp file in the same folder, is flushed and fsynced, renamed over
    ``path``, and the folder is fsynced so the rename survives a power loss. A crash at
    any point leaves at most a ``.tmp`` file behind, never a partial ``path``.
    """
    target = Path(path)
    _atomic_write(target, lambda fh: torch.save(obj, fh))
    return target


def atomic_write_json(data: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Writes JSON durably, like :func:`atomic_save`."""
    target = Path(path)
    payload = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    _atomic_write(target, lambda fh: fh.write(payload))
    return target


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a whole ``torch.save`` archive; no tensor is built.

    Every member's CRC-32 is checked. A member whose recorded CRC is zero although it holds
    data was written with ``torch.serialization.set_crc32_options(False)``: its CRC was not
    recorded, so the archive's structure is checked instead (the central directory reads,
    every record's local header is where the directory says, and its stored size fits the
    file). That catches truncation and most damage, not flipped bytes inside a record; a
    log line says so.

    A sharded checkpoint's folder is whole when every file it recorded is present with its
    size and CRC-32 (:func:`unison.checkpoint.sharded.sharded_problem`).
    """
    if os.path.isdir(path):
        from unison.checkpoint.sharded_check import sharded_complete  # it builds on this module

        return sharded_complete(path)
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
            size = os.fstat(raw.fileno()).st_size
            unrecorded = [info for info in archive.infolist() if info.CRC == 0 and info.file_size > 0]
            for info in archive.infolist():
                if info in unrecorded:
                    if not _record_fits(raw, info, size):
                        return False
                elif not _crc_matches(archive, info):
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


def _crc_matches(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bool:
    with archive.open(info) as member:  # raises BadZipFile at the end when the CRC differs
        while member.read(1 << 20):
            pass
    return True


_LOCAL_HEADER = struct.Struct("<4s22xHH")
"""A zip local file header: signature, 22 bytes, file name length, extra field length."""


def _record_fits(raw: BinaryIO, info: zipfile.ZipInfo, size: int) -> bool:
    """Whether the record of ``info`` has its local header where the directory says, and fits the file."""
    raw.seek(info.header_offset)
    header = raw.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return False
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    end = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length + info.compress_size
    stored = info.compress_type != zipfile.ZIP_STORED or info.compress_size == info.file_size
    return signature == b"PK\x03\x04" and stored and end <= size


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Loads a checkpoint onto the CPU with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: naming the file, when it is missing, truncated, corrupt, or
            holds objects that ``weights_only`` refuses; with what to do.
    """
    file = Path(path)
    if file.is_dir():
        return _load_sharded_rest(file)
    if not file.is_file():
        raise CheckpointError(
            f"Checkpoint {file} does not exist. Check the path, or resume='auto' to pick the newest."
        )
    if not is_complete(file):
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
        if not is_complete(file):
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


def _load_sharded_rest(folder: Path) -> dict[str, Any]:
    """The ``rest.pt`` of a sharded checkpoint folder, after checking the whole folder."""
    from unison.checkpoint.sharded import REST
    from unison.checkpoint.sharded_check import sharded_problem

    problem = sharded_problem(folder)
    if problem is not None:
        raise CheckpointError(
            f"Sharded checkpoint {folder} is incomplete or damaged: {problem}. It was probably cut short by a "
            "crash or a full disk, or damaged on disk. Delete the folder and resume from the previous checkpoint "
            "(resume='auto' skips it by itself)."
        )
    return load_checkpoint(folder / REST)
