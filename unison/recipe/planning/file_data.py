"""The ``data`` section's file-backed dataset: resolved once before the ranks start, built on each.

With ``data.files`` and ``data.reader`` (QuantumGrav's keys) and no ``data.build``, the
run's data is one :class:`~unison.distributed.FileDataset` over the files, split into
train, validation (and test) by ``data.split`` with ``training.seed``: the same split on
every rank and at every run. :func:`file_data_slots` resolves the section into a
:class:`FileData`, which :mod:`unison.recipe.planning.resolved` hands to the build step as its
``data.build`` (called with the seed on every rank).

Paths: an entry of ``data.files`` or ``data.output`` is relative to the config's folder
and may not leave it (``..``, links out); an absolute path (or ``~/...``) is the user's own
and is taken as written.

The reader: ``reader(path, index)`` as :class:`~unison.distributed.FileDataset` calls it,
or QuantumGrav's ``read_data(store, idx, float_dtype, int_dtype, validate_data)``, told
apart by its number of required parameters (2 or 5). The latter gets each zarr store
opened read-only (:class:`StoreReader`), with ``data.float_type`` and ``data.int_type``.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from unison.config import Config, PyObjectRef
from unison.config.usercode import describe
from unison.distributed import FileDataset, split_dataset
from unison.distributed.file_sources import callable_identity
from unison.recipe.planning.references import _References
from unison.utils import get_logger
from unison.utils.confine import ConfinementError, confined_path

_log = get_logger("unison.recipe.run")

PLAIN_READER = ("path", "index")
QUANTUMGRAV_READER = ("store", "idx", "float_dtype", "int_dtype", "validate_data")


class StoreReader:
    """QuantumGrav's ``read_data(store, idx, float_dtype, int_dtype, validate_data)`` as a
    ``reader(path, index)``: each file is opened as a read-only zarr ``LocalStore``.

    Its ``repr`` names the wrapped function (with a hash of its source) and the dtypes, so a
    :class:`~unison.distributed.FileDataset` cache is rebuilt when any of them changes.
    """

    def __init__(
        self, read: Any, float_dtype: torch.dtype, int_dtype: torch.dtype, validate_data: bool
    ) -> None:
        self.read = read
        self.float_dtype = float_dtype
        self.int_dtype = int_dtype
        self.validate_data = validate_data
        self._stores: dict[Path, Any] = {}

    def __call__(self, path: Path, index: int) -> Any:
        store = self._stores.get(path)
        if store is None:
            import zarr

            store = self._stores[path] = zarr.storage.LocalStore(str(path), read_only=True)
        return self.read(store, index, self.float_dtype, self.int_dtype, self.validate_data)

    def __repr__(self) -> str:
        return (
            f"StoreReader({callable_identity(self.read)}, {self.float_dtype}, {self.int_dtype}, "
            f"validate_data={self.validate_data})"
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_stores": {}}  # each process opens its own stores


@dataclass
class FileData:
    """A resolved file-backed ``data`` section; ``file_data(seed)`` builds and splits the dataset.

    Distributed:
        Calling it is a collective (it makes a :class:`~unison.distributed.FileDataset`): call
        it on every rank with the same seed.
    """

    files: list[Path]
    reader: Any
    output: Path | None
    split: list[float]
    count: Any = None
    pre_transform: Any = None
    pre_filter: Any = None
    transform: Any = None
    validate_data: bool = True
    n_processes: int = 1
    chunksize: int = 1000
    safe_globals: list[Any] = field(default_factory=list)
    shuffle: bool | None = None

    def __call__(self, seed: int) -> tuple[Any, ...]:
        if self.shuffle is not None:
            _log.info(
                "data.shuffle: %s is read, not used: the split is drawn from training.seed (%d), and the training "
                "order each epoch is training.shuffle's",
                self.shuffle,
                seed,
            )
        dataset = FileDataset(
            self.files,
            self.reader,
            output=self.output,
            count=self.count,
            pre_transform=self.pre_transform,
            pre_filter=self.pre_filter,
            transform=self.transform,
            validate_data=self.validate_data,
            n_processes=self.n_processes,
            chunksize=self.chunksize,
            safe_globals=self.safe_globals,
        )
        return tuple(split_dataset(dataset, self.split, seed=seed))


def file_data_slots(config: Config, refs: _References) -> FileData:
    """The ``data`` section's files, functions and settings, checked: paths exist (or, for
    ``output``, may be made), each function takes what it is called with.

    Raises:
        ConfigError: naming the key (``data.files.2``, ``data.reader`` ...) and the fix.
    """
    d = config.data
    root = refs.scope.config_dir
    files = [_path(str(entry), root, f"data.files.{k}", refs) for k, entry in enumerate(d.files or [])]
    for k, path in enumerate(files):
        if not path.exists():
            raise refs.error(
                f"data.files.{k}", f"{path} does not exist; check the path (or the config's folder)"
            )
    output = None if d.output is None else _path(d.output, root, "data.output", refs)
    functions: dict[str, Any] = {}
    for key in ("count", "pre_transform", "pre_filter", "transform"):
        ref = getattr(d, key)
        if ref is not None:
            fn = functions[key] = refs.ref(ref, "data_function", f"data.{key}")
            refs.bind(fn, type_key=f"data.{key}", kwargs_key=f"data.{key}", kwargs={}, args=(None,))
    safe = [refs.ref(ref, "value", f"data.safe_globals.{k}") for k, ref in enumerate(d.safe_globals)]
    return FileData(
        files=files,
        reader=_reader(config, refs),
        output=output,
        split=[float(f) for f in d.split],
        validate_data=d.validate_data,
        n_processes=d.n_processes,
        chunksize=d.chunksize,
        safe_globals=safe,
        shuffle=d.shuffle,
        **functions,
    )


def _path(text: str, root: Path | None, key: str, refs: _References) -> Path:
    """``text`` as a path: an absolute one (or ``~/...``) as written, else inside the config's folder."""
    path = Path(text).expanduser()
    if path.is_absolute():
        return path
    base = root if root is not None else Path.cwd()
    try:
        return confined_path(os.fspath(text), base.resolve())
    except ConfinementError as err:
        raise refs.error(
            key,
            f"{text!r} is refused: {err}. A relative path stays inside the config's folder ({base}); "
            "write an absolute path to read or write elsewhere",
        ) from None


def _reader(config: Config, refs: _References) -> Any:
    """``data.reader``, as ``reader(path, index)``: QuantumGrav's five-parameter reader wrapped."""
    d = config.data
    ref = d.reader
    assert isinstance(ref, PyObjectRef)  # checked by validation: files need a reader
    fn = refs.ref(ref, "data_function", "data.reader")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: called as reader(path, index)
        return fn
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in params if p.kind in positional and p.default is p.empty]
    if len(required) == len(PLAIN_READER):
        return fn
    if len(required) != len(QUANTUMGRAV_READER):
        raise refs.error(
            "data.reader",
            f"{describe(fn)} takes {len(required)} required argument(s) ({', '.join(required) or 'none'}); a "
            f"reader is called as reader{PLAIN_READER} or, for zarr stores, read_data{QUANTUMGRAV_READER}",
        )
    if importlib.util.find_spec("zarr") is None:
        raise refs.error(
            "data.reader",
            f"{describe(fn)} reads zarr stores (read_data{QUANTUMGRAV_READER}), and zarr is not installed: "
            "pip install 'unison[graph]'",
        )
    return StoreReader(fn, getattr(torch, d.float_type), getattr(torch, d.int_type), d.validate_data)
