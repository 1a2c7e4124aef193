"""A sharded checkpoint's tensors read straight into the shards they load: no new memory, no copy.

DCP's ``FileSystemReader.read_data`` reads each tensor item with its own ``torch.load`` into a
tensor it has just allocated, then copies it into the shard the planner names
(``planner.resolve_tensor``). :func:`read_in_place` reads instead each item that fills its
shard whole (the request starts at the item's origin and spans the shard's size) with
:func:`~unison.checkpoint.archive_load.read_window`, whose big records go straight into that
shard's memory where the two are the same bytes (:mod:`unison.checkpoint.in_place`), each
record's CRC-32 checked where it has one (unison's saves leave them out: the whole file's CRC-32,
checked before any load, covers them; :mod:`unison.checkpoint.record_crcs`); the shard is then
committed as DCP would commit it. A tensor item under 1 MiB is decoded without a ``torch.load``
of its own where it is one plain tensor (:mod:`unison.checkpoint.dcp_small`). Every other item
(a value, a piece of a larger item, an item DCP transformed when it wrote it, a shard that is
not one plain contiguous CPU tensor) is left to DCP's own loop.

It reads DCP's description of where each item lies (``storage_data``: a file, an offset and a
length per item), which is not DCP's public interface: where that description is not there, or
not as expected, every item is left to DCP.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import unison.checkpoint.archive_load as archive_load  # its IN_PLACE_FROM looked up at each call
from unison.checkpoint.archive_load import read_window
from unison.checkpoint.archive_reader import reading_pool
from unison.checkpoint.dcp_small import read_small
from unison.checkpoint.in_place import Into
from unison.utils.run_files import open_fd

__all__ = ["read_in_place"]


def read_in_place(folder: Path, storage_data: Any, plan: Any, planner: Any) -> list[Any]:
    """Reads the tensor items of ``plan`` that fill their shard whole into those shards, and commits
    them; returns the items left for DCP's own ``read_data``, in their order."""
    from torch.distributed.checkpoint.planner import LoadItemType

    if not isinstance(storage_data, Mapping):
        return list(plan.items)
    mine: dict[str, list[tuple[Any, Any, torch.Tensor]]] = {}
    left: list[Any] = []
    small: list[Any] = []
    for item in plan.items:
        where = storage_data.get(item.storage_index)
        target = planner.resolve_tensor(item).detach() if item.type == LoadItemType.TENSOR else None
        if where is None or target is None or not _plain_item(where):
            left.append(item)
        elif where.length < archive_load.IN_PLACE_FROM:  # decoded without torch.load where it can be
            small.append(item)
        elif not _fills(item, target):
            left.append(item)
        else:
            mine.setdefault(where.relative_path, []).append((item, where, target))
    if small:  # the items DCP still reads, in the plan's order
        kept = {id(item) for item in left} | {
            id(item) for item in read_small(folder, storage_data, small, planner)
        }
        left = [item for item in plan.items if id(item) in kept]
    if not mine:
        return left
    with reading_pool() as pool:  # one set of threads for every item of every file
        for relative, items in mine.items():
            fd = open_fd(folder / relative)  # a link or a FIFO put there is refused, not followed
            try:
                for item, where, target in sorted(items, key=lambda entry: entry[1].offset):
                    loaded = read_window(fd, where.offset, where.length, into=Into(target), pool=pool)
                    if loaded is not target:  # a larger item, or another dtype: copied, as DCP does
                        target.copy_(_corner(loaded, target, f"{relative} for {item.storage_index.fqn}"))
                    planner.commit_tensor(item, target)
            finally:
                os.close(fd)
    return left


def _plain_item(where: Any) -> bool:
    """DCP's record of an item, as this reader expects it: a file name, an offset and a length,
    and no transform applied when it was written."""
    name = getattr(where, "relative_path", None)
    return (
        isinstance(name, str)
        and os.path.basename(name) == name  # a file of the folder itself
        and name not in ("", ".", "..")
        and isinstance(getattr(where, "offset", None), int)
        and isinstance(getattr(where, "length", None), int)
        and not getattr(where, "transform_descriptors", None)
    )


def _fills(item: Any, target: torch.Tensor) -> bool:
    """Whether the request reads its item from the origin over the whole of ``target``, a plain
    contiguous CPU tensor (the item may still be larger: :func:`read_in_place` then copies)."""
    return (
        type(target) is torch.Tensor
        and target.device.type == "cpu"
        and target.is_contiguous()
        and all(offset == 0 for offset in item.storage_offsets)
        and list(item.lengths) == list(target.shape)
    )


def _corner(loaded: Any, target: torch.Tensor, what: str) -> torch.Tensor:
    """The part of the item ``loaded`` that the request reads: from its origin, ``target``'s shape."""
    if not isinstance(loaded, torch.Tensor) or loaded.dim() != target.dim():
        shown = (
            f"a tensor of shape {tuple(loaded.shape)}"
            if isinstance(loaded, torch.Tensor)
            else type(loaded).__name__
        )
        raise ValueError(f"the item read from {what} is {shown}, not a tensor of {target.dim()} dimensions")
    for dim, length in enumerate(target.shape):
        if loaded.shape[dim] < length:
            raise ValueError(
                f"the item read from {what} has shape {tuple(loaded.shape)}, smaller than {tuple(target.shape)}"
            )
        loaded = loaded.narrow(dim, 0, length)
    return loaded
