"""A Hugging Face dataset on disk, streamed: every rank and every worker its own shards, of equal length.

``datasets`` is imported when a function here is called, never at import: it is optional
(``pip install 'unison[stream]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unison.distributed.hf_folder import check_features, check_folder
from unison.distributed.primitives import get_rank, get_world_size


def load_split(folder: Path | str, split: str | None, columns: list[str] | None = None) -> Any:
    """The ``datasets.Dataset`` saved in ``folder`` (``save_to_disk``): the ``split`` of a
    ``DatasetDict``, or the dataset itself; ``columns`` kept, as torch tensors.

    The folder is data from elsewhere: only its own regular files are read, and a kept column
    decoded from a path or URL a row names (``Image``, ``Audio`` ...) is refused
    (:mod:`unison.distributed.hf_folder`).

    Raises:
        KeyError: ``split`` is not a split of the saved ``DatasetDict`` (the message lists them).
        ValueError: ``columns`` names a column the dataset lacks.
        DatasetFolderError: a file the folder names is outside it or not a regular file, or a
            kept column is decoded from a path or URL.
    """
    import datasets

    check_folder(folder)
    saved = datasets.load_from_disk(str(folder))
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise KeyError(f"split {split!r} is not in {folder}; its splits: {sorted(saved)}")
        saved = saved[split]
    if columns is not None:
        missing = [c for c in columns if c not in saved.column_names]
        if missing:
            raise ValueError(f"columns {missing} are not in {folder}; its columns: {saved.column_names}")
        saved = saved.select_columns(columns)
    check_features(saved.features, folder)
    return saved.with_format("torch")


def hf_stream(
    dataset: Any,
    *,
    workers: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
) -> Any:
    """``dataset`` (a map-style ``datasets.Dataset``) as a stream split by rank and by worker.

    The dataset is cut into ``world_size * max(workers, 1)`` shards
    (``to_iterable_dataset(num_shards=...)``), which ``split_dataset_by_node`` deals to the
    ranks and the library to each rank's workers. Its last ``len % shards`` rows are left
    out first, so every shard, and so every rank, holds as many rows: no rank ends its epoch
    while another still waits in a gradient all-reduce. The stream's ``state_dict`` is its
    position (a :class:`~unison.distributed.data_state.DataPosition` of kind ``"stateful"``).

    Args:
        dataset: a ``datasets.Dataset`` (not a streaming one: its length decides the cut).
        workers: the DataLoader's ``num_workers``; each worker gets its own shard.
        rank: this rank; default the current rank.
        world_size: the number of ranks; default the current world size.

    Distributed:
        Build it on every rank, after the process group exists.
    """
    from datasets.distributed import split_dataset_by_node

    world = get_world_size() if world_size is None else world_size
    here = get_rank() if rank is None else rank
    shards = world * max(workers, 1)
    rows = len(dataset) - len(dataset) % shards
    if rows == 0:
        raise ValueError(
            f"hf_stream(dataset=...) has {len(dataset)} rows, fewer than the {shards} shards it needs "
            f"({world} ranks x {max(workers, 1)} workers): every shard would be empty. Use fewer ranks or workers."
        )
    kept = dataset.select(range(rows)) if rows < len(dataset) else dataset
    stream = kept.to_iterable_dataset(num_shards=shards)
    return split_dataset_by_node(stream, rank=here, world_size=world)
