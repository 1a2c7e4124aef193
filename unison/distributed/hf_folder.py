"""A folder written by ``datasets``' ``save_to_disk``, checked as data from elsewhere before ``datasets`` reads it.

``datasets.load_from_disk`` trusts the folder: ``state.json`` names the arrow files it
opens (a ``../`` or an absolute name reads outside the folder; a FIFO waits for a writer
for good), ``dataset_dict.json`` names the split folders, and ``dataset_info.json``'s
features decide how a row is decoded (an ``Image``, ``Audio``, ``Video`` or ``Pdf`` column
opens the local path or fetches the URL a row names). Here:

- :func:`check_folder`: the JSON files are regular files of at most :data:`MAX_JSON` bytes,
  and every split folder and arrow file they name is inside the folder (relative, no ``..``,
  no link out), the arrow files regular files: checked with ``stat``, which opens nothing;
- :func:`check_features`: every kept column's feature, nested ones included (a ``List``, a
  dict), is plain data, or a decoded type with ``decode=False`` (its bytes and path are
  handed over as they are).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["MAX_JSON", "DatasetFolderError", "check_features", "check_folder"]

MAX_JSON = 16 << 20
"""The largest ``state.json``, ``dataset_info.json`` or ``dataset_dict.json`` read (16 MiB)."""

PLAIN = frozenset(
    {"Value", "ClassLabel", "Array2D", "Array3D", "Array4D", "Array5D", "Json", "Translation"}
    | {"TranslationVariableLanguages"}
)
"""Feature types whose rows are the values stored in the arrow file: nothing is opened to decode them."""

NESTED = frozenset({"Sequence", "List", "LargeList"})

_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class DatasetFolderError(ValueError):
    """A saved dataset folder that reads outside itself, or holds a column decoded from a path or URL."""


def _inside(root: Path, base: Path, name: Any, what: str, folder: bool = False) -> Path:
    """``root / name``, resolved, if ``name`` is a relative name that stays inside ``base`` and is
    a regular file (or, with ``folder``, a folder)."""
    parts = PurePosixPath(name).parts if isinstance(name, str) and name else ()
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name:
        raise DatasetFolderError(
            f"{root}: {what} names {name!r}; expected a relative name inside the folder (no '..', not absolute). "
            "The folder is not one save_to_disk wrote: save the dataset again"
        )
    path = (root / name).resolve()
    if not path.is_relative_to(base):
        raise DatasetFolderError(
            f"{root}: {what} names {name!r}, which leads out of the folder ({base}) to {path} through a link. "
            "Copy the dataset with its files in place (cp -rL) and name that copy"
        )
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise DatasetFolderError(f"{root}: {what} names {name!r}, which cannot be read: {err}") from None
    if folder and not stat.S_ISDIR(mode) or not folder and not stat.S_ISREG(mode):
        kind = _KINDS.get(
            stat.S_IFMT(mode), "a regular file" if stat.S_ISREG(mode) else "another kind of entry"
        )
        raise DatasetFolderError(
            f"{root}: {what} names {name!r}, which is {kind}, not {'a folder' if folder else 'a regular file'}: "
            "only the folder's own files and folders are read"
        )
    return path


def _json(folder: Path, base: Path, name: str) -> Any:
    """The JSON file ``name`` of ``folder``: a regular file inside ``base``, at most :data:`MAX_JSON` bytes."""
    path = _inside(folder, base, name, "the folder")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DatasetFolderError(f"{path} is not a regular file; only the folder's own files are read")
        text = file.read(MAX_JSON + 1)
    if len(text) > MAX_JSON:
        raise DatasetFolderError(f"{path} is larger than {MAX_JSON} bytes: not a file save_to_disk wrote")
    try:
        return json.loads(text)
    except ValueError as err:
        raise DatasetFolderError(f"{path} is not JSON ({err}): not a file save_to_disk wrote") from None


def _check_dataset(folder: Path, base: Path) -> None:
    state = _json(folder, base, "state.json")
    _json(folder, base, "dataset_info.json")
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise DatasetFolderError(
            f"{folder / 'state.json'} has no list of _data_files: not a file save_to_disk wrote"
        )
    for entry in files:
        _inside(folder, base, entry.get("filename"), "state.json's _data_files")


def check_folder(folder: Path | str) -> None:
    """Checks the saved dataset (or ``DatasetDict``) in ``folder`` before ``datasets`` opens a file of it.

    A folder holding neither ``state.json`` and ``dataset_info.json`` nor ``dataset_dict.json``
    is left to ``datasets`` (whose error says what it looked for).

    Raises:
        DatasetFolderError: naming the file and the name in it that is refused, and why.
    """
    base = Path(folder).resolve()
    if any(os.path.lexists(base / name) for name in ("state.json", "dataset_info.json")):
        _check_dataset(base, base)
    elif os.path.lexists(base / "dataset_dict.json"):
        splits = _json(base, base, "dataset_dict.json")
        names = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(names, list):
            raise DatasetFolderError(
                f"{base / 'dataset_dict.json'} has no list of splits: not a file save_to_disk wrote"
            )
        for name in names:
            _check_dataset(_inside(base, base, name, "dataset_dict.json's splits", folder=True), base)


def _decoded(feature: Any, where: str) -> list[str]:
    """The columns under ``feature`` (named ``where``) decoded from what a row names, as ``'name' (Type)``."""
    if isinstance(feature, dict):
        return [
            c for key, sub in feature.items() for c in _decoded(sub, f"{where}.{key}" if where else str(key))
        ]
    if isinstance(feature, (list, tuple)):
        return _decoded(feature[0], f"{where}[]") if feature else []
    kind = type(feature).__name__
    if kind in NESTED:
        return _decoded(feature.feature, f"{where}[]")
    if kind in PLAIN or getattr(feature, "decode", True) is False:
        return []
    return [f"{where!r} ({kind})"]


def check_features(features: Any, folder: Path | str) -> None:
    """Refuses a column of ``features`` (a ``datasets.Features``) decoded from a path or URL a row
    names: ``Image``, ``Audio``, ``Video``, ``Pdf`` and any type not known to hold plain values.

    Raises:
        DatasetFolderError: naming each such column, its type and the fix.
    """
    found = _decoded(dict(features), "")
    if found:
        raise DatasetFolderError(
            f"{folder}: the columns {', '.join(found)} are decoded from the local path or the URL each row "
            "names, which would open any file or fetch any address a dataset from elsewhere holds. Fix: leave "
            "them out (data.stream.columns, or load_split's columns), or store what they decode to before "
            "save_to_disk (dataset.map to an array column), or cast them to raw bytes and path with "
            "dataset.cast_column(name, Image(decode=False)) (or Audio(decode=False) ...) and decode in your code"
        )
