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
read of files that are no longer in the page cache. Each rank's checksums go to rank 0 with
DCP's own write results (:class:`RankFiles`, taken out again before DCP writes its metadata), so
a save gathers nothing more for them. Those checksums are what a resume checks; the
CRC-32 ``torch.save`` would compute of each record, which nothing reads, is not computed
(:mod:`unison.checkpoint.record_crcs`).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from unison.checkpoint.direct import DirectFile, direct_available
from unison.checkpoint.record_crcs import records_without_crcs
from unison.checkpoint.sharded_files import file_checksum
from unison.distributed.primitives import get_rank

__all__ = ["DirectFileSystem", "DirectWriter", "RankFiles"]


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
    available; :attr:`checksums` holds ``{file name: (size, crc32)}`` of every file it wrote (read
    back once written, where ``O_DIRECT`` is not available)."""

    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "wb" or not direct_available():
            with super().create_stream(path, mode) as stream:
                yield stream
            if mode == "wb":  # closed, fsynced by DCP: read back
                with self._lock:
                    self.checksums[Path(path).name] = file_checksum(Path(path))
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


@dataclass(frozen=True)
class RankFiles:
    """Not a write result: one rank's ``{file name: (size, crc32)}``, sent to rank 0 among its
    write results by DCP's own gather, and taken out by :meth:`DirectWriter.finish`."""

    files: dict[str, tuple[int, int]] = field(default_factory=dict)


class DirectWriter(FileSystemWriter):
    """DCP's :class:`~torch.distributed.checkpoint.FileSystemWriter` for ``folder`` (its defaults:
    one file per rank, every file fsynced, written by the calling thread), writing through a
    :class:`DirectFileSystem`, its tensors saved without per-record CRC-32s."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        super().__init__(str(folder))  # thread_count 1: the thread that calls write_data writes
        self.files = DirectFileSystem()
        self.fs = self.files
        self.everyone: list[dict[str, tuple[int, int]]] | None = None
        """On the rank that finishes the save (rank 0), once it has: every rank's files'
        ``{file name: (size, crc32)}``, by rank; the metadata is rank 0's. None elsewhere."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's write, its tensors without per-record CRC-32s (each file's own CRC-32 covers
        every record); its results carry this rank's checksums (:class:`RankFiles`) to rank 0."""
        with records_without_crcs():
            written = super().write_data(plan, planner).value()
        done: Future[list[Any]] = Future()
        done.set_result([*written, RankFiles(dict(self.checksums))])
        return done

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """Rank 0: DCP's metadata from every rank's write results, with :attr:`everyone` taken
        out of them first."""
        files = [[r for r in mine if isinstance(r, RankFiles)] for mine in results]
        self.everyone = [dict(ranks[0].files) if ranks else {} for ranks in files]
        super().finish(metadata, [[r for r in mine if not isinstance(r, RankFiles)] for mine in results])
        metadata_sum = self.checksums.get(".metadata.tmp")  # written, then renamed by DCP
        if self.everyone:
            self.everyone[0][".metadata"] = metadata_sum or file_checksum(Path(self.path) / ".metadata")

    def gathered(self) -> list[dict[str, tuple[int, int]]] | None:
        """Once the save is done: on rank 0, every rank's ``{file name: (size, crc32)}``, by rank
        (``[{}]`` where DCP handed none to :meth:`finish`: the folder's finish then reads each file
        back, ``sharded.finish_folder``); None on the other ranks."""
        return (self.everyone or [{}]) if get_rank() == 0 else None

    @property
    def checksums(self) -> dict[str, tuple[int, int]]:
        """``{file name: (size, crc32)}`` of every file this writer wrote."""
        return self.files.checksums
