"""Rank functions of tests/distributed/test_stream*.py: streams read by several ranks and workers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

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


def _refusal(build: Callable[[], object]) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return ""


def hf_stream_ids(size: int, num_shards: int, num_workers: int) -> dict:
    """The ids this rank reads from a Hugging Face streaming dataset split by node, and the
    error for the same dataset not split."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    full = datasets.Dataset.from_dict({"id": list(range(size))}).to_iterable_dataset(num_shards=num_shards)
    mine = split_dataset_by_node(full, rank=get_rank(), world_size=get_world_size())
    context = {"multiprocessing_context": "fork"} if num_workers else {}
    loader, _ = prepare_loaders(mine, batch_size=2, num_workers=num_workers, **context)
    return {
        "ids": [int(i) for batch in loader for i in batch["id"]],
        "refused": _refusal(lambda: prepare_loaders(full, batch_size=2)),
    }


def webdataset_ids(shards: list[str], num_workers: int) -> dict:
    """The ids this rank reads from a WebDataset with split_by_node, and the error for one with
    WebDataset's default node splitter."""
    import webdataset as wds

    def dataset(**kwargs: object) -> object:
        return (
            wds.WebDataset(shards, shardshuffle=False, empty_check=False, **kwargs).decode().to_tuple("txt")
        )

    context = {"multiprocessing_context": "fork"} if num_workers else {}
    loader, _ = prepare_loaders(
        dataset(nodesplitter=wds.split_by_node), batch_size=2, num_workers=num_workers, **context
    )
    return {
        "ids": [int(i) for (batch,) in loader for i in batch],
        "refused": _refusal(lambda: prepare_loaders(dataset(), batch_size=2)),
    }


def ddp_epochs_over_stream(size: int, num_workers: int, epochs: int) -> dict:
    """Trains a DDP model with unison's Engine over ``shard_stream``: each step's backward is a
    gradient all-reduce, so ranks that disagreed on an epoch's length would hang. Returns the
    ids of each epoch and the final weight."""
    from unison.distributed import prepare_model
    from unison.engine import Engine, Events

    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    context = {"multiprocessing_context": "fork"} if num_workers else {}
    loader, _ = prepare_loaders(
        shard_stream(IdStream(size)), batch_size=2, num_workers=num_workers, **context
    )

    def step(engine: Engine, batch: torch.Tensor) -> list[int]:
        optimizer.zero_grad()
        model(batch.float().unsqueeze(1)).sum().backward()
        optimizer.step()
        return batch.tolist()

    engine = Engine(step)
    seen: dict[int, list[int]] = {}

    @engine.on(Events.ITERATION_COMPLETED)
    def record(engine: Engine) -> None:
        seen.setdefault(engine.state.epoch, []).extend(engine.state.output)

    engine.run(loader, max_epochs=epochs)
    return {"seen": seen, "weight": float(next(model.parameters()).detach().sum())}
