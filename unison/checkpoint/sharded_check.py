"""Checking a sharded checkpoint folder before anything is loaded from it.

A folder from elsewhere (a copied run, a shared filesystem) is read only after every file
it recorded has its size and CRC-32, and its DCP ``.metadata`` is unpickled with only
DCP's own classes allowed: torch's own reader would unpickle anything, so a hostile
folder could run code. What ``.metadata`` declares is then checked
(:mod:`unison.checkpoint.sharded_layout`): every tensor covered exactly by stored pieces.

A problem is one of two kinds (:class:`Problem`): the folder is *damaged* (a save cut
short, a file missing or altered on disk: a resume passes over it to an older one), or it
was written whole but this software *cannot read* it (a class the allow-list refuses, a
field of another type, a layout that does not add up): a resume stops there, since the
checkpoint is probably sound and the software is what changed.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from unison.checkpoint.archive import file_whole
from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.entry import file_in
from unison.checkpoint.sharded_files import CHECKSUMS, REST, files_checksums
from unison.checkpoint.sharded_layout import layout_problem, storage_problem
from unison.utils.run_files import open_fd

_DCP = "torch.distributed.checkpoint"
_DCP_MODULES = (f"{_DCP}.metadata", f"{_DCP}.filesystem")
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
_PATH_MODULES = ("pathlib", "pathlib._local")  # pathlib's classes live in pathlib._local from Python 3.13


class Refused(pickle.UnpicklingError):
    """A ``.metadata`` that refers to something no Distributed Checkpoint's metadata holds."""


class Problem(NamedTuple):
    """What is wrong with a checkpoint, and whether it is damaged or beyond this software."""

    text: str
    unreadable: bool = False
    """Written whole, but this software cannot read it (not a save cut short)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``: its own classes, dtypes, sizes and paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        found = None if "." in name else _metadata_global(module, name)
        if found is None:
            raise Refused(
                f"it refers to {module}.{name}, which is no part of a Distributed Checkpoint's metadata"
            )
        return found


def _metadata_global(module: str, name: str) -> Any:
    """The class or value ``module.name`` names in a ``.metadata``, where it lives in this Python and torch;
    None for anything else. A DCP class moved between DCP's two metadata modules is found at either;
    pathlib's classes under ``pathlib`` and ``pathlib._local`` (Python 3.13) alike."""
    if module in _DCP_MODULES:
        import importlib

        found = getattr(importlib.import_module(module), name, None)
        return found if isinstance(found, type) and found.__module__ in _DCP_MODULES else None
    if module == "torch":
        found = getattr(torch, name, None)
        return found if isinstance(found, torch.dtype) or found is torch.Size else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout  # maps a layout's name to the layout
    if module in _PATH_MODULES and name in _PATHS:
        return getattr(pathlib, name)
    return None


_kept_lock = threading.Lock()
_kept: dict[tuple[int, ...], Any] = {}
"""The ``.metadata`` the last check found sound, by its file's identity, until a load takes it."""


def _identity(found: os.stat_result) -> tuple[int, ...]:
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)


def read_metadata(folder: Path, *, checked: bool = False) -> Any:
    """The ``.metadata`` of a sharded checkpoint folder, unpickled with only DCP's own classes allowed
    (torch's reader would unpickle anything: a folder from elsewhere could run code); a link in its
    place is refused, not followed.

    ``checked``: a load that follows the folder's check takes the copy that check read and found
    sound, once, where it is the same file: unpickling a 184-tensor model's ``.metadata`` took 32
    ms, twice on rank 0 at every resume.
    """
    with os.fdopen(open_fd(folder / ".metadata"), "rb") as fh:
        if checked:
            with _kept_lock:
                kept = _kept.pop(_identity(os.fstat(fh.fileno())), None)
            if kept is not None:
                return kept
        return _MetadataUnpickler(fh).load()


def _keep_for_load(folder: Path, metadata: Any) -> None:
    """Keeps ``metadata``, found sound, for the load that takes it (:func:`read_metadata`); one at most."""
    try:
        identity = _identity(os.stat(folder / ".metadata", follow_symlinks=False))
    except OSError:
        return
    with _kept_lock:
        _kept.clear()
        _kept[identity] = metadata


def sharded_problem(folder: Path, *, require_checksums: bool = True) -> str | None:
    """What is wrong with a sharded checkpoint folder, as a phrase, or None when it is whole
    (:func:`sharded_verdict`, without its kind)."""
    problem = sharded_verdict(folder, require_checksums=require_checksums)
    return None if problem is None else problem.text


