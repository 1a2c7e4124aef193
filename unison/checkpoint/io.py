"""Durable checkpoint files: temp file, fsync, rename, fsync the folder; and safe loading."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from unison.checkpoint.archive import archive_complete, load_archive
from unison.checkpoint.archive_save import save_archive
from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.direct import open_sink
from unison.checkpoint.sharded_check import sharded_complete, sharded_problem
from unison.checkpoint.sharded_files import REST

__all__ = [
    "CheckpointError",
    "atomic_save",
    "atomic_write_json",
    "fsync_dir",
    "is_complete",
    "load_checkpoint",
]


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


def _atomic_write(
    path: Path, write: Any, size: int = 0, direct: bool | None = None, keep: Callable[[], bool] | None = None
) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb", buffering=0) as fh:
            sink = open_sink(fh, tmp, size, direct)  # from DIRECT_FROM bytes on: around the page cache
            try:
                write(sink)
                sink.flush()
            finally:
                sink.close()
            os.fsync(fh.fileno())
        if keep is not None and not keep():
            tmp.unlink()
            return False
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return True


def atomic_save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    direct: bool | None = None,
    keep: Callable[[], bool] | None = None,
) -> Path | None:
    """Writes ``obj`` with ``torch.save`` so that ``path`` is either the old file or the new one.

    The data goes to a temp file in the same folder, is flushed and fsynced, renamed over
    ``path``, and the folder is fsynced so the rename survives a power loss. A crash at
    any point leaves at most a ``.tmp`` file behind, never a partial ``path``. A state of
    :data:`~unison.checkpoint.direct.DIRECT_FROM` bytes or more goes to the disk with ``O_DIRECT``
    from staging buffers, around the page cache, while ``torch.save`` goes on
    (:class:`~unison.checkpoint.direct.DirectFile`; through the page cache where the file system
    refuses it); a smaller one through the page cache, its writeback started as it goes
    (:class:`~unison.checkpoint.writeback.WritebackFile`). The fsync waits for the tail and
    flushes the disk's cache. ``direct=True`` writes around the page cache whatever the size (a
    background save, whose page-cache writeback competes with training for the CPU), ``False``
    through it.
    The records' CRC-32s are computed by other threads while their bytes are written
    (:func:`~unison.checkpoint.archive_save.save_archive`): the file is the one ``torch.save``
    writes, byte for byte.

    ``keep``, when given, is asked once the temp file is durable, just before the rename: False
    removes the temp file, ``path`` is left as it was, and None is returned (a check that ran
    while the file was written refused it).
    """
    target = Path(path)
    kept = _atomic_write(target, lambda fh: save_archive(obj, fh), state_bytes(obj), direct, keep)
    return target if kept else None


def state_bytes(state: Any) -> int:
    """The bytes of every distinct tensor storage in nested containers: about a file's size."""
    storages: dict[tuple[str, int], int] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(obj, Mapping):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)

    visit(state)
    return sum(storages.values())


def atomic_write_json(data: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Writes JSON durably, like :func:`atomic_save`."""
    target = Path(path)
    payload = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    _atomic_write(target, lambda fh: fh.write(payload))
    return target


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a whole checkpoint; no tensor is built.

    A file is whole when it is a whole ``torch.save`` archive
    (:func:`unison.checkpoint.archive.archive_complete`). A sharded checkpoint's folder is whole
    when every file it recorded is present with its size and CRC-32
    (:func:`unison.checkpoint.sharded_check.sharded_problem`).
    """
    if os.path.isdir(path):
        return sharded_complete(path)
    return archive_complete(path)


def load_checkpoint(path: str | os.PathLike[str], *, checked: bool = False) -> dict[str, Any]:
    """Loads a checkpoint onto the CPU with ``torch.load(weights_only=True)``: a file, or the
    ``rest.pt`` of a sharded checkpoint's folder once the whole folder is checked.

    Args:
        path: the checkpoint file or sharded folder.
        checked: this process has just found it whole (:meth:`Manifest.newest_complete
            <unison.checkpoint.manifest.Manifest.newest_complete>`, :func:`is_complete`): it is
            loaded without reading it all once more to check it. A load that fails is still
            told apart from a damaged file.

    Raises:
        CheckpointError: naming the file, when it is missing, truncated, corrupt, or
            holds objects that ``weights_only`` refuses; with what to do.
    """
    file = Path(path)
    if file.is_dir():
        return _load_sharded_rest(file, checked=checked)
    return load_archive(file, checked=checked)


def _load_sharded_rest(folder: Path, *, checked: bool) -> dict[str, Any]:
    """The ``rest.pt`` of a sharded checkpoint folder, after checking the whole folder (unless ``checked``)."""
    problem = None if checked else sharded_problem(folder)
    if problem is not None:
        raise CheckpointError(
            f"Sharded checkpoint {folder} is incomplete or damaged: {problem}. It was probably cut short by a "
            "crash or a full disk, or damaged on disk. Delete the folder and resume from the previous checkpoint "
            "(resume='auto' skips it by itself)."
        )
    return load_checkpoint(folder / REST, checked=True)  # checked with the folder
