"""A map-style dataset of items read from files, preprocessed once, cached and shared by every rank."""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from unison.distributed.file_cache import (
    FOLDER,
    MANIFEST,
    Recipe,
    build_cache,
    cache_key,
    read_cache,
    sample_counts,
)
from unison.distributed.file_items import InvalidItemError, item_problems, load_items
from unison.distributed.file_sources import count_samples, resolve_files
from unison.distributed.primitives import broadcast_object, get_local_rank, get_rank, sync_bool
from unison.utils.confine import ConfinementError, confined_path
from unison.utils.logging import get_logger

__all__ = ["FileDataset"]

_log = get_logger(__name__)


class FileDataset(Dataset):
    """Items made from the samples of files: read, filtered, preprocessed once, cached on disk.

    Each file holds samples; ``reader(path, index)`` returns sample ``index`` of ``path``
    (any object), and ``count(path)`` (or the reader's own ``count`` method, or for a zarr
    store the store itself) says how many there are. ``pre_filter(sample)`` drops the samples
    it returns False for, before ``pre_transform(sample)`` turns each kept one into an item
    (a torch_geometric ``Data``, a dict of tensors, ...). Those three run once, into the cache
    folder ``<output>/items``; ``transform(item)`` runs on every access. Items come in file
    order, then sample order, whatever ``n_processes`` is. The dataset never shuffles: the
    training sampler does, with a new order each epoch that is the same on every rank; split
    it with :func:`~unison.distributed.split_dataset`.

    The cache is reused on later runs as long as the files (sizes and modification times)
    and the reader, pre_filter and pre_transform (names and source) are the same; otherwise
    it is rebuilt, with a warning naming what changed. A function that one of them calls is
    not tracked: delete ``<output>/items`` after changing it.

    Args:
        files: the paths to read (files or folders such as zarr stores).
        reader: ``reader(path, index) -> sample``; top level of a module when ``n_processes > 1``.
        output: the cache's parent folder; None reads and pre-transforms on every access
            instead (no cache, and no ``pre_filter``).
        root: when given, ``files`` and ``output`` are relative to it and may not leave it.
        count: ``count(path) -> number of samples``; default ``reader.count`` if the reader
            has one, else read from a zarr store (``num_samples`` array, one-dimensional
            arrays, or one group per sample).
        pre_transform: ``sample -> item``, run once per sample; default: the sample is the item.
        pre_filter: ``sample -> bool``, run once per sample before ``pre_transform``.
        transform: ``item -> item``, run on every access (random augmentation belongs here).
        validate_data: check every item once: no None, no nan or inf in any float tensor,
            torch_geometric's own ``validate()``; the error names the file and the sample.
        n_processes: worker processes that preprocess disjoint chunks.
        chunksize: samples per chunk (a chunk is one cache file and one unit of work).
        safe_globals: your own item classes, allowed by ``torch.load(weights_only=True)``.
            torch_geometric's ``Data`` and ``HeteroData`` are allowed without it.

    Example:
        >>> import torch
        >>> class Rows:
        ...     def __call__(self, path, index):
        ...         return torch.full((2,), float(index))
        ...     def count(self, path):
        ...         return 3
        >>> data = FileDataset(["."], Rows())
        >>> len(data), data[2].tolist()
        (3, [2.0, 2.0])

    Distributed:
        Construct it on every rank with the same arguments: it is a collective. Rank 0
        preprocesses (with ``n_processes`` workers) while the others wait in a collective
        under the process group's timeout (give a long preprocessing more ``timeout``, or
        build the cache once before launching); then every rank checks the cache against
        its own inputs. Where a rank cannot see rank 0's cache (``output`` on a node-local
        disk), local rank 0 of that node builds it too. A failure on the building rank is
        raised on every rank. Every rank then holds the same items in the same order.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]],
        reader: Callable[[Path, int], Any],
        *,
        output: str | os.PathLike[str] | None = None,
        root: str | os.PathLike[str] | None = None,
        count: Callable[[Path], int] | None = None,
        pre_transform: Callable[[Any], Any] | None = None,
        pre_filter: Callable[[Any], bool] | None = None,
        transform: Callable[[Any], Any] | None = None,
        validate_data: bool = True,
        n_processes: int = 1,
        chunksize: int = 1000,
        safe_globals: Sequence[Any] = (),
    ) -> None:
        for name, fn, optional in (
            ("reader", reader, False),
            ("count", count, True),
            ("pre_transform", pre_transform, True),
            ("pre_filter", pre_filter, True),
            ("transform", transform, True),
        ):
            if not callable(fn) and not (optional and fn is None):
                raise TypeError(
                    f"FileDataset({name}=...) must be callable{' or None' if optional else ''}, got {fn!r}."
                )
        for name, value in (("n_processes", n_processes), ("chunksize", chunksize)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FileDataset({name}=...) must be a positive int, got {value!r}.")
        if not isinstance(validate_data, bool):
            raise TypeError(f"FileDataset(validate_data=...) must be True or False, got {validate_data!r}.")
        if output is None and pre_filter is not None:
            raise ValueError(
                "FileDataset(pre_filter=...) needs output=...: which samples are kept is decided once, "
                "into the cache folder. Pass output=<folder>, or drop pre_filter."
            )
        counter = count if count is not None else getattr(reader, "count", None)
        self.recipe = Recipe(
            files=resolve_files(files, root),
            reader=reader,
            count=counter if callable(counter) else count_samples,
            pre_transform=pre_transform,
            pre_filter=pre_filter,
            validate=validate_data,
            chunksize=chunksize,
        )
        self.transform = transform
        self.safe_globals = tuple(safe_globals)
        self.built = False
        """Whether this process preprocessed the items (False when a cache was reused)."""
        self._loaded: dict[int, list[Any]] = {}
        self.folder: Path | None = None
        if output is None:
            self._chunks: list[dict[str, Any]] = []
            self._item_types: list[str] = []
            self._ends = list(itertools.accumulate(sample_counts(self.recipe)))
            return
        self.folder = _output_folder(output, root) / FOLDER
        manifest, self.built = _prepare(self.folder, self.recipe, n_processes)
        self._chunks = manifest["chunks"]
        self._item_types = manifest["item_types"]
        self._ends = list(itertools.accumulate(len(c["kept"]) for c in self._chunks))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int) -> Any:
        k, offset = self._locate(index)
        if self.folder is None:
            item = self._make(self.recipe.files[k], offset)
        else:
            if k not in self._loaded:
                path = self.folder / self._chunks[k]["name"]
                if not path.exists():
                    raise RuntimeError(
                        f"FileDataset: {path} is gone: the cache in {self.folder} was rebuilt or removed "
                        "since this dataset was made. Make the dataset again to read the new cache."
                    )
                self._loaded[k] = load_items(path, self._item_types, self.safe_globals)
            item = self._loaded[k][offset]
        return item if self.transform is None else self.transform(item)

    def source(self, index: int) -> tuple[Path, int]:
        """The file and the sample index that item ``index`` was made from."""
        k, offset = self._locate(index)
        if self.folder is None:
            return self.recipe.files[k], offset
        chunk = self._chunks[k]
        return self.recipe.files[chunk["file"]], chunk["kept"][offset]

    def _locate(self, index: int) -> tuple[int, int]:
        n = len(self)
        if isinstance(index, bool) or not isinstance(index, int) or not -n <= index < n:
            raise IndexError(f"FileDataset index {index!r} is out of range for {n} items.")
        index %= n
        k = bisect.bisect_right(self._ends, index)
        return k, index - (self._ends[k - 1] if k else 0)

    def _make(self, path: Path, index: int) -> Any:
        sample = self.recipe.reader(path, index)
        item = sample if self.recipe.pre_transform is None else self.recipe.pre_transform(sample)
        problems = item_problems(item) if self.recipe.validate or item is None else []
        if problems:
            raise InvalidItemError(
                f"FileDataset: sample {index} of {path} gives an invalid item: {'; '.join(problems)}. Fix the "
                "file or the pre_transform, or pass validate_data=False."
            )
        return item

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_loaded"] = {}  # a DataLoader worker maps the chunks it reads itself
        return state


def _output_folder(output: str | os.PathLike[str], root: str | os.PathLike[str] | None) -> Path:
    if root is None:
        return Path(output).expanduser().resolve()
    try:
        return confined_path(os.fspath(output), Path(root))
    except ConfinementError as err:
        raise ValueError(
            f"FileDataset(output=...) = {os.fspath(output)!r} is refused: {err}. Name a folder inside "
            f"root={os.fspath(root)!r}, relative to it."
        ) from None


def _prepare(folder: Path, recipe: Recipe, n_processes: int) -> tuple[dict[str, Any], bool]:
    """Collective: call on every rank. The cache's manifest, built by rank 0 if needed (and by
    local rank 0 of a node that cannot see it), and whether this process built it."""
    key = cache_key(recipe)
    manifest, built, error = _build_if(get_rank() == 0, folder, recipe, key, n_processes)
    failure = broadcast_object(None if error is None else f"{type(error).__name__}: {error}", src=0)
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"FileDataset: rank 0 failed to preprocess into {folder}: {failure}")
    manifest, reason = read_cache(folder, key)
    if sync_bool(manifest is None, "any"):  # some rank cannot see rank 0's cache: a disk per node
        _, node_built, error = _build_if(
            manifest is None and get_local_rank() == 0, folder, recipe, key, n_processes
        )
        built = built or node_built
        if sync_bool(error is not None, "any"):
            raise error or RuntimeError(
                f"FileDataset: another rank failed to preprocess into {folder}; see its error."
            )
        manifest, reason = read_cache(folder, key)
    if manifest is None:
        raise RuntimeError(
            f"FileDataset: rank {get_rank()} cannot use the cache in {folder} after it was built: {reason}. "
            "Every rank must see the same files; check that output is on a disk this rank can read."
        )
    return manifest, built


def _build_if(
    ok: bool, folder: Path, recipe: Recipe, key: dict[str, Any], n_processes: int
) -> tuple[dict[str, Any] | None, bool, Exception | None]:
    """The cache (reused or built) when ``ok``, whether it was built, and the error, if any."""
    if not ok:
        return None, False, None
    try:
        manifest, reason = read_cache(folder, key)
        if manifest is not None:
            return manifest, False, None
        if (folder / MANIFEST).exists():
            _log.warning("FileDataset: rebuilding the cache in %s: %s", folder, reason)
        else:
            _log.info("FileDataset: preprocessing %d file(s) into %s", len(recipe.files), folder)
        return build_cache(folder, recipe, key, n_processes), True, None
    except Exception as err:
        return None, False, err
