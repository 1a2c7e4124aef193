"""``torch.save``'s archive, with its CRC-32s computed while the bytes are written.

``torch.save`` computes each record's CRC-32 in one thread, then hands the record's bytes to
the file: checksum and write follow each other for every record. :func:`save_archive`
serialises with torch's own zip writer, its CRC-32s off, into a :class:`CrcFiller`: the
filler checksums every record's bytes by several threads while it writes them, and writes
in the CRC-32s torch leaves at zero: each record's data descriptor and central directory
entry, and the archive's ``.data/serialization_id`` (whose last 20 digits combine the
records' CRC-32s). The file is byte for byte the one ``torch.save`` writes with CRC-32s on.

Torch's writer is private (``torch._C.PyTorchFileWriter``, ``torch.serialization._save``):
where it is missing or its output is not what the filler expects, the file is written
again with ``torch.save``.
"""

from __future__ import annotations

import inspect
import pickle
import struct
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import IO, Any, cast

import torch

import unison.checkpoint.crc as checksums  # its crc32 looked up at each call: one place to patch in tests
from unison.checkpoint.snapshot import default_threads
from unison.checkpoint.writeback import WritebackFile

__all__ = ["CrcFiller", "fast_path", "save_archive"]

_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
_CENTRAL = b"PK\x01\x02"
_SERIALIZATION_ID = ".data/serialization_id"
_MASK = (1 << 64) - 1
_SAVE_PARAMETERS = ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


def hash_combine(seed: int, value: int) -> int:
    """c10's ``hash_combine`` on 64 bits: how torch folds each record's CRC-32 into the archive's id."""
    return (seed ^ (value + 0x9E3779B9 + (seed << 6) + (seed >> 2))) & _MASK


class CrcFiller:
    """The file torch's zip writer writes to with CRC-32s off: writes the archive it would have
    written with them on, to ``sink``; big records checksummed by ``pool``'s threads.

    The writer's calls, per record: a 30-byte local header, its name and extra field, then
    (a record with data) the data and a data descriptor; at the end the central directory in
    one call and the end records. Anything else sets :attr:`off_track`: the file is then not
    what ``torch.save`` writes, and the caller writes it again.
    """

    def __init__(self, sink: WritebackFile, pool: Executor) -> None:
        self.sink = sink
        self.pool = pool
        self.off_track = False
        """The writer's calls were not the expected ones: the file must be written again."""
        self.finished = False
        """The central directory was written."""
        self._names: list[bytes] = []
        self._crcs: list[int] = []
        self._meta = 0  # bytes of name and extra field still to come
        self._header = bytearray()
        self._data: int | None = None  # bytes of the current record's data so far; None: none expected
        self._torch_id = 0  # the id torch computes from the CRC-32s it sees (zeros)
        self._id = 0  # the id it would compute from the real ones

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self.off_track or self.finished:
            self.sink.write(view)
            return size
        out = self._step(view)
        if out is not None:
            self.sink.write(out)
            self._fold(view, out)
        else:
            self._fold(view, view)
        return size

    def flush(self) -> None:
        self.sink.flush()

    def _lost(self, view: memoryview) -> None:
        """Leaves the bytes as they come: the caller writes the file again."""
        self.off_track = True
        self.sink.write(view)

    def _fold(self, given: memoryview, written: Any) -> None:
        """Torch folds the CRC-32 of every write that starts like a data descriptor into the id."""
        if len(given) >= 8 and given[:4] == _DESCRIPTOR:
            self._torch_id = hash_combine(self._torch_id, struct.unpack_from("<I", given, 4)[0])
            self._id = hash_combine(self._id, struct.unpack_from("<I", written, 4)[0])

    def _step(self, view: memoryview) -> Any:
        """Writes ``view`` (its data, checksummed) and returns None, or returns the bytes to write."""
        if self._meta:
            if len(view) > self._meta:
                return self._lost(view)
            self._header += view
            self._meta -= len(view)
            if not self._meta:
                self._names.append(bytes(self._header[30 : 30 + _u16(self._header, 26)]))
                self._crcs.append(0)
                flags, stored = _u16(self._header, 6), struct.unpack_from("<I", self._header, 18)[0]
                self._data = 0 if flags & 8 else None  # without a descriptor: no data (an empty record)
                if not flags & 8 and stored:
                    self.off_track = True
            return view
        if self._data is not None:
            if self._data and _is_descriptor(view, self._data):
                out = bytearray(view)
                struct.pack_into("<I", out, 4, self._crcs[-1])
                self._data = None
                return out
            if self._names[-1].endswith(_SERIALIZATION_ID.encode()):
                view = memoryview(self._serialization_id(view))
            if self._data:  # the data come in more than one write (not torch's way): checksummed here
                self._crcs[-1] = checksums.crc32(view, self._crcs[-1])
                self.sink.write(view)
            else:
                self._crcs[-1] = self.sink.write_crc(view, self.pool)
            self._data += len(view)
            return None
        if len(view) == 30 and view[:4] == _LOCAL:
            self._header = bytearray(view)
            self._meta = _u16(view, 26) + _u16(view, 28)
            return view if self._meta else self._lost(view)
        if view[:4] == _CENTRAL:
            return self._central(view)
        return self._lost(view)

    def _serialization_id(self, view: memoryview) -> bytes:
        """The id with its last 20 digits from the real CRC-32s, where it holds torch's from zeros."""
        given = bytes(view)
        if len(given) != 40 or given[20:] != b"%020d" % self._torch_id:
            self.off_track = True
            return given
        return given[:20] + b"%020d" % self._id

    def _central(self, view: memoryview) -> Any:
        """The central directory with every entry's CRC-32 written in, entries in the records' order."""
        out = bytearray(view)
        at = 0
        for name, crc in zip(self._names, self._crcs, strict=True):
            if out[at : at + 4] != _CENTRAL or at + 46 > len(out):
                return self._lost(view)
            length = _u16(out, at + 28)
            if bytes(out[at + 46 : at + 46 + length]) != name:
                return self._lost(view)
            struct.pack_into("<I", out, at + 16, crc)
            at += 46 + length + _u16(out, at + 30) + _u16(out, at + 32)
        if at != len(out) or self._meta or self._data is not None:
            return self._lost(view)
        self.finished = True
        return out


