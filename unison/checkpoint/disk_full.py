"""A save that fails leaves no partial file or temporary folder, and a full disk is named as such.

torch reports a full disk in many ways: ``OSError(ENOSPC)`` from a write or an fsync, or
only a short write (``unexpected pos 704 vs 598`` from its archive writer), and DCP wraps
each rank's error in a ``CheckpointException``. :func:`unwritten` removes the temporary
folder and gives the error to raise: for a full disk, one naming the folder, what this
rank's shards needed and what is free there. :func:`disk_full_error` is a checkpoint file's
(:class:`CheckpointDiskFull`, which the file's writer raises once it removed the partial file).
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.io import state_bytes

if TYPE_CHECKING:
    from unison.checkpoint.manifest import Manifest

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_SHORT_WRITE = "unexpected pos"


def rank_errors(err: BaseException) -> list[BaseException]:
    """The errors inside ``err``: each rank's, where DCP wrapped them in a ``CheckpointException``."""
    failures: Mapping[int, Any] = getattr(err, "failures", None) or {}
    found = [pair[0] if isinstance(pair, tuple) else pair for _, pair in sorted(failures.items())]
    inner = [e for e in found if isinstance(e, BaseException)]
    return inner or [err]


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or a rank's error inside it, or its cause) says the disk is full."""
    seen: set[int] = set()
    for inner in rank_errors(err):
        current: BaseException | None = inner
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            if isinstance(current, OSError) and current.errno in _FULL:
                return True
            if _SHORT_WRITE in str(current):
                return True
            current = current.__cause__ or current.__context__
    return False


def _bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return int(local.numel() * local.element_size())
    if isinstance(state, Mapping):
        return sum(_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_bytes(v) for v in state)
    return 0


def unwritten(err: BaseException, tmp: Path, states: Mapping[str, Any] | None = None) -> BaseException:
    """Removes ``tmp`` (a sharded save's temporary folder) and returns the error to raise for ``err``.

    A full disk gives a :class:`CheckpointError` naming the folder, the bytes this rank's
    shards needed (when ``states`` is given) and the bytes free; any other error is ``err``.
    """
    shutil.rmtree(tmp, ignore_errors=True)
    if not is_disk_full(err):
        return err
    where = tmp.parent
    try:
        free = f"{shutil.disk_usage(where).free:,} bytes are free there"
    except OSError:
        free = "its free space could not be read"
    needed = f"this rank's shards need about {_bytes(states):,} bytes; " if states is not None else ""
    cause = rank_errors(err)[0]
    return CheckpointError(
        f"The sharded checkpoint {tmp.name[1:-4]} could not be written: the disk holding {where} is full "
        f"({type(cause).__name__}: {cause}). {needed}{free}. The partial folder {tmp} was removed and the previous "
        "checkpoints are untouched. Free space there, keep fewer checkpoints (checkpoint.keep_last), or put the runs "
        "on another disk (logging.root)."
    )


class CheckpointDiskFull(OSError):
    """A checkpoint did not fit on its disk; the message says how much was needed and free."""


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_full_error(path: Path, state: Mapping[str, Any], manifest: Manifest) -> CheckpointDiskFull:
    """The error of a checkpoint file that did not fit: the file, the folder, space needed and free,
    what to do."""
    try:
        free = _size(shutil.disk_usage(path.parent).free)
    except OSError:
        free = "an unknown amount"
    previous = manifest.newest()
    intact = (
        f"The previous checkpoint {previous[0].file} is intact (nothing was deleted, the manifest is unchanged)."
        if previous
        else "No earlier checkpoint was recorded in this folder; nothing was deleted."
    )
    message = (
        f"No space left on device while writing checkpoint {path.name} in {path.parent}: it needs about "
        f"{_size(state_bytes(state))} and the disk has {free} free. The partial file was removed. {intact} "
        "Free some space (or point the checkpoint folder at a larger disk, or keep fewer checkpoints with "
        "keep_last), then resume with resume('auto')."
    )
    return CheckpointDiskFull(errno.ENOSPC, message, str(path))
