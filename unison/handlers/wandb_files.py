"""What a W&B run holds on disk: the last step its ``.wandb`` files hold, read as W&B wrote them.

W&B's service process writes each run's records to a ``run-<id>.wandb`` file (online runs too:
their copy of what they send; offline runs: all ``wandb sync`` will send). A row handed to
``wandb.log`` is in that file only once the service has written it: a job killed as a whole
(the training process and W&B's service with it, as a preemption or an out-of-memory kill
does) loses the rows handed over and not yet written. :func:`last_written_step` reads the files
back, so a resumed run continues after the last step W&B *wrote*, and logs again, from its
checkpoint, every row that was lost.

The format is LevelDB's log, as W&B writes it: a 7-byte header (``:W&B``, magic ``0xBEE1``,
version 0), then 32 KiB blocks of records, each a CRC-32 (seeded with the record's type), a
length, a type (full, first, middle, last) and a piece of a serialised ``Record`` protobuf. A
record that does not check out (a file cut short by the kill) ends the reading: what comes
before it was written whole.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

HEADER = struct.Struct("<4sHB")
RECORD = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
MAX_BYTES = 1 << 30
"""A ``.wandb`` file larger than this is not read (a run folder from elsewhere may hold anything)."""
RUN_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}")
"""A W&B run id as unison reads one back (W&B's own are 8 lowercase letters and digits)."""


def _pieces(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each record piece of a ``.wandb`` file's bytes, up to the first one that
    does not check out."""
    ident, magic, version = HEADER.unpack_from(data) if len(data) >= HEADER.size else (b"", 0, -1)
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        return
    at = HEADER.size
    while True:
        left = BLOCK - at % BLOCK
        if left < RECORD.size:  # a block's tail too short for a header is zeros
            at += left
        if at + RECORD.size > len(data):
            return
        checksum, length, kind = RECORD.unpack_from(data, at)
        payload = data[at + RECORD.size : at + RECORD.size + length]
        if kind not in (FULL, FIRST, MIDDLE, LAST) or len(payload) != length:
            return
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != checksum:
            return
        yield kind, payload
        at += RECORD.size + length


def _records(data: bytes) -> Iterator[bytes]:
    """The serialised records of a ``.wandb`` file's bytes, whole ones only."""
    parts: list[bytes] | None = None
    for kind, payload in _pieces(data):
        if kind == FULL:
            parts = None
            yield payload
        elif kind == FIRST:
            parts = [payload]
        elif parts is not None:
            parts.append(payload)
            if kind == LAST:
                yield b"".join(parts)
                parts = None


def _read_regular(path: Path) -> bytes | None:
    """``path``'s bytes when it is a regular file of at most :data:`MAX_BYTES`, opened without
    following a link or blocking; None otherwise."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
            return None
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read(MAX_BYTES + 1)
    finally:
        os.close(fd)


def run_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """The ``.wandb`` files of run ``run_id`` under ``wandb_dir`` (W&B's ``wandb/`` folder):
    ``offline-run-*-<id>/run-<id>.wandb`` and ``run-*-<id>/run-<id>.wandb``."""
    if not RUN_ID.fullmatch(run_id) or not wandb_dir.is_dir():
        return []
    return sorted(
        folder / f"run-{run_id}.wandb"
        for folder in wandb_dir.iterdir()
        if folder.name.endswith(f"-{run_id}") and folder.name.split("-", 1)[0] in ("run", "offline")
    )


def last_written_step(wandb_dir: Path, run_id: str) -> tuple[int, Path | None]:
    """The last history step W&B wrote for run ``run_id`` in its files under ``wandb_dir``, and
    the file holding it; ``(-1, None)`` when there is none (or W&B is not installed)."""
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError:  # pragma: no cover - W&B's logger needs W&B
        return -1, None
    last, where = -1, None
    for path in run_files(wandb_dir, run_id):
        data = _read_regular(path)
        for raw in _records(data or b""):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            try:
                record.ParseFromString(raw)
            except Exception:  # a record W&B did not write whole: the file ends there
                break
            if record.WhichOneof("record_type") == "history" and record.history.step.num > last:
                last, where = int(record.history.step.num), path
    return last, where
