"""Collating a batch: torch's default, or torch_geometric's for graph items.

torch's ``default_collate`` cannot stack torch_geometric ``Data``/``HeteroData`` items (a
graph's tensors differ in size); torch_geometric's own loader joins them into one ``Batch``.
:func:`collate` picks between the two by the items it gets, so :func:`prepare_loaders`
needs no argument for graph datasets, and torch_geometric is imported only when graphs
are met: never on a machine without it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import default_collate

_GRAPH_PACKAGE = "torch_geometric."
_GRAPH_MODULE = "torch_geometric"
"""Imported in any process that holds a graph: its class (or a base) was defined in it."""
_KINDS_KEPT = 1024
"""How many item kinds :func:`collate` remembers the verdict of (a bound: kinds are few)."""
_graph_kinds: dict[Any, bool] = {}


def is_graph_item(item: Any) -> bool:
    """Whether ``item`` is a torch_geometric data object (or a subclass of one), told by the
    modules of its class and bases, without importing torch_geometric.

    Example:
        >>> import torch
        >>> is_graph_item(torch.zeros(2)), is_graph_item({"x": 1})
        (False, False)
    """
    return any(klass.__module__.startswith(_GRAPH_PACKAGE) for klass in type(item).__mro__)


def _holds_graphs(item: Any) -> bool:
    if is_graph_item(item):
        return True
    if isinstance(item, Mapping):
        return any(is_graph_item(value) for value in item.values())
    if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
        return any(is_graph_item(value) for value in item)
    return False


def _kind(item: Any) -> Any:
    """What decides :func:`_holds_graphs` for ``item``: its type, and for a tuple, a list or a dict,
    the types of its values; None where the values of another container would be needed."""
    if isinstance(item, (tuple, list)):
        return type(item), frozenset(map(type, item))
    if isinstance(item, dict):
        return type(item), frozenset(map(type, item.values()))
    if isinstance(item, (Mapping, Sequence)) and not isinstance(item, (str, bytes)):
        return None
    return type(item)


def _holds_graphs_once(item: Any) -> bool:
    """:func:`_holds_graphs`, looked up by the item's kind after its first batch: a few calls a
    batch in place of a walk over the item's classes and values."""
    kind = _kind(item)
    graphs = _graph_kinds.get(kind) if kind is not None else None
    if graphs is None:
        graphs = _holds_graphs(item)
        if kind is not None and len(_graph_kinds) < _KINDS_KEPT:
            _graph_kinds[kind] = graphs
    return graphs


def collate(items: list[Any]) -> Any:
    """Joins a list of dataset items into a batch.

    Items that are torch_geometric graphs (or pairs, tuples and dicts holding graphs) are
    joined by torch_geometric's collater, as its ``DataLoader`` does: one ``Batch`` whose
    ``num_graphs`` is the number of items, with a ``batch`` vector mapping nodes to graphs.
    Anything else goes to torch's ``default_collate``.

    Example:
        >>> import torch
        >>> collate([(torch.zeros(2), 0), (torch.ones(2), 1)])[1]
        tensor([0, 1])
    """
    if items and _GRAPH_MODULE in sys.modules and _holds_graphs_once(items[0]):
        from torch_geometric.loader.dataloader import Collater  # only where graphs are met

        return Collater(items)(items)
    return default_collate(items)
