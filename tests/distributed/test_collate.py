"""collate's graph check is remembered per kind of item, and still decides each batch as it did."""

from __future__ import annotations

import importlib
from collections import UserDict, namedtuple

import torch

collate_module = importlib.import_module("unison.distributed.collate")  # the package re-exports its function


class FakeGraph:
    """Told a graph by its module, as a torch_geometric ``Data`` is (nothing of torch_geometric is needed)."""


FakeGraph.__module__ = "torch_geometric.data.fake"
Pair = namedtuple("Pair", "x y")


def test_each_item_kind_gets_the_verdict_of_a_full_walk():
    graph, tensor = FakeGraph(), torch.zeros(2)
    items = [
        (tensor, 1),
        (graph, 1),  # a tuple again, another value type: another kind
        [tensor, tensor],
        [graph],
        {"x": tensor},
        {"x": graph},
        Pair(tensor, 1),
        Pair(graph, 1),
        graph,
        tensor,
        "text",
        UserDict(x=tensor),  # a mapping other than a dict: its values walked every time
        UserDict(x=graph),
    ]
    for _ in range(2):  # the second pass reads remembered verdicts
        got = [collate_module._holds_graphs_once(item) for item in items]
        assert got == [collate_module._holds_graphs(item) for item in items]
        assert got == [False, True, False, True, False, True, False, True, True, False, False, False, True]


def test_the_remembered_kinds_stay_bounded(monkeypatch):
    monkeypatch.setattr(collate_module, "_graph_kinds", {})
    monkeypatch.setattr(collate_module, "_KINDS_KEPT", 2)
    for kind in (int, float, str, bytes):
        collate_module._holds_graphs_once(kind())
    assert len(collate_module._graph_kinds) == 2
    assert collate_module.collate([(torch.zeros(1), 1), (torch.ones(1), 2)])[1].tolist() == [1, 2]


def test_without_torch_geometric_imported_no_item_is_walked(monkeypatch):
    """A graph's class is defined in torch_geometric: where it is not imported, no item is a graph."""
    import sys
    import types

    walked = []
    monkeypatch.setattr(collate_module, "_holds_graphs_once", lambda item: walked.append(item) or False)
    monkeypatch.delitem(sys.modules, "torch_geometric", raising=False)
    batch = collate_module.collate([(torch.zeros(1), 1), (torch.ones(1), 2)])
    assert batch[1].tolist() == [1, 2] and walked == []
    monkeypatch.setitem(sys.modules, "torch_geometric", types.ModuleType("torch_geometric"))
    collate_module.collate([(torch.zeros(1), 1)])
    assert len(walked) == 1, "once torch_geometric is imported, the first item is looked at"
