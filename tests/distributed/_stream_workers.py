"""Rank functions of tests/distributed/test_stream*.py: streams read by several ranks and workers."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from unison.distributed import get_rank, get_world_size, prepare_loaders, shard_stream


class IdStream(IterableDataset):
    """Yields the sample ids ``0 .. size-1`` in every process that iterates it: a stream that
    does not split itself."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.size))


def ids_seen(loader: object, epochs: int) -> list[list[int]]:
    """The ids each epoch of ``loader`` yields, in order; an all-reduce after every batch, as a
    DDP gradient would, so ranks that disagree on the epoch's length would hang here."""
    seen = []
    for _ in range(epochs):
        ids: list[int] = []
        for batch in loader:  # type: ignore[attr-defined]
            ids.extend(int(i) for i in batch)
            if dist.is_initialized():
                dist.all_reduce(torch.ones(1))
        seen.append(ids)
    return seen


def wrapped_stream_ids(size: int, batch_size: int, num_workers: int, epochs: int) -> dict:
    """The ids this rank trains on through prepare_loaders over ``shard_stream(IdStream)``."""
    # Workers forked from the rank: a rank started by forkserver would otherwise start each worker
    # through its forkserver too, importing torch anew (seconds per worker on a busy machine).
    context = {"multiprocessing_context": "fork"} if num_workers else {}
    loader, _ = prepare_loaders(
        shard_stream(IdStream(size)), batch_size=batch_size, num_workers=num_workers, **context
    )
    return {"rank": get_rank(), "epochs": ids_seen(loader, epochs), "loader": type(loader).__name__}


def unsharded_stream_refused(size: int) -> str:
    """prepare_loaders' error for a stream that does not split by rank; '' if it accepted it."""
    try:
        prepare_loaders(IdStream(size), batch_size=2)
    except ValueError as error:
        return str(error)
    return ""


def hf_stream_ids(size: int, num_shards: int, batch_size: int, num_workers: int, split: bool) -> list[int]:
    """The ids this rank reads from a Hugging Face streaming dataset (split by node or not)."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    full = datasets.Dataset.from_dict({"id": list(range(size))}).to_iterable_dataset(num_shards=num_shards)
    if split:
        full = split_dataset_by_node(full, rank=get_rank(), world_size=get_world_size())
    loader, _ = prepare_loaders(full, batch_size=batch_size, num_workers=num_workers)
    return [int(i) for batch in loader for i in batch["id"]]


def webdataset_ids(shards: list[str], batch_size: int, num_workers: int, split: bool) -> list[int]:
    """The ids this rank reads from a WebDataset over tar shards (with split_by_node or the default)."""
    import webdataset as wds

    kwargs = {"nodesplitter": wds.split_by_node} if split else {}
    ds = wds.WebDataset(shards, shardshuffle=False, empty_check=False, **kwargs).decode().to_tuple("id")
    try:
        loader, _ = prepare_loaders(ds, batch_size=batch_size, num_workers=num_workers)
    except ValueError as error:
        return [-1, len(str(error))] if "split_by_node" in str(error) else [-2]
    return [int(i) for (batch,) in loader for i in batch]
