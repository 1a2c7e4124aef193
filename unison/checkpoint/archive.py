"""One ``torch.save`` archive: whether it is whole (its CRC-32s, or its structure), and loading it safely."""

from __future__ import annotations

import os
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from unison.checkpoint.archive_load import Damaged, read_archive
from unison.checkpoint.archive_records import records, unrecorded_note
from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.crc import range_crcs
from unison.checkpoint.in_place import Into
from unison.checkpoint.snapshot import default_threads
from unison.utils.run_files import open_fd


def archive_complete(path: str | os.PathLike[str]) -> bool:
    """Whether the file ``path`` is a whole ``torch.save`` archive; no tensor is built.

    Every member's CRC-32 is checked, in one pass over the file: blocks of its records are
    read and checksummed by several threads at once (:func:`unison.checkpoint.crc.range_crcs`),
    the kernel told the file is read in order. A member whose recorded CRC is zero although it holds
    data was written with ``torch.serialization.set_crc32_options(False)``: its CRC was not
    recorded, so the archive's structure is checked instead (the central directory reads,
    every record's local header is where the directory says, and its stored size fits the
    file). That catches truncation and most damage, not flipped bytes inside a record; a
    log line says so.
    """
    try:
        # One descriptor for both, opened as a run folder's files are: a link or a FIFO is refused.
        with os.fdopen(open_fd(path), "rb", buffering=0) as raw, zipfile.ZipFile(raw) as archive:
            _read_ahead(raw.fileno(), 0, 0, getattr(os, "POSIX_FADV_SEQUENTIAL", 0))
            found = records(raw, archive)
            if found is None:
                return False
            checked = [(r.start, r.size) for r in found if r.crc is not None]
            if range_crcs(raw.fileno(), checked, default_threads()) != [
                r.crc for r in found if r.crc is not None
            ]:
                return False
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False
    if any(r.crc is None for r in found):
        unrecorded_note(path)
    return True


def _read_ahead(fd: int, offset: int, length: int, advice: int) -> None:
    """``posix_fadvise`` where there is one: the disk reads ahead while the CRC-32s are computed."""
    if advice and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, advice)
        except OSError:  # pragma: no cover - a file system that refuses the advice
            pass


class _Frame:
    """One :func:`keep_checked` entered: the state of the file last found whole by loading it, by the
    file's identity, and the run's tensors its reads go into (or None)."""

    def __init__(self, into: Into | None) -> None:
        self.states: dict[tuple[int, ...], Any] = {}
        self.into = into


class _Kept(threading.local):
    """Per thread, the :func:`keep_checked` frames entered, innermost last."""

    def __init__(self) -> None:
        self.stack: list[_Frame] = []


_kept = _Kept()


@contextmanager
def keep_checked(into: Into | None = None) -> Iterator[None]:
    """Inside, :func:`file_whole` finds a file whole by loading it (one read, every CRC-32 checked)
    and keeps its state for the :func:`load_archive` of the same file with ``checked=True``
    that follows: a check and its load read the file once. The state is let go on leaving.

    With ``into`` (a resume's own tensors), both read big records straight into those tensors
    (:mod:`unison.checkpoint.in_place`); :func:`overwritten` then lists the files read into them.
    """
    frame = _Frame(into)
    _kept.stack.append(frame)
    try:
        yield
    finally:
        _kept.stack.remove(frame)
        frame.states.clear()


def overwritten() -> list[str]:
    """The checkpoint files read into the run's own tensors inside the innermost :func:`keep_checked`,
    whole or damaged (none outside one): once any was, those tensors no longer hold what the run
    started with."""
    into = _into()
    return list(into.files) if into is not None else []


def _into() -> Into | None:
    return _kept.stack[-1].into if _kept.stack else None


def _identity(path: str | os.PathLike[str]) -> tuple[int, ...]:
    found = os.stat(path, follow_symlinks=False)
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)


def file_whole(path: str | os.PathLike[str]) -> bool:
    """:func:`archive_complete`; inside :func:`keep_checked`, found by loading the file, its state kept."""
    if not _kept.stack:
        return archive_complete(path)
    try:
        state = read_archive(path, verify=True, into=_into())
    except Damaged:
        return False
    except Exception:  # noqa: BLE001 - missing, or whole but not loadable: the load says why
        return archive_complete(path)
    _kept.stack[-1].states.clear()  # one state at most
    _kept.stack[-1].states[_identity(path)] = state
    return True


def load_archive(file: Path, *, checked: bool = False) -> dict[str, Any]:
    """Loads a checkpoint file onto the CPU with ``torch.load(weights_only=True)``, every record's
    CRC-32 checked as it is read (:func:`unison.checkpoint.archive_load.read_archive`) unless this
    process has just ``checked`` the file (then a state kept by :func:`keep_checked` is taken).

    Raises:
        CheckpointError: naming the file, when it is missing, truncated, corrupt, or
            holds objects that ``weights_only`` refuses; with what to do.
    """
    if not file.is_file():
        raise CheckpointError(
            f"Checkpoint {file} does not exist. Check the path, or resume='auto' to pick the newest."
        )
    if file.is_symlink():  # its checks open files without following links: say so, not "corrupt"
        raise CheckpointError(
            f"Checkpoint {file} is a symbolic link (to {os.path.realpath(file)}); checkpoints are read "
            "without following links. Give the file it points to."
        )
    kept = _kept.stack[-1].states.pop(_identity(file), None) if checked and _kept.stack else None
    if kept is not None:
        state = kept
    else:
        state = _read(file, checked)
    if not isinstance(state, dict):
        raise CheckpointError(f"Checkpoint {file} holds a {type(state).__name__}, not a dict of states.")
    return state


def _read(file: Path, checked: bool) -> Any:
    try:  # read once, into the tensors, every record's CRC-32 checked as it is read (unless just checked)
        state = read_archive(file, verify=not checked, into=_into())
    except Damaged as err:
        # torch.load does not verify the archive's checksums: damaged bytes would load as wrong weights.
        raise CheckpointError(
            f"Checkpoint {file} is truncated or corrupt ({err}). It was probably cut short by a crash or a "
            "full disk, or damaged on disk. Delete it and resume from the previous checkpoint (resume='auto' "
            "skips it by itself)."
        ) from None
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError, zip errors...
        if not archive_complete(file):
            raise CheckpointError(
                f"Checkpoint {file} is truncated or corrupt ({type(err).__name__}: {err}). It was probably "
                "cut short by a crash or a full disk. Delete it and resume from the previous checkpoint "
                "(resume='auto' skips it by itself)."
            ) from err
        raise CheckpointError(
            f"Checkpoint {file} could not be loaded with torch.load(weights_only=True): {err}. It holds "
            "Python objects beyond tensors and plain containers; unison's checkpoints never do, so it "
            "was written by other code. Load it yourself if you trust its source."
        ) from err
    return state
