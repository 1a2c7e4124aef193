"""The input side of a :class:`~unison.distributed.file_dataset.FileDataset`: which files, how
many samples each holds, and an identity of files and functions that changes when they do.

The identity is what a cache is keyed by: a file's size and modification time (every file
inside a folder such as a zarr store), and a function's qualified name with a hash of its
source. A cache built from other inputs or other functions is never taken for this one.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from unison.utils.confine import ConfinementError, confined_path

__all__ = ["callable_identity", "count_samples", "file_identity", "resolve_files"]

COUNT_ARRAYS = ("num_samples", "num_causal_sets")
"""Root arrays of a zarr store whose first element is the number of samples it holds."""


def resolve_files(files: Sequence[str | os.PathLike[str]], root: str | os.PathLike[str] | None) -> list[Path]:
    """The absolute paths of ``files``, each checked to exist.

    With ``root``, every entry is a path relative to it and must stay inside it (no ``..``
    escape, no absolute path, no link out); without, relative entries are taken from the
    current folder.

    Raises:
        TypeError: ``files`` is a single path or holds something other than paths.
        ValueError: ``files`` is empty, or an entry reaches outside ``root``.
        FileNotFoundError: an entry does not exist.
    """
    if isinstance(files, (str, os.PathLike)):
        raise TypeError(
            f"FileDataset(files=...) needs a list of paths, got one path {str(files)!r}: write [{str(files)!r}]."
        )
    if not files:
        raise ValueError("FileDataset(files=...) is empty: name at least one file to read samples from.")
    paths = []
    for k, entry in enumerate(files):
        if not isinstance(entry, (str, os.PathLike)):
            raise TypeError(
                f"FileDataset(files=...)[{k}] must be a path, got {type(entry).__name__}: {entry!r}."
            )
        if root is None:
            path = Path(entry).expanduser().resolve()
        else:
            try:
                path = confined_path(os.fspath(entry), Path(root))
            except ConfinementError as err:
                raise ValueError(
                    f"FileDataset(files=...)[{k}] = {os.fspath(entry)!r} is refused: {err}. Name files "
                    f"inside root={os.fspath(root)!r}, relative to it."
                ) from None
        if not path.exists():
            raise FileNotFoundError(f"FileDataset(files=...)[{k}]: {path} does not exist; check the path.")
        paths.append(path)
    return paths


def file_identity(path: Path) -> dict[str, int]:
    """Size and modification time of a file, or of every file inside a folder (a zarr store).

    Any write to the data changes it: a folder's entry counts its files, their total size
    and the newest modification time among them and its folders.
    """
    if not path.is_dir():
        stat = path.stat()
        return {"files": 1, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    count, size, newest = 0, 0, path.stat().st_mtime_ns
    for folder, dirs, names in os.walk(path):
        dirs.sort()
        newest = max(newest, os.stat(folder).st_mtime_ns)
        for name in names:
            stat = os.stat(os.path.join(folder, name))
            count, size, newest = count + 1, size + stat.st_size, max(newest, stat.st_mtime_ns)
    return {"files": count, "bytes": size, "mtime_ns": newest}


def callable_identity(fn: Callable[..., Any] | None) -> str | None:
    """A text that changes when the function, its source or its bound arguments change.

    ``module.qualname#<hash of the source>`` (the user's script is ``__main__`` whether it runs
    or a spawned rank imports it as ``__mp_main__``); a ``functools.partial`` adds its arguments; an
    instance with ``__call__`` is named by its class, plus its ``repr`` when that is not the
    default one (which would hold a memory address and change every run).
    """
    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        return f"{callable_identity(fn.func)}(*{fn.args!r}, **{dict(sorted(fn.keywords.items()))!r})"
    target: Any = fn if inspect.isfunction(fn) or inspect.isclass(fn) or inspect.ismethod(fn) else type(fn)
    target = getattr(target, "__func__", target)
    module = getattr(target, "__module__", "?")
    if module == "__mp_main__":  # the user's script, as a spawned rank (or --main) imports it
        module = "__main__"
    name = f"{module}.{getattr(target, '__qualname__', type(target).__name__)}"
    try:
        name += "#" + hashlib.sha256(inspect.getsource(target).encode()).hexdigest()[:16]
    except (OSError, TypeError):  # a builtin, or a function defined where no source is kept
        pass
    if target is type(fn) and type(fn).__repr__ is not object.__repr__:
        name += f" {fn!r}"
    return name


def count_samples(path: Path) -> int:
    """How many samples a zarr store holds, read from the store itself.

    In order: a root array named ``num_samples`` or ``num_causal_sets`` (its first element);
    else the common length of the root's one-dimensional arrays; else the number of groups
    under the root (one sample per group). Any other file needs ``count=`` or a reader with
    a ``count(path)`` method.

    Raises:
        ValueError: the path is not a zarr store, or the store says nothing of its size.
    """
    fix = "pass FileDataset(count=...) a function path -> number of samples, or give the reader a count(path) method"
    if not (path / "zarr.json").exists() and not (path / ".zgroup").exists():
        raise ValueError(f"FileDataset cannot tell how many samples {path} holds (not a zarr store): {fix}.")
    try:
        import zarr  # optional: only a zarr store needs it, and only when nothing else counts
    except ImportError:
        raise ValueError(
            f"{path} is a zarr store but zarr is not installed: pip install zarr, or {fix}."
        ) from None
    group = zarr.open_group(str(path), mode="r")
    arrays = dict(group.arrays())
    for name in COUNT_ARRAYS:
        if name in arrays and arrays[name].size:
            return int(np.ravel(arrays[name][:])[0])
    lengths = {a.shape[0] for a in arrays.values() if len(a.shape) == 1}
    if len(lengths) == 1:
        return lengths.pop()
    groups = list(group.group_keys())
    if groups:
        return len(groups)
    raise ValueError(
        f"FileDataset cannot tell how many samples the zarr store {path} holds: it has no "
        f"{' or '.join(COUNT_ARRAYS)} array, no one-dimensional arrays of one length, and no groups; {fix}."
    )
