"""Batches of any shape: moved to a device whole, and counted in items.

A batch is what a DataLoader yields: a pair of tensors, a dict of tensors (tokenizer
outputs), a dataclass, or an object that knows how to move itself (a torch_geometric
``Batch``, with ``.to(device, non_blocking=...)``). :func:`move_to_device` moves any of
them; :func:`count_items` says how many samples (graphs, for a graph batch) one holds.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch

_TAKES_NON_BLOCKING: dict[type, bool] = {}


def _to_takes_non_blocking(cls: type, to: Any) -> bool:
    """Whether ``cls``'s ``to`` method accepts ``non_blocking=`` (looked up once per class)."""
    known = _TAKES_NON_BLOCKING.get(cls)
    if known is None:
        try:
            params = inspect.signature(to).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature
            params = ()  # type: ignore[assignment]  # an empty view: takes no non_blocking
        known = any(p.name == "non_blocking" or p.kind is p.VAR_KEYWORD for p in params)
        _TAKES_NON_BLOCKING[cls] = known
    return known


def move_to_device(batch: Any, device: torch.device | str, non_blocking: bool = True) -> Any:
    """Copies every tensor inside ``batch`` to ``device``; the batch keeps its shape and types.

    Handles tensors; tuples (named ones too) and lists; dicts and other mappings; objects with
    a ``to(device, ...)`` method (a torch_geometric ``Batch``, a tokenizer's ``BatchEncoding``),
    called with ``non_blocking`` when their ``to`` takes it; and dataclasses, rebuilt with their
    fields moved. Anything else (strings, numbers, arrays) is returned as it is. A tensor
    already on ``device`` is not copied.

    Args:
        batch: what a DataLoader yielded.
        device: where the tensors go.
        non_blocking: asynchronous host-to-device copies (with pinned memory).

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Pair:
        ...     x: torch.Tensor
        ...     label: str
        >>> moved = move_to_device({"a": [torch.zeros(2)], "b": Pair(torch.ones(1), "cat")}, "cpu")
        >>> moved["b"].label, moved["a"][0].device.type
        ('cat', 'cpu')
    """
    if isinstance(batch, torch.Tensor):
        target = torch.device(device)
        if batch.device == target:
            return batch
        return batch.to(target, non_blocking=non_blocking)
    cls = batch.__class__
    if cls is list:
        return [move_to_device(item, device, non_blocking) for item in batch]
    if cls is tuple:
        return tuple(move_to_device(item, device, non_blocking) for item in batch)
    if cls is dict:
        return {key: move_to_device(value, device, non_blocking) for key, value in batch.items()}
    to = getattr(batch, "to", None)
    if callable(to) and not isinstance(batch, type):
        moved = to(device, non_blocking=non_blocking) if _to_takes_non_blocking(cls, to) else to(device)
        return batch if moved is None else moved  # some move in place and return nothing
    if isinstance(batch, tuple):
        items = [move_to_device(item, device, non_blocking) for item in batch]
        return cls(*items) if hasattr(batch, "_fields") else cls(items)
    if isinstance(batch, list):
        return cls(move_to_device(item, device, non_blocking) for item in batch)
    if isinstance(batch, Mapping):
        moved_items = {key: move_to_device(value, device, non_blocking) for key, value in batch.items()}
        try:
            return cls(moved_items)
        except TypeError:  # a mapping type that cannot be built from a dict (a defaultdict)
            return moved_items
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: move_to_device(getattr(batch, f.name), device, non_blocking)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def count_items(batch: Any) -> int | None:
    """The samples in a batch: graphs in a graph batch, rows otherwise; None when unclear.

    An object with an integer ``num_graphs`` (a torch_geometric ``Batch``) holds that many
    items, however many nodes and edges its tensors have. A tensor holds its first dimension;
    a tuple, list, mapping or dataclass, what its first countable member holds.

    Example:
        >>> count_items({"input_ids": torch.zeros(3, 7), "mask": torch.ones(3, 7)})
        3
        >>> count_items(torch.tensor(1.0)) is None
        True
    """
    graphs = getattr(batch, "num_graphs", None)
    if isinstance(graphs, int) and not isinstance(graphs, bool):
        return graphs
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        members: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        members = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        members = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    else:
        return None
    for member in members:
        count = count_items(member)
        if count is not None:
            return count
    return None
