"""The files of a sharded checkpoint's Distributed Checkpoint, written as unison writes a checkpoint
file: with ``O_DIRECT`` from staging buffers, and checksummed as they are written.

DCP's :class:`~torch.distributed.checkpoint.FileSystemWriter` opens each of a rank's files through
its ``fs`` (a :class:`~torch.distributed.checkpoint.FileSystem`), writes every tensor with its own
``torch.save``, flushes after each one, and fsyncs the file through ``fileno()`` before closing it.
:class:`DirectWriter` gives it a file system whose streams write through a
:class:`~unison.checkpoint.direct.DirectFile` with ``checksum=True``: the bytes go around the page
cache, a flush after each tensor writes nothing (it would send every partial buffer through the
page cache, only for the next direct write to take it back out), ``fileno()`` first writes what
is left, so the fsync that follows covers every byte, and each file's size and CRC-32 are kept
(:attr:`DirectFileSystem.checksums`) so that the checkpoint's ``checksums.json`` needs no second
read of files that are no longer in the page cache. Those checksums are what a resume checks; the
CRC-32 ``torch.save`` would compute of each record, which nothing reads, is not computed
(:mod:`unison.checkpoint.record_crcs`).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from unison.checkpoint.direct import DirectFile, direct_available
from unison.checkpoint.record_crcs import records_without_crcs

__all__ = ["DirectFileSystem", "DirectWriter"]


class DirectStream(io.RawIOBase):
    """The stream DCP writes one file through: bytes to a :class:`DirectFile`; ``flush`` writes
    nothing; ``fileno`` (which DCP takes to fsync) first writes every byte handed over."""

    def __init__(self, sink: DirectFile, raw: Any) -> None:
        super().__init__()
        self.sink = sink
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self.sink.write(data)

    def tell(self) -> int:
        return self.sink.written

    def flush(self) -> None:
        """Writes nothing: the bytes stay in the staging buffers until the file is complete."""

    def fileno(self) -> int:
        self.sink.flush()  # whoever takes the descriptor (to fsync it) finds every byte in the file
        return int(self.raw.fileno())


class DirectFileSystem(FileSystem):
    """DCP's local file system, its files written by :class:`DirectStream` where ``O_DIRECT`` is
    available; :attr:`checksums` holds ``{file name: (size, crc32)}`` of every file it wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "wb" or not direct_available():
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        flags = (
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        )
        with os.fdopen(os.open(path, flags, 0o644), "wb", buffering=0) as raw:  # a link there is refused
            with DirectFile(raw, path, checksum=True) as sink:
                yield DirectStream(sink, raw)
                sink.flush()
                with self._lock:
                    self.checksums[Path(path).name] = (sink.written, sink.crc)


class DirectWriter(FileSystemWriter):
    """DCP's :class:`~torch.distributed.checkpoint.FileSystemWriter` for ``folder`` (its defaults:
    one file per rank, every file fsynced, written by the calling thread), writing through a
    :class:`DirectFileSystem`, its tensors saved without per-record CRC-32s."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        super().__init__(str(folder))  # thread_count 1: the thread that calls write_data writes
        self.files = DirectFileSystem()
        self.fs = self.files

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with records_without_crcs():  # each file's own CRC-32 covers every record
            return super().write_data(plan, planner)

    @property
    def checksums(self) -> dict[str, tuple[int, int]]:
        """``{file name: (size, crc32)}`` of every file this writer wrote."""
        return self.files.checksums
