"""``data.stream``: the training stream of a config, resolved once before the ranks start, built on each.

:func:`stream_data_slots` checks everything the section names before any process starts:
the files and globs (each must match, and a relative one stays inside the config's folder,
as ``data.files`` does), the reader (a ``data_function`` that takes ``(path, **kwargs)``),
the ``datasets`` package, folder, split and columns of a Hugging Face dataset, and
``training.shuffle`` (a stream orders itself). The result, a :class:`StreamData`, takes
``data.build``'s place: called with the seed on every rank, it returns this rank's stream
and the map-style validation set.

- Files: :class:`~unison.distributed.file_stream.FileStream` (a new file order each epoch
  from ``training.seed``) wrapped in :func:`~unison.distributed.shard_stream`: each rank and
  each worker its own samples, every rank as many, and a position that resumes exactly.
- A Hugging Face dataset: :func:`~unison.distributed.hf_stream.hf_stream`, one equal shard
  per rank and worker.
"""

from __future__ import annotations

import glob
import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unison.config import Config
from unison.config.stream_config import StreamConfig
from unison.config.usercode import describe
from unison.distributed import shard_stream
from unison.distributed.file_stream import FileStream, read_files
from unison.distributed.hf_folder import DatasetFolderError
from unison.distributed.hf_stream import hf_stream, load_split
from unison.recipe.planning.file_data import _path
from unison.recipe.planning.references import _References
from unison.utils.confine import ConfinementError, confined_path

INSTALL = "pip install 'unison[stream]'"


@dataclass
class StreamData:
    """A resolved ``data.stream``; ``stream_data(seed)`` returns ``(train stream, validation set)``.

    Distributed:
        Call it on every rank, after the process group exists: the stream reads the rank then.
    """

    files: list[Path] = field(default_factory=list)
    val_files: list[Path] = field(default_factory=list)
    reader: Any = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    shuffle_buffer: int = 0
    hf_dataset: Path | None = None
    split: str = "train"
    val_split: str = "validation"
    columns: list[str] | None = None
    workers: int = 0

    def __call__(self, seed: int) -> tuple[Any, Any]:
        if self.hf_dataset is not None:
            train = hf_stream(load_split(self.hf_dataset, self.split, self.columns), workers=self.workers)
            return train, load_split(self.hf_dataset, self.val_split, self.columns)
        stream = FileStream(
            self.files, self.reader, seed=seed, kwargs=self.kwargs, shuffle_buffer=self.shuffle_buffer
        )
        return shard_stream(stream), read_files(self.val_files, self.reader, self.kwargs)


def stream_data_slots(config: Config, refs: _References) -> StreamData:
    """``data.stream``, checked and resolved (see the module's docstring).

    Raises:
        ConfigError: naming the key (``data.stream.files.1``, ``training.shuffle`` ...), the value and the fix.
    """
    stream = config.data.stream
    assert isinstance(stream, StreamConfig)  # the caller's condition
    origin = config.origin
    if config.training.shuffle and origin.given("training", "shuffle"):
        raise refs.error(
            "training.shuffle",
            "true, but data.stream streams the training data, and a stream has no indices to reorder: it is "
            "ordered by its source (a new file order each epoch from training.seed, data.stream.shuffle_buffer "
            "for samples). Remove training.shuffle",
        )
    workers = config.training.num_workers
    if stream.hf_dataset is not None:
        return _hf(stream, refs, workers)
    reader, kwargs = _reader(stream, refs)
    files = _matches(stream.files or [], "data.stream.files", refs)
    if all(path.stat().st_size == 0 for path in files):
        named = ", ".join(str(path) for path in files[:5]) + (", ..." if len(files) > 5 else "")
        raise refs.error(
            "data.stream.files",
            f"every file it names is empty ({named}): the stream would train on nothing. Name the files "
            "that hold the training samples",
        )
    return StreamData(
        files=files,
        val_files=_matches(stream.val_files or [], "data.stream.val_files", refs),
        reader=reader,
        kwargs=kwargs,
        shuffle_buffer=stream.shuffle_buffer,
        workers=workers,
    )


