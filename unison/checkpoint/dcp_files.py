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

Each rank's finite check of what it writes runs beside its write, in a thread of its own, and its
answer (the first tensor holding a NaN or an infinity, or none) travels to rank 0 with the
checksums: rank 0 renames the folder only when no rank found one (:class:`Written`).
"""

from __future__ import annotations

import functools
import io
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from unison.checkpoint.direct import DirectFile, direct_available
from unison.checkpoint.record_crcs import records_without_crcs
from unison.checkpoint.sharded_files import file_checksum
from unison.checkpoint.verify import first_non_finite
from unison.distributed.primitives import get_rank

__all__ = ["DirectFileSystem", "DirectWriter", "RankFiles", "Written", "results_problem"]


SMALL = 4096
"""Writes under this many bytes are gathered before they reach the :class:`DirectFile`: ``torch.save``
writes each tensor's archive in about 39 calls, most of them a header of a few dozen bytes, and a
sharded save of a model of hundreds of tensors made tens of thousands of them."""


class DirectStream(io.RawIOBase):
    """The stream DCP writes one file through: bytes to a :class:`DirectFile` (small writes gathered
    first: :data:`SMALL`); ``flush`` writes nothing; ``fileno`` (which DCP takes to fsync) first
    writes every byte handed over, as :meth:`drain` does."""

    def __init__(self, sink: DirectFile, raw: Any) -> None:
        super().__init__()
        self.sink = sink
        self.raw = raw
        self._small = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) < SMALL:
            self._small += view
            if len(self._small) >= SMALL:
                self.drain()
            return len(view)
        self.drain()
        return self.sink.write(view)

    def drain(self) -> None:
        """Hands the small writes gathered so far to the file, in order."""
        if self._small:
            self.sink.write(self._small)  # copied into the staging buffers before it returns
            self._small.clear()

    def tell(self) -> int:
        return self.sink.written + len(self._small)

    def flush(self) -> None:
        """Writes nothing: the bytes stay in the staging buffers until the file is complete."""

    def fileno(self) -> int:
        self.drain()
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
                stream = DirectStream(sink, raw)
                yield stream
                stream.drain()
                sink.flush()
                with self._lock:
                    self.checksums[Path(path).name] = (sink.written, sink.crc)


@dataclass(frozen=True)
class RankFiles:
    """Not a write result: one rank's ``{file name: (size, crc32)}`` and the first tensor it wrote
    that holds a NaN or an infinity (None: none), sent to rank 0 among its write results by DCP's
    own gather, and taken out by :meth:`DirectWriter.finish`."""

    files: dict[str, tuple[int, int]] = field(default_factory=dict)
    not_finite: str | None = None
    changed: str | None = None
    """The tensors this rank found changed in place while an asynchronous save copied them
    (:attr:`DirectWriter.changed`), named; None: none."""


class Written(NamedTuple):
    """What rank 0 knows of a sharded save once every rank has written (:meth:`DirectWriter.gathered`)."""

    files: list[dict[str, tuple[int, int]]]
    """Every rank's ``{file name: (size, crc32)}``, by rank (``[{}]``: none came, and the folder's
    finish reads each file back, ``sharded.finish_folder``)."""
    not_finite: str | None
    """The first tensor, by rank, that a rank wrote holding a NaN or an infinity; None when none did."""
    checked: bool = True
    """Whether every rank's answer came; False where this torch withheld some (``unison doctor``
    says so), and :attr:`not_finite` then speaks only for those that came."""
    changed: str | None = None
    """The tensors the first rank that found any found changed in place while an asynchronous
    save copied them, named with that rank; None when no rank did."""


class DirectWriter(FileSystemWriter):
    """DCP's :class:`~torch.distributed.checkpoint.FileSystemWriter` for ``folder`` (its defaults:
    one file per rank, every file fsynced, written by the calling thread), writing through a
    :class:`DirectFileSystem`, its tensors saved without per-record CRC-32s."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        super().__init__(str(folder))  # thread_count 1: the thread that calls write_data writes
        self.files = DirectFileSystem()
        self.fs = self.files
        self.everyone: list[RankFiles | None] | None = None
        """On the rank that finishes the save (rank 0), once it has: every rank's
        :class:`RankFiles`, by rank (None for a rank whose results came without it); the
        metadata's checksum is in rank 0's. None elsewhere."""
        self.changed: str | None = None
        """Set before :meth:`write_data`: the tensors this rank found changed in place while an
        asynchronous save copied them (the folder must not take its name), named; None: none."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's write, its tensors without per-record CRC-32s (each file's own CRC-32 covers
        every record), while a thread checks that every tensor written is finite; its results
        carry this rank's checksums and that check's answer (:class:`RankFiles`) to rank 0."""
        with ThreadPoolExecutor(1, thread_name_prefix="unison-ckpt-check") as pool:
            check = pool.submit(_not_finite, plan, planner)  # waited for, even when the write raises
            with records_without_crcs():
                written = super().write_data(plan, planner).value()
        done: Future[list[Any]] = Future()
        done.set_result([*written, RankFiles(dict(self.checksums), check.result(), self.changed)])
        return done

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """Rank 0: DCP's metadata from every rank's write results, with :attr:`everyone` taken
        out of them first."""
        self.everyone = [next((r for r in got if isinstance(r, RankFiles)), None) for got in results]
        super().finish(metadata, [[r for r in got if not isinstance(r, RankFiles)] for got in results])

    def gathered(self) -> Written | None:
        """Once the save is done: on rank 0, every rank's files and the first tensor written that is
        not finite (:class:`Written`; a rank whose results came without them counts as having
        written no file, and makes it unchecked); None on the other ranks."""
        return self.collected() if get_rank() == 0 else None

    def collected(self) -> Written:
        """:meth:`gathered`, on the rank that finished the save (rank 0; the process that saved
        without a process group)."""
        everyone = self.everyone or [None]
        files = [dict(r.files) if r is not None else {} for r in everyone]
        metadata_sum = self.checksums.get(".metadata.tmp")  # written, then renamed by DCP
        files[0][".metadata"] = metadata_sum or file_checksum(Path(self.path) / ".metadata")
        bad = next((r.not_finite for r in everyone if r is not None and r.not_finite), None)
        changed = next(
            (
                f"{r.changed} (on rank {rank})"
                for rank, r in enumerate(everyone)
                if r is not None and r.changed
            ),
            None,
        )
        return Written(files, bad, checked=None not in everyone, changed=changed)

    @property
    def checksums(self) -> dict[str, tuple[int, int]]:
        """``{file name: (size, crc32)}`` of every file this writer wrote."""
        return self.files.checksums


