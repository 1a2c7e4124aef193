"""A run's validation history, complete across resumes: ``parts.history`` and ``<run>/history.jsonl``.

Each validation appends one row (epoch, training loss, ``val_<metric>``) to the history that
``metrics.json`` reports. A checkpoint does not hold it, so rank 0 also appends each row to
``<run>/history.jsonl``, one JSON line, flushed and synced to disk before training goes on.
When the trainer starts, the history is what that file holds up to the trainer's epoch: a
fresh run starts empty, a resumed one starts with every row of the epochs its checkpoint
covers, and rows a run killed after its last checkpoint wrote past it are dropped (the resumed
run validates those epochs again). A resumed run's ``metrics.json`` therefore lists every
validation of the run once, as the uninterrupted run's does.

Distributed:
    Every rank holds the history; rank 0 alone reads and writes the file, and the rows it
    reads reach the other ranks with one broadcast when the trainer starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ignite.engine import Engine, Events

from unison.distributed import broadcast_object, rank_zero_only
from unison.utils import get_logger
from unison.utils.run_files import open_file, read_text, replace_file

_log = get_logger(__name__)

HISTORY_FILE = "history.jsonl"
"""The file in the run folder that holds the history, one JSON row per line."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a history file, in order; a missing file has none.

    A line that does not parse as a JSON object (the last one, cut short when the run was
    killed while writing it) ends the history there.
    """
    if not path.is_file():
        return []
    rows: list[dict[str, Any]] = []
    for line in read_text(path, limit=2**30).splitlines():  # never through a link, nor from a FIFO
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if not isinstance(row, dict):
            break
        rows.append(row)
    return rows


def rows_up_to(rows: list[dict[str, Any]], epoch: int) -> list[dict[str, Any]]:
    """The rows of epochs ``<= epoch``: what a trainer at ``epoch`` has validated, once each."""
    kept: dict[int, dict[str, Any]] = {}
    for row in rows:
        at = _epoch(row)
        if at is not None and at <= epoch:
            kept[at] = row  # a later row of an epoch replaces an earlier one
    return [kept[at] for at in sorted(kept)]


def _epoch(row: dict[str, Any]) -> int | None:
    at = row.get("epoch")
    return at if isinstance(at, int) and not isinstance(at, bool) else None


class RunHistory:
    """The owner of a run's history: the rows in memory (``rows``) and their file.

    Args:
        run_dir: the run folder (the same on every rank).
        rows: the list the rows go to (``parts.history``), filled in place.
    """

    def __init__(self, run_dir: Path, rows: list[dict[str, Any]]) -> None:
        self.path = Path(run_dir) / HISTORY_FILE
        self.rows = rows

    def attach(self, trainer: Engine) -> None:
        """Restores the history up to the trainer's epoch whenever the trainer starts.

        Distributed:
            Every rank attaches it: restoring is a collective (a broadcast).
        """
        if not trainer.has_event_handler(self._started, Events.STARTED):
            trainer.add_event_handler(Events.STARTED, self._started)

    def _started(self, trainer: Engine) -> None:
        self.restore(trainer.state.epoch)

    def restore(self, epoch: int) -> None:
        """Collective: call on every rank. The history becomes the file's rows up to ``epoch``.

        Rank 0 rewrites the file without the rows past ``epoch``, when there are any.
        """
        self.rows[:] = broadcast_object(self._read_and_cut(epoch)) or []

    def append(self, row: dict[str, Any]) -> None:
        """Adds a validation's row; rank 0 appends it to the file and syncs it to disk."""
        self.rows.append(row)
        self._write(row)

    @rank_zero_only
    def _write(self, row: dict[str, Any]) -> None:
        with open_file(self.path, "a") as f:
            f.write(_line(row))
            f.flush()
            os.fsync(f.fileno())

    @rank_zero_only
    def _read_and_cut(self, epoch: int) -> list[dict[str, Any]]:
        """Rank 0: the file's rows up to ``epoch``; the file is rewritten when it holds anything else
        (rows past ``epoch``, a line cut short)."""
        found = read_rows(self.path)
        kept = rows_up_to(found, epoch)
        text = "".join(_line(row) for row in kept)
        if self.path.is_file() and read_text(self.path, limit=2**30) != text:
            dropped = sorted({at for at in map(_epoch, found) if at is not None and at > epoch})
            if dropped:
                _log.info(
                    "history: the rows of epochs %s, past the resumed epoch %d, are dropped", dropped, epoch
                )
            replace_file(self.path, text.encode())  # a new temporary file, renamed over the old one
        return kept


def _line(row: dict[str, Any]) -> str:
    """One row as a JSON line (as ``metrics.json`` writes values: NaN kept, anything else as text)."""
    return json.dumps(row, default=str) + "\n"
