"""Checking a sharded checkpoint folder before anything is loaded from it.

A folder from elsewhere (a copied run, a shared filesystem) is read only after every file
it recorded has its size and CRC-32, and its DCP ``.metadata`` is unpickled with only
DCP's own classes allowed: torch's own reader would unpickle anything, so a hostile
folder could run code.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from unison.checkpoint.entry import file_in
from unison.checkpoint.io import CheckpointError, is_complete
from unison.checkpoint.sharded import CHECKSUMS, REST, file_checksum

_DCP = "torch.distributed.checkpoint"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``: its own classes, dtypes, sizes and paths; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        found = None if "." in name else _metadata_global(module, name)
        if found is None:
            raise pickle.UnpicklingError(
                f"it refers to {module}.{name}, which is no part of a Distributed Checkpoint's metadata"
            )
        return found


def _metadata_global(module: str, name: str) -> Any:
    if module in (f"{_DCP}.metadata", f"{_DCP}.filesystem"):
        import importlib

        found = getattr(importlib.import_module(module), name, None)
        return found if isinstance(found, type) and found.__module__ == module else None
    if module == "torch":
        found = getattr(torch, name, None)
        return found if isinstance(found, torch.dtype) or found is torch.Size else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout  # maps a layout's name to the layout
    if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        return getattr(pathlib, name)
    return None


def read_metadata(folder: Path) -> Any:
    """The ``.metadata`` of a sharded checkpoint folder, unpickled with only DCP's own classes allowed
    (torch's reader would unpickle anything: a folder from elsewhere could run code)."""
    with open(folder / ".metadata", "rb") as fh:
        return _MetadataUnpickler(fh).load()


def sharded_problem(folder: Path, *, require_checksums: bool = True) -> str | None:
    """What is wrong with a sharded checkpoint folder, as a phrase, or None when it is whole.

    Checks every file's size and CRC-32 against ``checksums.json`` (written last, so its
    absence means the save did not finish; ``require_checksums=False`` accepts a folder
    written without one, by DCP alone), that ``.metadata`` reads (with only DCP's own
    classes: nothing in it can run code) and names files present at their recorded
    lengths, and that ``rest.pt`` is whole.
    """
    if not folder.is_dir():
        return "it is not a folder"
    try:
        problem = _checksum_problem(folder, require_checksums)
        if problem is None:
            problem = _metadata_problem(folder)
    except CheckpointError as err:  # a file named outside the folder
        return str(err)
    if problem is not None:
        return problem
    if not file_in(folder, REST).is_file():
        return f"it holds no {REST} (the meta record and the objects not stored sharded)"
    return None if is_complete(folder / REST) else f"its {REST} is truncated or corrupt"


def _checksum_problem(folder: Path, required: bool) -> str | None:
    listed = folder / CHECKSUMS
    if not listed.is_file():
        return f"its {CHECKSUMS} is missing (the save did not finish)" if required else None
    try:
        files = json.loads(listed.read_text())["files"]
        recorded = {n: (int(v["size"]), int(v["crc32"])) for n, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"its {CHECKSUMS} does not read ({type(err).__name__}: {err})"
    for name, (size, crc) in sorted(recorded.items()):
        path = file_in(folder, name, source=str(listed))
        if not path.is_file():
            return f"its file {name}, listed in {CHECKSUMS}, is missing"
        if path.stat().st_size != size:
            return f"its file {name} holds {path.stat().st_size} bytes where {size} were written"
        if file_checksum(path)[1] != crc:
            return f"its file {name} is corrupt (its CRC-32 differs from the one recorded in {CHECKSUMS})"
    return None


def _metadata_problem(folder: Path) -> str | None:
    if not (folder / ".metadata").is_file():
        return "it has no .metadata: not a sharded checkpoint, or one whose save did not finish"
    try:
        metadata = read_metadata(folder)
    except Exception as err:  # a damaged or hostile pickle raises many kinds
        return f"its .metadata does not read ({type(err).__name__}: {err})"
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, Mapping):
        return "its .metadata lists no shard files (not a checkpoint written to a folder)"
    needed: dict[str, int] = {}
    for info in storage.values():
        name = str(getattr(info, "relative_path", ""))
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(needed.items()):
        path = file_in(folder, name, source=str(folder / ".metadata"))
        if not path.is_file():
            return f"its shard file {name}, listed in .metadata, is missing"
        if path.stat().st_size < end:
            return f"its shard file {name} holds {path.stat().st_size} bytes where .metadata records {end} (truncated)"
    return None


def sharded_complete(folder: str | os.PathLike[str]) -> bool:
    """Whether a sharded checkpoint folder is whole (:func:`sharded_problem` finds nothing)."""
    return sharded_problem(Path(folder)) is None
