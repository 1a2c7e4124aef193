"""The manifest of a checkpoint folder: which files are complete, and what they hold."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from unison.checkpoint.archive import overwritten
from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.entry import Entry, checkpoint_name, entry_for, file_in
from unison.checkpoint.io import atomic_write_json, is_complete, load_checkpoint
from unison.checkpoint.retention import oldest_first
from unison.checkpoint.sharded_check import Problem, checkpoint_verdict
from unison.checkpoint.sharded_files import folder_size, remove
from unison.utils.logging import get_logger
from unison.utils.run_files import read_text

__all__ = ["MANIFEST", "Entry", "Manifest", "checkpoint_name", "entry_for", "read_entries"]

_log = get_logger(__name__)

MANIFEST = "manifest.json"
_NAME = re.compile(r"^(?P<prefix>.+)-e(?P<epoch>\d+)-i(?P<iteration>\d+)\.(pt|dcp)$")


_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "file": ((str,), "a file name"),
    "epoch": ((int,), "an integer >= 0"),
    "iteration": ((int,), "an integer >= 0"),
    "score": ((int, float, type(None)), "a number or null"),
    "saved_at": ((int, float), "a number"),
    "size": ((int,), "an integer >= 0"),
    "sequence": ((int, type(None)), "an integer >= 0 or null"),
}
_COUNTS = ("epoch", "iteration", "size", "sequence")


def read_entries(path: Path) -> list[Entry]:
    """The entries of a ``manifest.json``, every field checked for its type.

    Raises:
        ValueError: naming the file, the entry, the field, the value and what was expected
            (JSON that does not parse, a list where a dict belongs, ``"score": "0.5"``...).
    """
    raw = json.loads(read_text(path, limit=64 * 2**20))  # a regular file, never through a link
    listed = raw.get("checkpoints", []) if isinstance(raw, dict) else raw
    if not isinstance(listed, list):
        raise ValueError(f"{path}: 'checkpoints' is {listed!r}, expected a list of checkpoint records")
    entries = []
    for n, item in enumerate(listed):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: checkpoints[{n}] is {item!r}, expected a record (a dict)")
        for key, value in item.items():
            types, expected = _FIELDS.get(key, ((), f"one of the fields {', '.join(_FIELDS)}"))
            plain = isinstance(value, types) and not isinstance(value, bool)
            if not plain or (key in _COUNTS and value is not None and value < 0):
                raise ValueError(f"{path}: checkpoints[{n}].{key} is {value!r}, expected {expected}")
        missing = [key for key in ("file", "epoch", "iteration") if key not in item]
        if missing:
            raise ValueError(f"{path}: checkpoints[{n}] has no {', '.join(missing)}")
        entries.append(Entry(**item))
    return entries


class Manifest:
    """The list of complete checkpoints in a folder, kept in ``manifest.json``.

    A checkpoint is recorded only after its file is durable, so every entry is a whole
    file. :meth:`rebuild` makes the list agree with the folder after a crash: entries whose
    file is gone are dropped, complete checkpoint files that never made it into the
    manifest are added, and leftover temp files are removed.
    """

    def __init__(self, folder: str | Path, prefix: str = "ckpt") -> None:
        self.folder = Path(folder)
        self.prefix = prefix
        self.entries: list[Entry] = []

    @property
    def path(self) -> Path:
        return self.folder / MANIFEST

    def _read(self) -> list[Entry]:
        if not self.path.exists():
            return []
        try:
            entries = read_entries(self.path)
        except (OSError, ValueError) as err:
            _log.warning("%s is unreadable (%s); rebuilding it from the folder.", self.path, err)
            return []
        for entry in entries:  # a manifest may have been edited: it never names a file elsewhere
            file_in(self.folder, entry.file, source=f"{self.path}")
        return entries

    def rebuild(self) -> Manifest:
        """Reads the manifest and reconciles it with the files in the folder."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(f".{self.prefix}-*.tmp"):  # a file, or a sharded folder being written
            remove(stale)
        for stale in self.folder.glob(f".{MANIFEST}.*.tmp"):
            stale.unlink(missing_ok=True)
        known = {e.file: e for e in self._read() if file_in(self.folder, e.file).exists()}
        found = [*self.folder.glob(f"{self.prefix}-e*-i*.pt"), *self.folder.glob(f"{self.prefix}-e*-i*.dcp")]
        for path in sorted(found):
            if path.name not in known:
                entry = self._entry_from_file(path)
                if entry is not None:
                    known[path.name] = entry
        self.entries = oldest_first(list(known.values()))
        return self

    def _entry_from_file(self, path: Path) -> Entry | None:
        """The entry of a complete checkpoint file the manifest missed; None for any other file."""
        match = _NAME.match(path.name)
        if match is None or match.group("prefix") != self.prefix or not is_complete(path):
            return None
        try:
            meta = load_checkpoint(path, checked=True).get("meta", {})  # is_complete just read it
        except Exception:  # a file that does not load is not a checkpoint we can use
            return None
        _log.warning("Checkpoint %s was not in the manifest (a crash after writing it); adding it.", path)
        sequence = meta.get("sequence")
        return Entry(
            file=path.name,
            epoch=int(match.group("epoch")),
            iteration=int(match.group("iteration")),
            score=meta.get("score"),
            saved_at=path.stat().st_mtime,
            size=folder_size(path) if path.is_dir() else path.stat().st_size,
            sequence=sequence if isinstance(sequence, int) else None,
        )

    def add(self, entry: Entry) -> None:
        """Records ``entry`` (replacing one of the same file), keeping the entries oldest first."""
        self.entries = oldest_first([e for e in self.entries if e.file != entry.file] + [entry])

    def next_sequence(self) -> int:
        """The save sequence of the next checkpoint: one more than any recorded."""
        return 1 + max((e.sequence for e in self.entries if e.sequence is not None), default=0)

    def remove(self, files: set[str]) -> None:
        self.entries = [e for e in self.entries if e.file not in files]

    def write(self) -> None:
        atomic_write_json(
            {"version": 1, "written_at": time.time(), "checkpoints": [asdict(e) for e in self.entries]},
            self.path,
        )

    def newest(self) -> list[Entry]:
        """Entries from newest to oldest (see ``retention.oldest_first``)."""
        return list(reversed(oldest_first(self.entries)))

    def newest_complete(self, verdict: Callable[[Path], Problem | None] = checkpoint_verdict) -> Path | None:
        """The newest recorded checkpoint that is whole, warning of each damaged newer one; None if none is.

        ``verdict`` judges each candidate (default :func:`~unison.checkpoint.sharded_check.checkpoint_verdict`,
        in this process; :func:`unison.checkpoint.ranks.choose` passes one that every rank
        shares).

        A damaged checkpoint (a save cut short, a file altered on disk) is passed over. One
        that was written whole but that this software cannot read (a class the ``.metadata``
        allow-list refuses, a field of another type) stops the search: going on would resume
        from an older checkpoint, or start afresh, over checkpoints that are probably sound.

        Raises:
            CheckpointError: naming every checkpoint of the folder this software cannot read,
                and why; or, when none is whole, naming the damaged ones a resume read straight
                into the run's tensors (:func:`unison.checkpoint.archive.overwritten`): the run
                no longer holds its initial weights, so it cannot start afresh.
        """
        entries = self.newest()
        for n, entry in enumerate(entries):
            path = file_in(self.folder, entry.file, source=str(self.path))
            problem = verdict(path)
            if problem is None:
                return path
            if problem.unreadable:
                raise CheckpointError(self._unreadable(path, problem.text, entries[n + 1 :]))
            _log.warning("Checkpoint %s is damaged (%s); falling back to an older one.", path, problem.text)
        spoiled = overwritten()
        if spoiled:
            raise CheckpointError(
                f"No checkpoint in {self.folder} is whole, and reading {', '.join(spoiled)} wrote into the "
                "run's model and optimizer before its damage showed: the run cannot start afresh from its "
                "initial weights. Move the damaged checkpoints out of the folder and start again to train "
                "afresh, or resume from a sound copy by its path."
            )
        return None

    def _unreadable(self, path: Path, why: str, older: list[Entry]) -> str:
        others = []
        for entry in older:
            problem = checkpoint_verdict(file_in(self.folder, entry.file, source=str(self.path)))
            if problem is not None and problem.unreadable:
                others.append(f"{entry.file} ({problem.text})")
        listed = f"; older ones this software cannot read either: {'; '.join(others)}" if others else ""
        return (
            f"Checkpoint {path} was written whole but cannot be read by this software: {why}{listed}. Nothing "
            "was resumed, and nothing in the folder was changed. Resume with the software that wrote it (a "
            "torch or Python version change moves the classes a checkpoint names; `unison doctor` lists the "
            "versions), or resume from a checkpoint by its path."
        )

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoints": [asdict(e) for e in self.entries]}
