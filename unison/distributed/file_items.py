"""Turning one file's samples into items, checking them, and loading saved items safely.

:func:`make_items` is the unit of preprocessing, the same in the calling process and in a
worker process: read each sample, drop it if ``pre_filter`` says so, turn it into an item
with ``pre_transform``, check it, and save the chunk with ``torch.save``. Saved items load
with ``torch.load(weights_only=True)``: the allow-list is torch's own plus, for
torch_geometric items, the few classes a ``Data`` or ``HeteroData`` pickles.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from unison.utils.exception_notes import add_note

__all__ = ["InvalidItemError", "item_problems", "load_items", "make_items"]

_GRAPH_CLASSES = {
    "torch_geometric.data.data": ("Data", "DataEdgeAttr", "DataTensorAttr"),
    "torch_geometric.data.hetero_data": ("HeteroData",),
    "torch_geometric.data.storage": ("BaseStorage", "GlobalStorage", "NodeStorage", "EdgeStorage"),
    "torch_geometric.data.graph_store": ("EdgeAttr",),
    "torch_geometric.data.feature_store": ("TensorAttr",),
}
"""What a pickled ``Data`` or ``HeteroData`` names beyond tensors (read from the pickles of
torch_geometric 2.8): the narrowest allow-list that loads them."""


class InvalidItemError(ValueError):
    """An item that ``validate_data`` refused: names the file, the sample and what is wrong."""


def item_problems(item: Any) -> list[str]:
    """What is wrong with an item: None, non-finite floats anywhere in it, or a torch_geometric
    item that fails its own ``validate()``. Empty when nothing is.

    Walks tensors inside mappings, lists, tuples, dataclasses and torch_geometric items.

    Example:
        >>> item_problems({"x": torch.tensor([1.0, float("nan")])})
        ['x holds 1 non-finite value(s) (nan or inf)']
    """
    if item is None:
        return ["the item is None (return False from pre_filter to drop a sample instead)"]
    problems: list[str] = []
    if type(item).__module__.startswith("torch_geometric.") and callable(getattr(item, "validate", None)):
        try:
            item.validate(raise_on_error=True)
        except ValueError as err:
            problems.append(f"torch_geometric's validate() says: {err}")
    for where, tensor in _tensors(item, ""):
        if tensor.is_floating_point() or tensor.is_complex():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                problems.append(f"{where or 'the item'} holds {bad} non-finite value(s) (nan or inf)")
    return problems


def _tensors(obj: Any, where: str) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{where}.{key}" if where else str(key))
    elif isinstance(obj, (list, tuple)):
        for k, value in enumerate(obj):
            yield from _tensors(value, f"{where}[{k}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, field.name), f"{where}.{field.name}" if where else field.name)
    elif type(obj).__module__.startswith("torch_geometric.") and callable(getattr(obj, "to_dict", None)):
        yield from _tensors(obj.to_dict(), where)


def make_items(
    path: Path,
    start: int,
    stop: int,
    reader: Callable[[Path, int], Any],
    pre_transform: Callable[[Any], Any] | None,
    pre_filter: Callable[[Any], bool] | None,
    validate: bool,
    out: Path | None,
) -> tuple[list[int], list[str], list[Any]]:
    """Samples ``start..stop-1`` of ``path`` as items: read, filter, transform, check.

    With ``out``, the items are saved there (``torch.save``, flushed to disk) and not
    returned; without, they are returned.

    Returns:
        ``(kept, types, items)``: the sample indices kept (in order), the qualified names of
        the item types, and the items (empty when saved).

    Raises:
        InvalidItemError: ``validate`` is set and an item fails :func:`item_problems`.
        Exception: whatever the user's functions raise, with a note naming the file and sample.
    """
    kept, items, types = [], [], set()
    for index in range(start, stop):
        try:
            raw = reader(path, index)
            if pre_filter is not None and not pre_filter(raw):
                continue
            item = raw if pre_transform is None else pre_transform(raw)
        except Exception as err:
            add_note(
                err,
                f"while preprocessing sample {index} of {path} (FileDataset reader/pre_filter/pre_transform)",
            )
            raise
        problems = item_problems(item) if validate or item is None else []
        if problems:
            raise InvalidItemError(
                f"FileDataset: sample {index} of {path} gives an invalid item: {'; '.join(problems)}. Fix the "
                "file or the pre_transform, drop such samples with pre_filter, or pass validate_data=False."
            )
        kept.append(index)
        items.append(item)
        types.add(f"{type(item).__module__}.{type(item).__qualname__}")
    if out is not None:
        with open(out, "wb") as f:
            torch.save(items, f)
            f.flush()
            os.fsync(f.fileno())
        items = []
    return kept, sorted(types), items


def load_items(path: Path, item_types: Sequence[str], extra_safe: Sequence[Any] = ()) -> list[Any]:
    """The items of one saved chunk, loaded with ``weights_only=True`` and memory-mapped
    (tensor data stays in the page cache, shared by every process that reads the file).

    Args:
        path: the chunk file.
        item_types: the item types the cache recorded; torch_geometric's classes are
            allowed only when one of them is a torch_geometric type.
        extra_safe: classes of the user's own item types, allowed as well.
    """
    allowed = list(extra_safe)
    if any(name.startswith("torch_geometric.") for name in item_types):
        allowed += _graph_classes()
    with torch.serialization.safe_globals(allowed):
        items = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(items, list):
        raise ValueError(
            f"{path} holds a {type(items).__name__}, not a list of items: it is not a FileDataset chunk."
        )
    return items


def _graph_classes() -> list[Any]:
    return [
        getattr(importlib.import_module(mod), name) for mod, names in _GRAPH_CLASSES.items() for name in names
    ]
