"""Collating a batch: torch's default, or torch_geometric's for graph items.

torch's ``default_collate`` cannot stack torch_geometric ``Data``/``HeteroData`` items (a
graph's tensors differ in size); torch_geometric's own loader joins them into one ``Batch``.
:func:`collate` picks between the two by the items it gets, so :func:`prepare_loaders`
needs no argument for graph datasets, and torch_geometric is imported only when graphs
are met: never on a machine without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import default_collate

_GRAPH_PACKAGE = "torch_geometric."


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
    if items and _holds_graphs(items[0]):
        from torch_geometric.loader.dataloader import Collater  # only where graphs are met

        return Collater(items)(items)
    return default_collate(items)