def sharded_verdict(
    folder: Path, *, require_checksums: bool = True, share: tuple[int, int] = (0, 1)
) -> Problem | None:
    """What is wrong with a sharded checkpoint folder, and of which kind; None when it is whole.

    Checks every file's size and CRC-32 against ``checksums.json`` (written last, so its
    absence means the save did not finish; ``require_checksums=False`` accepts a folder
    written without one, by DCP alone), that ``.metadata`` reads (with only DCP's own
    classes: nothing in it can run code), that what it declares is sound (every tensor
    covered exactly by stored pieces; :mod:`~unison.checkpoint.sharded_layout`) and names
    files present at their recorded lengths, and that ``rest.pt`` is whole.

    ``share=(k, n)``: one of ``n`` processes checking the folder together (every rank of a
    resume, :func:`unison.checkpoint.ranks.choose`) checks the files :func:`share_of` gives it;
    ``.metadata`` and ``rest.pt`` are checked by share 0. The folder is whole when no share finds
    a problem.
    """
    if not folder.is_dir():
        return Problem("it is not a folder")
    first = share[0] == 0
    try:
        problem = _checksum_problem(folder, require_checksums, share)
        if problem is None and first:
            problem = _metadata_problem(folder, whole=(folder / CHECKSUMS).is_file())
    except CheckpointError as err:  # a file named outside the folder
        return Problem(str(err), unreadable=True)
    if problem is not None or not first:
        return problem
    if not file_in(folder, REST).is_file():
        return Problem(f"it holds no {REST} (the meta record and the objects not stored sharded)")
    # inside a resume's keep_checked, by loading it: its load then reads it no more
    return None if file_whole(folder / REST) else Problem(f"its {REST} is truncated or corrupt")


_WRITTEN_BY = re.compile(r"__(\d+)_\d+\.distcp")


def writer_of(name: str) -> int | None:
    """The rank that wrote a sharded folder's file, from its name (DCP names its data files
    ``__<rank>_<n>.distcp``); None for any other file.

    Example:
        >>> writer_of("__12_0.distcp"), writer_of(".metadata")
        (12, None)
    """
    written = _WRITTEN_BY.fullmatch(name)
    return int(written.group(1)) if written else None


def share_of(names: Iterable[str], share: tuple[int, int]) -> list[str]:
    """The files of a sharded folder, by name, that share ``k`` of ``n`` checks (``share=(k, n)``).

    A data file written by rank ``r`` goes to share ``r mod n``: at the world size it was written
    at, the rank whose load reads that file checks it, so its own page cache, on its own node,
    holds what its load reads next; every other file (``.metadata``, ``rest.pt``) to share 0.

    Example:
        >>> names = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "rest.pt"]
        >>> share_of(names, (0, 3)), share_of(names, (1, 3))
        (['.metadata', '__0_0.distcp', 'rest.pt'], ['__1_0.distcp'])
        >>> share_of(names, (0, 2)), share_of(names, (1, 2))
        (['.metadata', '__0_0.distcp', '__2_0.distcp', 'rest.pt'], ['__1_0.distcp'])
    """
    k, n = share
    return [name for name in sorted(names) if (writer_of(name) or 0) % n == k]


def _checksum_problem(folder: Path, required: bool, share: tuple[int, int] = (0, 1)) -> Problem | None:
    listed = folder / CHECKSUMS
    if not listed.is_file():
        return Problem(f"its {CHECKSUMS} is missing (the save did not finish)") if required else None
    try:
        files = json.loads(listed.read_text())["files"]
        recorded = {n: (int(v["size"]), int(v["crc32"])) for n, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return Problem(f"its {CHECKSUMS} does not read ({type(err).__name__}: {err})")
    mine = [(name, recorded[name]) for name in share_of(recorded, share)]
    paths = {}
    for name, (size, _) in mine:
        path = paths[name] = file_in(folder, name, source=str(listed))
        if not path.is_file():
            return Problem(f"its file {name}, listed in {CHECKSUMS}, is missing")
        if path.stat().st_size != size:
            return Problem(f"its file {name} holds {path.stat().st_size} bytes where {size} were written")
    found = files_checksums(list(paths.values()))  # every size matched: now the bytes, files read at once
    for (name, (_, crc)), (_, got) in zip(mine, found, strict=True):
        if got != crc:
            return Problem(
                f"its file {name} is corrupt (its CRC-32 differs from the one recorded in {CHECKSUMS})"
            )
    return None


def _metadata_problem(folder: Path, *, whole: bool) -> Problem | None:
    """``whole``: the folder's checksums matched, so ``.metadata`` holds the bytes its save wrote."""
    if not (folder / ".metadata").is_file():
        return Problem("it has no .metadata: not a sharded checkpoint, or one whose save did not finish")
    try:
        metadata = read_metadata(folder)
    except Exception as err:  # a damaged or hostile pickle raises many kinds
        refused = f"its .metadata does not read ({type(err).__name__}: {err})"
        return Problem(refused, unreadable=whole or isinstance(err, Refused))
    storage: Any = getattr(metadata, "storage_data", None)
    unsound = storage_problem(storage) or layout_problem(metadata)
    if unsound is not None:
        return Problem(unsound, unreadable=True)
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        path = file_in(folder, name, source=str(folder / ".metadata"))
        if not path.is_file():
            return Problem(f"its shard file {name}, listed in .metadata, is missing")
        if path.stat().st_size < end:
            return Problem(
                f"its shard file {name} holds {path.stat().st_size} bytes where .metadata records {end} (truncated)"
            )
    _keep_for_load(folder, metadata)
    return None


def checkpoint_verdict(path: Path) -> Problem | None:
    """What is wrong with a checkpoint file or sharded folder (:func:`sharded_verdict`); None when whole.

    A file that is not a whole ``torch.save`` archive is damaged.
    """
    if path.is_dir():
        return sharded_verdict(path)
    return None if file_whole(path) else Problem("it is truncated or corrupt (its checksums do not match)")


def sharded_complete(folder: str | os.PathLike[str]) -> bool:
    """Whether a sharded checkpoint folder is whole (:func:`sharded_problem` finds nothing)."""
    return sharded_problem(Path(folder)) is None
