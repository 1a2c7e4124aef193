"""Reading scalars back from TensorBoard event files, without TensorBoard or TensorFlow.

An event file is a sequence of TFRecords, each framed as::

    uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)

(little-endian), where ``data`` is a serialised ``Event`` protobuf. The protobuf
classes and the CRC-32C come from tensorboardX, a dependency of unison.
"""

from __future__ import annotations

import os
import re
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path

from google.protobuf.message import DecodeError
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import masked_crc32c

_HEADER = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_EVENT_FILE = re.compile(r"events\.out\.tfevents\.(\d+)")

Scalars = dict[str, list[tuple[int, float]]]
"""tag -> ``[(step, value), ...]`` in the order the values were written."""


def event_files(log_dir: str | os.PathLike[str]) -> list[Path]:
    """The event files directly inside ``log_dir``, oldest first.

    Files are ordered by the creation time in their names
    (``events.out.tfevents.<seconds>.<host>...``), then by name.
    """
    folder = Path(log_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_file() and _EVENT_FILE.match(p.name)]

    def key(path: Path) -> tuple[int, str]:
        match = _EVENT_FILE.match(path.name)
        return (int(match.group(1)) if match else 0, path.name)

    return sorted(found, key=key)


def iter_records(path: str | os.PathLike[str]) -> Iterator[tuple[bytes, int]]:
    """Yields ``(data, masked CRC of data)`` for each TFRecord in ``path``.

    Each record's length is checked against its CRC, so a damaged header ends the
    file with a warning rather than sending the reader into the middle of a record. A
    record cut short at the end of the file (a writer still running, or killed) ends
    the file silently. Data CRCs are not checked here (tensorboardX's CRC-32C is pure
    Python, slow on large images): :func:`read_scalars` checks those of the records it
    returns.
    """
    with open(path, "rb") as f:
        while True:
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return  # end of file, or a header cut short
            header_crc = f.read(_CRC.size)
            if len(header_crc) < _CRC.size:
                return
            if _CRC.unpack(header_crc)[0] != masked_crc32c(header):
                warnings.warn(
                    f"{path}: a record header at byte {f.tell() - _HEADER.size - _CRC.size} is damaged "
                    "(CRC mismatch); the rest of the file is skipped.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return
            (length,) = _HEADER.unpack(header)
            data = f.read(length)
            footer = f.read(_CRC.size)
            if len(data) < length or len(footer) < _CRC.size:
                return  # the last record is incomplete
            yield data, _CRC.unpack(footer)[0]


def _scalars_of(event: Event) -> list[tuple[str, float]]:
    if not event.HasField("summary"):
        return []
    found = []
    for value in event.summary.value:
        kind = value.WhichOneof("value")
        if kind == "simple_value":
            found.append((value.tag, float(value.simple_value)))
        elif kind == "tensor":  # scalars written by torch.utils.tensorboard / tf2 summaries
            tensor = value.tensor
            dims = list(tensor.tensor_shape.dim)
            if dims and any(d.size != 1 for d in dims):
                continue
            for field in ("float_val", "double_val", "int_val", "int64_val"):
                values = getattr(tensor, field)
                if len(values) == 1:
                    found.append((value.tag, float(values[0])))
                    break
            else:
                if tensor.dtype == 1 and len(tensor.tensor_content) == 4:  # DT_FLOAT
                    found.append((value.tag, struct.unpack("<f", tensor.tensor_content)[0]))
                elif tensor.dtype == 2 and len(tensor.tensor_content) == 8:  # DT_DOUBLE
                    found.append((value.tag, struct.unpack("<d", tensor.tensor_content)[0]))
    return found


def read_scalars(log_dir: str | os.PathLike[str]) -> Scalars:
    """Reads the scalars written to the event files in ``log_dir``, as TensorBoard shows them.

    Args:
        log_dir: the folder a ``SummaryWriter`` wrote to (not its sub-folders, which
            TensorBoard shows as separate runs).

    Returns:
        tag -> ``[(step, value), ...]``, in the order written: files oldest first, then
        records in file order. Values are float32, as TensorBoard stores them.

    A writer that resumes a run at step ``S`` (``SummaryWriter(purge_step=S)``, as
    :class:`~unison.handlers.tensorboard.TensorBoardLogger` opens it for a resumed run)
    starts its file with a restart marker at ``S``: every point read before the marker at a
    step ``>= S`` is dropped, for every tag, so a run killed after its last checkpoint shows
    the resumed run's points only. This is TensorBoard's own rule, and so is the one for
    files without a file version (written by old writers): a point at a step lower than the
    latest one read drops the points of its tags at steps from it on.

    Records cut short at the end of a file (the writer is still running, or was
    killed) are ignored; a record whose CRC does not match is skipped with a warning.

    Example:
        >>> from tensorboardX import SummaryWriter
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> with SummaryWriter(folder) as writer:
        ...     writer.add_scalar("train/loss", 0.5, 10)
        >>> read_scalars(folder)
        {'train/loss': [(10, 0.5)]}
    """
    reader = _Reader()
    for path in event_files(log_dir):
        for data, crc in iter_records(path):
            try:
                event = Event.FromString(data)
            except DecodeError:
                warnings.warn(
                    f"{path}: a record does not decode as an Event; skipped.", RuntimeWarning, stacklevel=2
                )
                continue
            if not (_restarts(event) or event.HasField("file_version") or event.HasField("summary")):
                continue
            if masked_crc32c(data) != crc:
                warnings.warn(
                    f"{path}: a record's data is damaged (CRC mismatch); skipped.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            reader.add(event)
    return reader.scalars


def _restarts(event: Event) -> bool:
    return event.HasField("session_log") and event.session_log.status == SessionLog.START


class _Reader:
    """The scalars of a folder's events, read in order, with TensorBoard's purge of orphaned points."""

    def __init__(self) -> None:
        self.scalars: Scalars = {}
        self.version: float | None = None  # the file version read last: 2 and later mark restarts
        self.latest = -1  # without a file version, the highest step read so far

    def add(self, event: Event) -> None:
        if event.HasField("file_version"):
            self.version = _file_version(event.file_version)
        step = int(event.step)
        if self.version is not None and self.version >= 2:
            if _restarts(event):
                self._purge(step, None)
        elif step < self.latest and event.HasField("summary"):
            self._purge(step, {value.tag for value in event.summary.value})
        else:
            self.latest = step
        for tag, value in _scalars_of(event):
            self.scalars.setdefault(tag, []).append((step, value))

    def _purge(self, step: int, tags: set[str] | None) -> None:
        """Drops the points at steps ``>= step``: of ``tags``, or of every tag when None."""
        for tag in list(self.scalars):
            if tags is None or tag in tags:
                kept = [point for point in self.scalars[tag] if point[0] < step]
                if kept:
                    self.scalars[tag] = kept
                else:
                    del self.scalars[tag]


def _file_version(text: str) -> float:
    """The number of ``brain.Event:<n>``; -1 when it is not one (no restart markers, then)."""
    try:
        return float(text.split("brain.Event:")[-1])
    except ValueError:
        return -1.0
