"""The manifest of a checkpoint folder: which files are complete, and what they hold."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from unison.checkpoint.entry import Entry, checkpoint_name, entry_for, file_in
from unison.checkpoint.io import atomic_write_json, is_complete, load_checkpoint
from unison.checkpoint.retention import oldest_first
from unison.checkpoint.sharded import folder_size, remove
from unison.utils.logging import get_logger

__all__ = ["MANIFEST", "Entry", "Manifest", "checkpoint_name", "entry_for"]

_log = get_logger(__name__)

MANIFEST = "manifest.json"
_NAME = re.compile(r"^(?P<prefix>.+)-e(?P<epoch>\d+)-i(?P<iteration>\d+)\.(pt|dcp)$")


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
            raw = json.loads(self.path.read_text())
            entries = [Entry(**item) for item in raw.get("checkpoints", [])]
        except (ValueError, TypeError, KeyError) as err:
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
            meta = load_checkpoint(path).get("meta", {})
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

    def newest_complete(self) -> Path | None:
        """The newest recorded file that is whole, warning of each damaged newer one; None if none is."""
        for entry in self.newest():
            path = file_in(self.folder, entry.file, source=str(self.path))
            if is_complete(path):
                return path
            _log.warning(
                "Checkpoint %s is damaged (truncated or corrupt); falling back to an older one.", path
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoints": [asdict(e) for e in self.entries]}