def _not_finite(plan: SavePlan, planner: SavePlanner) -> str | None:
    """The first tensor ``plan`` writes that holds a NaN or an infinity, by its key in the saved
    state (``model.layer.weight``); None when every one is finite. Each is read where the writer
    reads it (``planner.resolve_data``: this rank's shard, or an asynchronous save's copy)."""
    tensors: dict[str, list[Any]] = {}
    for item in plan.items:
        if item.type != WriteItemType.BYTE_IO:
            tensors.setdefault(item.index.fqn, []).append(planner.resolve_data(item))
    return first_non_finite({fqn: ts[0] if len(ts) == 1 else ts for fqn, ts in tensors.items()})


def check_results() -> str | None:
    """None when this torch hands :class:`DirectWriter`'s write results over as it relies on (a
    small folder saved without a process group: its :meth:`~DirectWriter.gathered` names the
    checksums and the tensor that is not finite), else what changed."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0), "bad": torch.tensor([float("nan")])}
    with tempfile.TemporaryDirectory() as folder:
        writer = DirectWriter(folder)
        writer.per_thread_copy_ahead = 0  # DCP's serial loader, whatever torch.cuda.is_available() says
        dcp.save(state, storage_writer=writer, no_dist=True)
        names = sorted(p.name for p in Path(folder).iterdir())
        expected = Written([{n: file_checksum(Path(folder) / n) for n in names}], "bad", checked=True)
        if writer.collected() != expected:
            return f"DCP did not hand the write results to finish() as write_data returned them ({writer.everyone})"
        loaded = {"w": torch.zeros(6)}
        dcp.load(loaded, checkpoint_id=folder, no_dist=True)
    return None if torch.equal(loaded["w"], state["w"]) else "a folder saved so did not load back equal"


@functools.cache
def results_problem() -> str | None:
    """:func:`check_results`, once a process (``unison doctor`` runs the same check); an error it
    raises is a problem too. Where there is one, an asynchronous sharded save copies every tensor
    before it returns: only the write results carry a rank's word that its copy held still."""
    try:
        with warnings.catch_warnings():  # DCP's note that it saves without a process group
            warnings.simplefilter("ignore")
            return check_results()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
