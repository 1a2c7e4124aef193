"""DCP's tensors written without torch's per-record CRC-32s, the file's own checksum covering them.

DCP's :class:`~torch.distributed.checkpoint.FileSystemWriter` writes each tensor of a sharded
checkpoint with its own ``torch.save``, and ``torch.save`` computes a CRC-32 of every record it
writes, on one core: 15 ms per 64 MiB here, 110 ms of CPU for each rank's 500 MB of a 1 GB
model at 2 ranks, at every save. Nothing reads them back: ``torch.load`` does not check a
record's CRC-32 (a record with a flipped byte loads, flipped), and unison's reads of a sharded
checkpoint go around ``torch.load``. What protects a sharded checkpoint is the CRC-32 of each
whole file, computed as it is written (:mod:`unison.checkpoint.dcp_files`, zlib-ng on several
threads) and checked before any of it is loaded: it covers every byte of every record.

:func:`records_without_crcs` turns the per-record CRC-32s off for the ``torch.save`` calls of
the thread that enters it, and for no other: torch reads its setting through
``torch.serialization.get_crc32_options`` whenever a save opens its zip writer, and while any
thread is inside, that function is one that answers False to the threads inside and torch's
setting to every other (a user's ``torch.save`` beside an asynchronous save keeps its CRC-32s).
Torch's own function is put back when the last thread leaves. A torch that no longer reads the
setting there (see ``unison doctor``) simply keeps computing them: correct, only slower.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.serialization

__all__ = ["records_without_crcs"]

_inside = threading.local()
_lock = threading.Lock()
_entered = 0
"""Threads inside :func:`records_without_crcs` now (its nested uses counted once each)."""
_torch_own: Callable[[], bool] | None = None
"""``torch.serialization.get_crc32_options`` as it was when the first thread entered."""


def _per_thread() -> bool:
    """What ``torch.save`` reads as ``get_crc32_options()`` while a thread is inside: False to
    the threads inside, torch's own answer to every other."""
    if getattr(_inside, "depth", 0):
        return False
    own = _torch_own  # None once the last thread left: a save that looked the function up before
    return bool(own()) if own is not None and own is not _per_thread else _setting()


def _setting() -> bool:
    """torch's setting, read as its own function reads it (True, torch's default, where unknown)."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # pragma: no cover - a torch without it has no such setting either
        return True
    return bool(config.save.compute_crc32)


@contextmanager
def records_without_crcs() -> Iterator[None]:
    """Within it, this thread's ``torch.save`` writes its records without CRC-32s (their crc
    field is 0), as with ``torch.serialization.set_crc32_options(False)``; other threads' saves
    are as torch's setting has them.

    Example:
        >>> import io, zipfile
        >>> buffer = io.BytesIO()
        >>> with records_without_crcs():
        ...     torch.save(torch.ones(3), buffer)
        >>> {i.CRC for i in zipfile.ZipFile(buffer).infolist()}
        {0}
        >>> torch.serialization.get_crc32_options()
        True
    """
    global _entered, _torch_own
    with _lock:
        if _entered == 0:
            _torch_own = torch.serialization.get_crc32_options
            torch.serialization.get_crc32_options = _per_thread
        _entered += 1
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1
        with _lock:
            _entered -= 1
            if _entered == 0:
                if torch.serialization.get_crc32_options is _per_thread:  # not replaced by someone since
                    torch.serialization.get_crc32_options = _torch_own  # type: ignore[assignment]
                _torch_own = None
