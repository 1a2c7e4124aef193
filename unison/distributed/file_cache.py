"""The cache folder of a :class:`~unison.distributed.file_dataset.FileDataset`: preprocessed
items in chunk files, and a manifest that says what they were made from.

Layout: ``<output>/items/manifest.json`` and ``<output>/items/chunk_<build>_<k>.pt``. A build writes a
new folder beside it (``.items-tmp-<host>-<pid>``), flushes every file, writes the manifest
last, then renames it into place: a crash leaves either the old cache or no cache, never a
half-written one. A cache is reused only when its manifest's key (files with their sizes
and modification times, the functions with a hash of their source, ``chunksize`` and
``validate_data``) equals the key of this run; otherwise it is rebuilt, with a warning that
says what changed. A folder named ``items`` without a manifest is not ours: it is refused,
never deleted.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shutil
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unison.distributed.file_items import make_items
from unison.distributed.file_sources import callable_identity, file_identity
from unison.utils.logging import get_logger

__all__ = ["FOLDER", "MANIFEST", "Recipe", "build_cache", "cache_key", "read_cache", "sample_counts"]

FORMAT = 1
FOLDER = "items"
MANIFEST = "manifest.json"
_log = get_logger(__name__)


@dataclass(frozen=True)
class Recipe:
    """What items are made from, and how."""

    files: list[Path]
    reader: Callable[[Path, int], Any]
    count: Callable[[Path], int]
    pre_transform: Callable[[Any], Any] | None
    pre_filter: Callable[[Any], bool] | None
    validate: bool
    chunksize: int


def cache_key(recipe: Recipe) -> dict[str, Any]:
    """What a cache must have been built from to be reused: JSON, compared as a whole."""
    return {
        "format": FORMAT,
        "files": [{"path": str(path), **file_identity(path)} for path in recipe.files],
        "reader": callable_identity(recipe.reader),
        "pre_transform": callable_identity(recipe.pre_transform),
        "pre_filter": callable_identity(recipe.pre_filter),
        "validate_data": recipe.validate,
        "chunksize": recipe.chunksize,
    }


def read_cache(folder: Path, key: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The manifest of the cache in ``folder`` if it was built from ``key``, else None and why not."""
    path = folder / MANIFEST
    if not path.exists():
        return None, f"{folder} holds no cache yet"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return None, f"{path} cannot be read ({err})"
    if not isinstance(manifest, dict):
        return None, f"{path} is not a manifest"
    if manifest.get("key") != key:
        return None, "its inputs changed: " + _differences(manifest.get("key"), key)
    missing = [c["name"] for c in manifest["chunks"] if c["name"] and not (folder / c["name"]).exists()]
    if missing:
        return None, f"chunk files are missing: {missing[:3]}"
    return manifest, ""


def _differences(old: Any, new: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "no key recorded"
    changed = []
    for name, value in new.items():
        if name == "files" and isinstance(old.get(name), list) and len(old[name]) == len(value):
            changed += [
                f"files[{k}] {b['path']}"
                for k, (a, b) in enumerate(zip(old[name], value, strict=True))
                if a != b
            ]
        elif old.get(name) != value:
            changed.append(
                f"{name} ({old.get(name)!r} -> {value!r})" if name != "files" else "files (the list)"
            )
    return ", ".join(changed)


def build_cache(folder: Path, recipe: Recipe, key: dict[str, Any], n_processes: int) -> dict[str, Any]:
    """Preprocesses every sample into ``folder`` and returns the new manifest.

    Chunks are disjoint index ranges of one file each; with ``n_processes > 1`` worker
    processes make them in parallel. The items and their order do not depend on
    ``n_processes``: files in the given order, samples in index order, filtered ones left out.

    Raises:
        ValueError: ``folder`` exists but is not a cache, or a function cannot be sent to workers.
    """
    if folder.exists() and not (folder / MANIFEST).exists():
        raise ValueError(
            f"FileDataset(output=...): {folder} exists and is not a FileDataset cache (it has no {MANIFEST}); "
            "it is left untouched. Choose another output folder, or move that folder away."
        )
    tag = f"{socket.gethostname()}-{os.getpid()}"
    tmp = folder.with_name(f".{folder.name}-tmp-{tag}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build = uuid.uuid4().hex[:12]  # in every chunk's name: a dataset never reads another build's chunk
        chunks: list[dict[str, Any]] = []
        for f, n in enumerate(sample_counts(recipe)):
            for start in range(0, n, recipe.chunksize):
                stop = min(start + recipe.chunksize, n)
                chunks.append(
                    {"file": f, "start": start, "stop": stop, "name": f"chunk_{build}_{len(chunks):06d}.pt"}
                )
        tasks = [
            (
                recipe.files[c["file"]],
                c["start"],
                c["stop"],
                recipe.reader,
                recipe.pre_transform,
                recipe.pre_filter,
                recipe.validate,
                tmp / c["name"],
            )
            for c in chunks
        ]
        results = _run(tasks, n_processes)
        types: set[str] = set()
        for chunk, (kept, chunk_types, _) in zip(chunks, results, strict=True):
            chunk["kept"] = kept
            types.update(chunk_types)
        manifest = {
            "key": key,
            "chunks": chunks,
            "item_types": sorted(types),
            "items": sum(len(r[0]) for r in results),
        }
        _write_json(tmp / MANIFEST, manifest)
        _fsync(tmp)
        try:
            _publish(tmp, folder, tag)
        except OSError:
            if read_cache(folder, key)[0] is None:  # another process published the same cache first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def sample_counts(recipe: Recipe) -> list[int]:
    counts = []
    for path in recipe.files:
        n = recipe.count(path)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"FileDataset: counting the samples of {path} gave {n!r}; expected an int >= 0.")
        counts.append(n)
    return counts


def _run(tasks: list[tuple[Any, ...]], n_processes: int) -> list[tuple[list[int], list[str], list[Any]]]:
    if n_processes <= 1 or len(tasks) <= 1:
        return [make_items(*task) for task in tasks]
    for name, fn in zip(("reader", "pre_transform", "pre_filter"), tasks[0][3:6], strict=True):
        try:
            pickle.dumps(fn)
        except Exception as err:
            raise ValueError(
                f"FileDataset(n_processes={n_processes}): {name}={fn!r} cannot be sent to worker processes ({err}). "
                "Define it at the top level of a module (not a lambda or a nested function), or pass n_processes=1."
            ) from None
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    with ProcessPoolExecutor(max_workers=min(n_processes, len(tasks)), mp_context=context) as pool:
        futures = [pool.submit(make_items, *task) for task in tasks]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, folder: Path, tag: str) -> None:
    """Puts the finished ``tmp`` where ``folder`` is; the old cache is removed only after."""
    old = folder.with_name(f".{folder.name}-old-{tag}")
    if folder.exists():
        os.rename(folder, old)
    os.rename(tmp, folder)
    _fsync(folder.parent)
    shutil.rmtree(old, ignore_errors=True)