def _u16(buffer: Any, at: int) -> int:
    value: int = struct.unpack_from("<H", buffer, at)[0]
    return value


def _is_descriptor(view: memoryview, size: int) -> bool:
    """Whether ``view`` is the data descriptor of a record of ``size`` bytes (zip or zip64)."""
    if view[:4] != _DESCRIPTOR:
        return False
    if len(view) == 16:
        return struct.unpack_from("<II", view, 8) == (size, size)
    return len(view) == 24 and struct.unpack_from("<QQ", view, 8) == (size, size)


def fast_path() -> bool:
    """Whether :func:`save_archive` fills torch's zip writer itself: this torch has the private API
    it uses (torch 2.x), CRC-32s are on (``torch.serialization.set_crc32_options``), and
    ``torch.save`` is torch's own (not replaced by a wrapper, which is then called instead)."""
    if torch.save is not torch.serialization.save or not torch.serialization.get_crc32_options():
        return False
    writer = getattr(torch._C, "PyTorchFileWriter", None)
    save = getattr(torch.serialization, "_save", None)
    if writer is None or save is None or not hasattr(torch.serialization, "_get_storage_alignment"):
        return False
    try:
        parameters = list(inspect.signature(save).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return False
    tls = getattr(torch.serialization, "_serialization_tls", None)
    return parameters == _SAVE_PARAMETERS and not getattr(tls, "skip_data", False)


def save_archive(obj: Any, sink: WritebackFile, *, threads: int | None = None) -> bool:
    """Writes ``obj`` to ``sink`` as ``torch.save`` does (CRC-32s on), the CRC-32s computed by
    ``threads`` threads while the bytes are written (default
    :func:`~unison.checkpoint.snapshot.default_threads`).

    Returns:
        Whether the fast path wrote it; False when ``torch.save`` did (this torch's writer is
        not the one expected).
    """
    if fast_path():
        alignment = torch.serialization._get_storage_alignment()
        with ThreadPoolExecutor(threads or default_threads(), thread_name_prefix="unison-crc") as pool:
            filler = CrcFiller(sink, pool)
            try:
                writer = torch._C.PyTorchFileWriter(cast(IO[bytes], filler), False, alignment)
            except TypeError:  # pragma: no cover - a writer with another signature
                writer = None
            if writer is not None:
                torch.serialization._save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
                writer.write_end_of_file()
                sink.flush()
                if filler.finished and not filler.off_track:
                    return True
        sink.restart()
    torch.save(obj, cast(IO[bytes], sink))
    return False
