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
from tensorboardX.proto.event_pb2 import Event
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
    """Reads every scalar written to the event files in ``log_dir``.

    Args:
        log_dir: the folder a ``SummaryWriter`` wrote to (not its sub-folders, which
            TensorBoard shows as separate runs).

    Returns:
        tag -> ``[(step, value), ...]``, in the order written: files oldest first, then
        records in file order. A run resumed from a checkpoint may write a step twice;
        both values are kept. Values are float32, as TensorBoard stores them.

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
    scalars: Scalars = {}
    for path in event_files(log_dir):
        for data, crc in iter_records(path):
            try:
                event = Event.FromString(data)
            except DecodeError:
                warnings.warn(
                    f"{path}: a record does not decode as an Event; skipped.", RuntimeWarning, stacklevel=2
                )
                continue
            found = _scalars_of(event)
            if not found:
                continue
            if masked_crc32c(data) != crc:
                warnings.warn(
                    f"{path}: a record's data is damaged (CRC mismatch); skipped.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            for tag, value in found:
                scalars.setdefault(tag, []).append((int(event.step), value))
    return scalars
