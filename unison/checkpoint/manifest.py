"""The manifest of a checkpoint folder: which files are complete, and what they hold."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from unison.checkpoint.io import atomic_write_json, is_complete, load_checkpoint
from unison.utils.logging import get_logger

_log = get_logger(__name__)

MANIFEST = "manifest.json"
_NAME = re.compile(r"^(?P<prefix>.+)-e(?P<epoch>\d+)-i(?P<iteration>\d+)\.pt$")


@dataclass
class Entry:
    """One durable checkpoint."""

    file: str
    epoch: int
    iteration: int
    score: float | None = None
    saved_at: float = 0.0
    size: int = 0


def checkpoint_name(prefix: str, epoch: int, iteration: int) -> str:
    """The file name of the checkpoint taken at ``epoch`` and ``iteration``: ``<prefix>-e0003-i000001200.pt``."""
    return f"{prefix}-e{epoch:04d}-i{iteration:09d}.pt"


def entry_for(meta: Mapping[str, Any], prefix: str) -> Entry:
    """The manifest entry of a checkpoint with this ``meta``, before its file is durable.

    A score that is not finite is recorded as None: never the best, and ``manifest.json``
    stays strict JSON.
    """
    score = meta.get("score")
    if score is not None and not math.isfinite(score):
        score = None
    return Entry(
        file=checkpoint_name(prefix, meta["epoch"], meta["iteration"]),
        epoch=meta["epoch"],
        iteration=meta["iteration"],
        score=score,
    )


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
            return [Entry(**item) for item in raw.get("checkpoints", [])]
        except (ValueError, TypeError, KeyError) as err:
            _log.warning("%s is unreadable (%s); rebuilding it from the folder.", self.path, err)
            return []

    def rebuild(self) -> Manifest:
        """Reads the manifest and reconciles it with the files in the folder."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(f".{self.prefix}-*.tmp"):
            stale.unlink(missing_ok=True)
        for stale in self.folder.glob(f".{MANIFEST}.*.tmp"):
            stale.unlink(missing_ok=True)
        known = {e.file: e for e in self._read() if (self.folder / e.file).is_file()}
        for path in sorted(self.folder.glob(f"{self.prefix}-e*-i*.pt")):
            if path.name in known:
                continue
            match = _NAME.match(path.name)
            if match is None or match.group("prefix") != self.prefix or not is_complete(path):
                continue
            score = None
            try:
                score = load_checkpoint(path).get("meta", {}).get("score")
            except Exception:  # a file that does not load is not a checkpoint we can use
                continue
            _log.warning("Checkpoint %s was not in the manifest (a crash after writing it); adding it.", path)
            known[path.name] = Entry(
                file=path.name,
                epoch=int(match.group("epoch")),
                iteration=int(match.group("iteration")),
                score=score,
                saved_at=path.stat().st_mtime,
                size=path.stat().st_size,
            )
        self.entries = sorted(known.values(), key=lambda e: (e.iteration, e.saved_at))
        return self

    def add(self, entry: Entry) -> None:
        self.entries = [e for e in self.entries if e.file != entry.file] + [entry]
        self.entries.sort(key=lambda e: (e.iteration, e.saved_at))

    def remove(self, files: set[str]) -> None:
        self.entries = [e for e in self.entries if e.file not in files]

    def write(self) -> None:
        atomic_write_json(
            {"version": 1, "written_at": time.time(), "checkpoints": [asdict(e) for e in self.entries]},
            self.path,
        )

    def newest(self) -> list[Entry]:
        """Entries from newest to oldest."""
        return list(reversed(self.entries))

    def newest_complete(self) -> Path | None:
        """The newest recorded file that is whole, warning of each damaged newer one; None if none is."""
        for entry in self.newest():
            path = self.folder / entry.file
            if is_complete(path):
                return path
            _log.warning(
                "Checkpoint %s is damaged (truncated or corrupt); falling back to an older one.", path
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoints": [asdict(e) for e in self.entries]}
