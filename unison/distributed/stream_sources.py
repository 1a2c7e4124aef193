"""What unison knows of streaming sources: whether one splits itself by rank, and where it stands.

:func:`stream_sharding` answers whether an ``IterableDataset`` already gives each rank its
own share (so :func:`~unison.distributed.prepare_loaders` may use it as is), or why not and
what to do; :func:`stream_problem` is the rule built on it that both ``prepare_loaders`` and
the Engine apply to a training stream. The position of each source's loader is registered with the data-position
contract (:func:`~unison.distributed.data_state.register_source`). The optional libraries
(Hugging Face ``datasets``, ``webdataset``) are never
imported here: a dataset can only be one of theirs if its library is already loaded.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from unison.distributed.data_state import DataPosition, register_source, type_name
from unison.distributed.iterable import ShardedStream

WRAP_FIX = "wrap it: unison.distributed.shard_stream(dataset)"


@dataclass(frozen=True)
class Sharding:
    """Whether a stream gives each rank its own share; ``fix`` says what to do when it does not."""

    by_rank: bool
    fix: str = ""


def _module(name: str) -> Any:
    return sys.modules.get(name)


def _is_instance(obj: Any, module: str, attr: str) -> bool:
    loaded = _module(module)
    cls = getattr(loaded, attr, None) if loaded is not None else None
    return isinstance(cls, type) and isinstance(obj, cls)


def _webdataset_stages(dataset: Any) -> list[Any] | None:
    if not _is_instance(dataset, "webdataset", "DataPipeline"):
        return None
    return list(getattr(dataset, "pipeline", []))


def stream_sharding(dataset: Any, world_size: int) -> Sharding:
    """Whether ``dataset`` (an ``IterableDataset``) yields only this rank's share at ``world_size`` ranks."""
    if isinstance(dataset, ShardedStream) or getattr(dataset, "shards_itself", False) is True:
        return Sharding(True)
    if _is_instance(dataset, "datasets", "IterableDataset"):
        split = getattr(dataset, "_distributed", None)
        if split is not None and getattr(split, "world_size", None) == world_size:
            return Sharding(True)
        got = "not split" if split is None else f"split for world_size={split.world_size}"
        return Sharding(
            world_size == 1,
            f"it is {got}: call datasets.distributed.split_dataset_by_node(dataset, rank=rank, "
            f"world_size={world_size}) on every rank, or {WRAP_FIX}",
        )
    stages = _webdataset_stages(dataset)
    if stages is not None:
        lists = _module("webdataset.shardlists")
        split_by_node = getattr(lists, "split_by_node", None)
        if split_by_node is not None and any(stage is split_by_node for stage in stages):
            return Sharding(True)
        return Sharding(
            world_size == 1,
            "it has no node splitter (WebDataset's default, single_node_only, refuses more than one rank): "
            "pass WebDataset(urls, nodesplitter=webdataset.split_by_node), or add webdataset.split_by_node "
            "to the DataPipeline before its worker splitter",
        )
    return Sharding(
        world_size == 1,
        f"nothing says it splits by rank, so every rank would train on the same samples: {WRAP_FIX}, "
        "or use the library's own split by rank (Hugging Face: datasets.distributed.split_dataset_by_node; "
        "WebDataset: nodesplitter=webdataset.split_by_node)",
    )


def splits_by_worker(dataset: Any) -> bool:
    """Whether ``dataset`` gives each DataLoader worker its own share (the sources unison knows)."""
    if isinstance(dataset, ShardedStream) or getattr(dataset, "shards_itself", False) is True:
        return True
    if _is_instance(dataset, "datasets", "IterableDataset"):
        return True  # it deals its shards to the workers (a worker beyond the shard count gets none)
    lists = _module("webdataset.shardlists")
    stages = _webdataset_stages(dataset)
    return bool(stages) and any(stage is getattr(lists, "split_by_worker", None) for stage in stages or [])


SHARDS_ITSELF = (
    "set dataset.shards_itself = True if it yields only its own process's share (split by "
    "unison.distributed.get_rank() and by torch.utils.data.get_worker_info())"
)


def stream_problem(dataset: Any, world_size: int, num_workers: int) -> str | None:
    """Why ``dataset`` (an ``IterableDataset``) would be read more than once an epoch by
    ``world_size`` ranks, each with ``num_workers`` loader workers, with the fix; None when every
    process reads its own share. The one rule :func:`~unison.distributed.prepare_loaders` and the
    Engine apply; it reads the dataset's type and attributes only, the same on every rank.
    """
    name = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    sharding = stream_sharding(dataset, world_size)
    if not sharding.by_rank:
        return (
            f"a stream, {name}, that does not split by rank while {world_size} ranks run: {sharding.fix}; "
            f"or {SHARDS_ITSELF}"
        )
    if num_workers > 1 and not splits_by_worker(dataset):
        return (
            f"num_workers={num_workers} over a stream, {name}, that nothing says splits by worker: each worker "
            f"would yield the whole stream, so every sample would train {num_workers} times an epoch. Fix: "
            f"{WRAP_FIX} (it splits by rank and by worker), or {SHARDS_ITSELF}, or num_workers=0"
        )
    return None


@register_source
def stream_position(loader: Any) -> DataPosition | None:
    """The position of a loader over a WebDataset; None for any other loader.

    A :class:`~unison.distributed.iterable.ShardedStream` needs no entry of its own: it has
    ``state_dict``/``load_state_dict``, which the built-in answers for torchdata's
    ``StatefulDataLoader`` and for stateful datasets use.
    """
    dataset = getattr(loader, "dataset", None)
    if _webdataset_stages(dataset) is not None:
        return DataPosition(
            source=type_name(dataset),
            kind="none",
            scope=None,
            elastic=False,
            fix="save at epoch ends only, or use a source with state: unison.distributed.shard_stream over a "
            "deterministic iterable (its position is saved by torchdata's StatefulDataLoader)",
        )
    return None
