"""One manifest entry: a durable checkpoint file, where it was taken, and when it was saved."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from unison.checkpoint.checkpoint_error import CheckpointError


@dataclass(eq=False)
class Entry:
    """One durable checkpoint.

    Two entries are equal when every field is: a NaN score equals a NaN score, so that
    two records of one checkpoint (one read back from ``manifest.json``) are equal on
    every Python, whatever the float objects they hold.

    Attributes:
        file: the file name, inside the checkpoint folder.
        epoch: the trainer's epoch at the save.
        iteration: the trainer's iteration at the save.
        score: the value of the ranking metric, or None.
        saved_at: the wall-clock time the file became durable.
        size: the file's size in bytes.
        sequence: the save's rank in the folder's history, 1 for its first save; None for
            files written before unison recorded it. Defines which checkpoint is newest.
    """

    file: str
    epoch: int
    iteration: int
    score: float | None = None
    saved_at: float = 0.0
    size: int = 0
    sequence: int | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return self._identity() == other._identity()

    def _identity(self) -> tuple[Any, ...]:
        """Every field's value, a NaN as a marker that equals itself (NaN != NaN)."""
        values = (getattr(self, f.name) for f in fields(self))
        return tuple(("nan",) if isinstance(v, float) and math.isnan(v) else v for v in values)


def checkpoint_name(prefix: str, epoch: int, iteration: int) -> str:
    """The file name of the checkpoint taken at ``epoch`` and ``iteration``: ``<prefix>-e0003-i000001200.pt``."""
    return f"{prefix}-e{epoch:04d}-i{iteration:09d}.pt"


def entry_for(meta: Mapping[str, Any], prefix: str, *, sharded: bool = False) -> Entry:
    """The manifest entry of a checkpoint with this ``meta``, before its file is durable.

    A score that is not finite is recorded as None: never the best, and ``manifest.json``
    stays strict JSON.
    """
    score = meta.get("score")
    if score is not None and not math.isfinite(score):
        score = None
    name = checkpoint_name(prefix, meta["epoch"], meta["iteration"])
    return Entry(
        file=name[: -len(".pt")] + ".dcp" if sharded else name,
        epoch=meta["epoch"],
        iteration=meta["iteration"],
        score=score,
        sequence=meta.get("sequence"),
    )


def file_in(folder: Path, name: str, *, source: str = "a checkpoint entry") -> Path:
    """``folder / name`` for a plain file name; a path that could reach outside ``folder`` is refused.

    Every file a manifest names goes through here before it is read, written or deleted:
    a manifest travels with its folder and may have been edited.

    Raises:
        CheckpointError: naming ``source``, the name, and the fix.

    Example:
        >>> file_in(Path("ckpts"), "ckpt-e0001-i000000010.pt").as_posix()
        'ckpts/ckpt-e0001-i000000010.pt'
    """
    plain = (
        isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name
    )
    if not plain:
        raise CheckpointError(
            f"{source} names {name!r}, which is not a file of the checkpoint folder {folder} (a path, an absolute "
            "name or '..'): unison never reads, writes or deletes outside that folder. Remove the entry, or delete "
            "manifest.json: it is rebuilt from the files in the folder."
        )
    return folder / name
