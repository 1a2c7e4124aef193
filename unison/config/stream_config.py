"""``data.stream``: training data read as a stream, from files and a reader or a Hugging Face dataset.

A sub-section of ``data`` (:mod:`unison.config.data_config`): its keys describe a source
that is read in order, never indexed, so they are kept apart from the map-style keys
(``data.files``, ``data.reader``, whose reader takes an index). Two sources, one per config:

- ``files`` and ``reader``: ``reader(path, **kwargs) -> iterable of samples``, over the files
  (paths or globs) in a new order each epoch; ``val_files`` read whole for validation;
- ``hf_dataset``: a folder written by ``datasets``' ``save_to_disk``, its ``split`` streamed
  and ``val_split`` (if given) evaluated map-style.

:func:`check_stream` checks the keys that the section alone decides; the files, the reader
and the ``datasets`` package are checked when the config is resolved
(:mod:`unison.recipe.planning.stream_files`).
"""

# No ``from __future__ import annotations``: the schema reads these types with its own names.

from dataclasses import dataclass, field
from typing import Any

from unison.config.loader import KeyPath, PyObjectRef, RawConfig


def _key(default: Any, doc: str, slot: str | None = None) -> Any:
    if isinstance(default, (dict, list)):
        value = default
        return field(
            default_factory=lambda: type(value)(value), metadata={"doc": doc, "alias": None, "slot": slot}
        )
    return field(default=default, metadata={"doc": doc, "alias": None, "slot": slot})


FILE_SOURCE = ("files", "reader", "kwargs", "val_files", "shuffle_buffer")
"""The keys of a stream read from files."""
HF_SOURCE = ("hf_dataset", "split", "val_split", "columns")
"""The keys of a stream read from a Hugging Face dataset on disk."""


@dataclass
class StreamConfig:
    files: list[str] | None = _key(
        None,
        "files or globs streamed for training, in a new order each epoch (training.seed); relative to the "
        "config's folder (and kept inside it) unless absolute",
    )
    reader: PyObjectRef | None = _key(
        None,
        "reader(path, **kwargs) -> an iterable of the file's samples, in a fixed order",
        slot="data_function",
    )
    kwargs: dict[str, Any] = _key({}, "keyword arguments of reader")
    val_files: list[str] | None = _key(
        None,
        "files or globs read whole by reader into a map-style validation set (required: a run validates)",
    )
    shuffle_buffer: int = _key(
        0,
        "samples held in a seeded shuffle buffer (training.seed, the epoch); 0: only the file order changes",
    )
    hf_dataset: str | None = _key(
        None,
        "a folder written by datasets' save_to_disk (a Dataset or a DatasetDict), streamed with "
        "to_iterable_dataset and split_dataset_by_node; relative to the config's folder unless absolute",
    )
    split: str = _key("train", "the split of hf_dataset streamed for training (a DatasetDict's key)")
    val_split: str = _key(
        "validation", "the split of hf_dataset evaluated map-style, sharded without padding"
    )
    columns: list[str] | None = _key(None, "the columns of hf_dataset kept (as torch tensors); null: all")


def check_stream(stream: StreamConfig, raw: RawConfig, map_keys: list[str]) -> None:
    """``data.stream``'s own values: one source (files with a reader, or hf_dataset), no map-style key beside it.

    ``map_keys``: the map-style keys of ``data`` written beside it (``build``, ``files``, ...).

    Raises:
        ConfigError: naming the file, the line and the key.
    """
    section: KeyPath = ("data", "stream")
    if map_keys:
        raise raw.origin.error(
            ("data", map_keys[0]),
            f"data.{map_keys[0]} and data.stream (line {raw.origin.line_of(section)}) are both given: data.stream "
            f"describes the training data itself, and data.{map_keys[0]} belongs to map-style data (data.build, "
            "or data.files with an indexed reader). Keep one of them",
        )
    defaults = StreamConfig()
    given = {k for k in (*FILE_SOURCE, *HF_SOURCE) if raw.origin.given(*section, k)}
    if stream.files is not None and stream.hf_dataset is not None:
        raise raw.origin.error(
            (*section, "hf_dataset"),
            f"data.stream.files (line {raw.origin.line_of((*section, 'files'))}) and data.stream.hf_dataset are "
            "both given: stream either files through a reader or a Hugging Face dataset. Keep one of them",
        )
    if stream.files is None and stream.hf_dataset is None:
        raise raw.origin.error(
            section,
            "names no source: give `files: [...]` with `reader: !pyobject my_module.read`, or "
            "`hf_dataset: <folder written by save_to_disk>`",
        )
    if stream.hf_dataset is not None:
        for k in FILE_SOURCE:
            if k in given and getattr(stream, k) != getattr(defaults, k):
                raise raw.origin.error(
                    (*section, k),
                    "belongs to a stream read from files (data.stream.files); with data.stream.hf_dataset, drop it",
                )
        return
    for k in HF_SOURCE:
        if k in given and getattr(stream, k) != getattr(defaults, k):
            raise raw.origin.error(
                (*section, k),
                "belongs to a Hugging Face dataset (data.stream.hf_dataset); with data.stream.files, drop it",
            )
    if not stream.files:
        raise raw.origin.error((*section, "files"), "lists no file; name at least one file or glob")
    if stream.reader is None:
        raise raw.origin.error(
            (*section, "files"),
            "data.stream.files needs data.stream.reader: `reader: !pyobject my_module.read`, a function "
            "reader(path, **kwargs) that yields the file's samples",
        )
    if not stream.val_files:
        raise raw.origin.error(
            (*section, "val_files") if "val_files" in given else (*section, "files"),
            "data.stream.files needs data.stream.val_files: the held-out files (or globs) a run validates on, "
            "read whole by the same reader, e.g. `val_files: [shards/val-*.txt]`",
        )
    if stream.shuffle_buffer < 0:
        raise raw.origin.error(
            (*section, "shuffle_buffer"),
            f"must be >= 0, got {stream.shuffle_buffer!r}; 0 turns the buffer off",
        )