def _matches(entries: list[str], key: str, refs: _References) -> list[Path]:
    """The files ``entries`` name, each a path or a glob, in order (a glob's matches sorted)."""
    root = refs.scope.config_dir
    base = (root if root is not None else Path.cwd()).resolve()
    found: list[Path] = []
    for k, entry in enumerate(entries):
        pattern = _path(str(entry), root, f"{key}.{k}", refs)
        if not glob.has_magic(str(entry)):
            if not pattern.is_file():
                raise refs.error(
                    f"{key}.{k}",
                    f"{entry!r}: {pattern} is not a file; check the path (or the config's folder)",
                )
            found.append(pattern)
            continue
        matches = sorted(Path(m) for m in glob.glob(str(pattern), recursive=True) if Path(m).is_file())
        if not matches:
            raise refs.error(
                f"{key}.{k}",
                f"{entry!r} matched no file (looked for {pattern}); check the pattern and the folder",
            )
        if not Path(str(entry)).expanduser().is_absolute():
            for match in matches:  # a link among the matches may lead out of the folder
                try:
                    confined_path(os.path.relpath(match, base), base)
                except ConfinementError as err:
                    raise refs.error(
                        f"{key}.{k}",
                        f"{entry!r} matched {match}, which is refused: {err}. A relative path stays inside the "
                        f"config's folder ({base}); write an absolute path to read elsewhere",
                    ) from None
        found.extend(matches)
    return found


def _reader(stream: StreamConfig, refs: _References) -> tuple[Any, dict[str, Any]]:
    """``data.stream.reader`` and its kwargs: a function called as ``reader(path, **kwargs)``."""
    fn = refs.ref(stream.reader, "data_function", "data.stream.reader")
    kwargs = refs.tree(stream.kwargs, "data.stream.kwargs")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: called as reader(path, **kwargs)
        return fn, kwargs
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p.name for p in params if p.kind in positional and p.default is p.empty and p.name not in kwargs
    ]
    if len(required) > 1:
        raise refs.error(
            "data.stream.reader",
            f"{describe(fn)} takes {len(required)} required arguments ({', '.join(required)}); a stream's reader is "
            "called as reader(path, **data.stream.kwargs) and yields the file's samples. A reader(path, index) "
            "belongs to map-style data: data.files and data.reader",
        )
    refs.bind(
        fn,
        type_key="data.stream.reader",
        kwargs_key="data.stream.kwargs",
        kwargs=kwargs,
        args=(Path("file"),),
        how="(path, ...)",
    )
    return fn, kwargs


def _hf(stream: StreamConfig, refs: _References, workers: int) -> StreamData:
    """``data.stream.hf_dataset``: the package, the folder, its splits and columns, checked."""
    if importlib.util.find_spec("datasets") is None:
        raise refs.error(
            "data.stream.hf_dataset",
            f"{stream.hf_dataset!r} is a Hugging Face dataset, and the datasets package is not installed: {INSTALL}",
        )
    assert stream.hf_dataset is not None
    folder = _path(stream.hf_dataset, refs.scope.config_dir, "data.stream.hf_dataset", refs)
    if not folder.is_dir():
        raise refs.error(
            "data.stream.hf_dataset",
            f"{stream.hf_dataset!r}: {folder} is not a folder; give the folder datasets' save_to_disk wrote",
        )
    for key, split in (("split", stream.split), ("val_split", stream.val_split)):
        try:
            load_split(folder, split, stream.columns)
        except DatasetFolderError as err:  # a file outside the folder, a column decoded from a path
            raise refs.error("data.stream.hf_dataset", f"{stream.hf_dataset!r}: {err}") from None
        except KeyError as err:
            raise refs.error(f"data.stream.{key}", f"{split!r}: {err.args[0]}") from None
        except ValueError as err:
            raise refs.error("data.stream.columns", f"{stream.columns!r}: {err}") from None
        except FileNotFoundError as err:
            raise refs.error(
                "data.stream.hf_dataset", f"{folder} holds no dataset saved with save_to_disk: {err}"
            ) from None
    return StreamData(
        hf_dataset=folder,
        split=stream.split,
        val_split=stream.val_split,
        columns=stream.columns,
        workers=workers,
    )
